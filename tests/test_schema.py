"""The shared QA schema: validation names file:line and field; writes are atomic."""

import json

import pytest

from jaxrag.data.schema import (
    QAExample,
    corpus_record,
    read_examples,
    write_examples,
    write_jsonl,
)
from jaxrag.errors import JaxragError
from jaxrag.prompts import base_prompt_text

GOOD = {"id": "q1", "question": "Where?", "golden_answers": ["here"], "metadata": {"k": 1}}


def write_lines(path, *lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_round_trip(tmp_path):
    examples = [
        QAExample("a", "Where?", ("here", "there"), metadata={"popularity": 3}),
        QAExample("b", "Which?", ("x",), choices=("x", "y"), metadata={}),
    ]
    write_examples(tmp_path / "d.jsonl", examples)
    assert read_examples(tmp_path / "d.jsonl") == examples
    first = json.loads((tmp_path / "d.jsonl").read_text().splitlines()[0])
    assert "choices" not in first  # absent, not null, when not multiple choice


def test_integer_ids_and_blank_lines_are_accepted(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", json.dumps({**GOOD, "id": 7}), "")
    assert read_examples(path)[0].id == "7"


@pytest.mark.parametrize("record, field", [
    ({k: v for k, v in GOOD.items() if k != "question"}, "question"),
    ({**GOOD, "golden_answers": []}, "golden_answers"),
    ({**GOOD, "golden_answers": "here"}, "golden_answers"),
    ({**GOOD, "choices": ["a", 1]}, "choices"),
    ({**GOOD, "metadata": []}, "metadata"),
    ({**GOOD, "id": ""}, "id"),
    ({**GOOD, "answer": "x"}, "answer"),
])
def test_errors_name_file_line_and_field(tmp_path, record, field):
    path = write_lines(tmp_path / "d.jsonl", json.dumps(GOOD | {"id": "q0"}), json.dumps(record))
    with pytest.raises(JaxragError, match=rf"d\.jsonl:2: field '{field}'"):
        read_examples(path)


@pytest.mark.parametrize("change, message", [
    ({"golden_answers": ["here", "  "]}, "field 'golden_answers': entry 2 is empty"),
    ({"choices": ["here", ""]}, "field 'choices': entry 2 is empty"),
    ({"golden_answers": [" <unk>"]}, "field 'golden_answers': '<unk>' is the Hub's placeholder for a withheld "
     "answer, not an answer (TriviaQA's test split; use its validation split, huggingface/datasets#804)"),
])
def test_blank_and_withheld_answers_are_refused(tmp_path, change, message):
    path = write_lines(tmp_path / "d.jsonl", json.dumps(GOOD | {"id": "q0"}), json.dumps(GOOD | change))
    with pytest.raises(JaxragError) as info:
        read_examples(path)
    assert str(info.value) == f"{path}:2: {message}"


def test_invalid_json_names_the_line(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", json.dumps(GOOD), "{not json")
    with pytest.raises(JaxragError, match=r"d\.jsonl:2: invalid JSON"):
        read_examples(path)


def test_duplicate_ids_are_rejected(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", json.dumps(GOOD), json.dumps(GOOD))
    with pytest.raises(JaxragError, match=r"d\.jsonl:2: field 'id': duplicate id 'q1' .*line 1"):
        read_examples(path)


def test_failed_write_leaves_old_file_and_no_temp(tmp_path):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, [GOOD])

    def broken():
        yield GOOD
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        write_jsonl(path, broken())
    assert [p.name for p in tmp_path.iterdir()] == ["d.jsonl"]
    assert json.loads(path.read_text()) == GOOD


def test_prompt_question_lists_choices():
    assert QAExample("a", "Which?", ("x",), ("x", "y")).prompt_question() == (
        "Which? Choices: x, y.")
    assert QAExample("a", "Where?", ("x",)).prompt_question() == "Where?"


def test_corpus_record_and_knowledge_format():
    record = corpus_record("p1", "Title", "Some text.")
    assert record == {"id": "p1", "contents": "Title\nSome text."}
    assert base_prompt_text("Q?", [record["contents"], "B\nMore."]) == \
        "Question: Q? Background knowledge: Title\nSome text.\nB\nMore. Answer:"
    assert base_prompt_text("Q?") == "Question: Q? Answer:"
    with pytest.raises(ValueError):
        corpus_record("p2", "Two\nlines", "text")
