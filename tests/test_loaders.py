"""Real-dataset loaders, on small files written here in each public release's format."""

import json

import pytest
from data_files import jsonl, parquet, tsv

from jaxrag.data.loaders import DATASETS, load_dataset_examples
from jaxrag.data.schema import QAExample, read_examples, write_examples
from jaxrag.errors import JaxragError


def test_registry_names_the_papers_ten_datasets():
    assert set(DATASETS) == {"popqa", "triviaqa", "pubhealth", "arc_challenge",
                             "wow", "nq", "fever", "obqa", "arc_easy", "asqa"}
    assert {n for n, s in DATASETS.items() if s.role == "eval"} == {
        "popqa", "triviaqa", "pubhealth", "arc_challenge"}


POPQA = [  # akariasai/PopQA columns; possible_answers is a JSON-encoded list
    {"id": 4222362, "subj": "George Rankin", "prop": "occupation", "obj": "politician",
     "subj_id": 1, "question": "What is George Rankin's occupation?",
     "possible_answers": '["politician", "political leader"]', "s_pop": 42, "o_pop": 25692},
    {"id": 7, "subj": "Paris", "prop": "country", "obj": "France", "subj_id": 2,
     "question": "In what country is Paris?", "possible_answers": '["France"]',
     "s_pop": 900000, "o_pop": 1},
]


@pytest.mark.parametrize("write", [tsv, parquet], ids=["tsv", "parquet"])
def test_popqa_hf_columns_keep_the_long_tail(tmp_path, write):
    path = write(tmp_path / f"popqa.{write.__name__}", POPQA)
    [ex] = load_dataset_examples("popqa", path)  # Paris (s_pop >= 100) is not long-tail
    assert ex.id == "4222362"
    assert ex.question == "What is George Rankin's occupation?"
    assert ex.golden_answers == ("politician", "political leader")
    assert ex.choices is None
    assert dict(ex.metadata) == {"subj": "George Rankin", "prop": "occupation",
                                 "obj": "politician", "s_pop": 42, "o_pop": 25692}


def test_popqa_selfrag_jsonl_without_ids(tmp_path):
    path = jsonl(tmp_path / "popqa_longtail_w_gs.jsonl", [
        {"question": "Who was the director of Kiss?", "answers": ["Andy Warhol"],
         "ctxs": [{"title": "Kiss", "text": "..."}], "s_wiki_title": "Kiss (1963 film)"}])
    [ex] = load_dataset_examples("popqa", path)
    assert (ex.id, ex.golden_answers) == ("popqa-1", ("Andy Warhol",))
    assert dict(ex.metadata) == {"s_wiki_title": "Kiss (1963 film)"}


def test_triviaqa_hf_answer_dict_and_selfrag_jsonl(tmp_path):
    hf = {"question": "Which planet is red?", "question_id": "tc_1", "question_source": "web",
          "entity_pages": {"title": []},
          "answer": {"value": "Mars", "aliases": ["Mars", "Planet Mars"],
                     "normalized_aliases": ["mars", "planet mars"], "type": "WikipediaEntity",
                     "normalized_value": "mars", "matched_wiki_entity_name": "",
                     "normalized_matched_wiki_entity_name": ""}}
    [ex] = load_dataset_examples("triviaqa", parquet(tmp_path / "tqa.parquet", [hf]))
    assert (ex.id, ex.question, ex.golden_answers) == (  # and the normalized aliases
        "tc_1", "Which planet is red?", ("Mars", "Planet Mars", "mars", "planet mars"))
    path = jsonl(tmp_path / "triviaqa_test_w_gs.jsonl",
                 [{"question": "Who wrote Emma?", "answers": ["Jane Austen", "Austen"]}])
    [ex] = load_dataset_examples("triviaqa", path)  # TriviaQA's normalization where none is given
    assert (ex.id, ex.golden_answers) == ("triviaqa-1", ("Jane Austen", "Austen", "jane austen", "austen"))


HEALTH_FACT = [  # HF health_fact: label 0 false, 1 mixture, 2 true, 3 unproven
    {"claim_id": str(i), "claim": claim, "date_published": "", "explanation": "x",
     "fact_checkers": "", "main_text": "long", "sources": "", "label": label, "subjects": ""}
    for i, (claim, label) in enumerate([("Garlic cures flu.", 0), ("Tea is good.", 1),
                                        ("Exercise helps sleep", 2), ("Magnets heal.", 3)])
]


def test_pubhealth_hf_keeps_true_and_false(tmp_path):
    false, true = load_dataset_examples("pubhealth", parquet(tmp_path / "h.parquet", HEALTH_FACT))
    assert (false.id, false.question, false.golden_answers) == (
        "0", "Claim: Garlic cures flu. True or false?", ("false",))
    assert dict(false.metadata) == {"claim": "Garlic cures flu.", "label": "false"}
    assert true.question == "Claim: Exercise helps sleep. True or false?"  # period added
    assert true.golden_answers == ("true",)


def test_pubhealth_tsv_release_and_selfrag_jsonl(tmp_path):
    rows = [{**r, "label": ["false", "mixture", "true", "unproven"][r["label"]]}
            for r in HEALTH_FACT]
    assert [e.golden_answers for e in load_dataset_examples("pubhealth",
                                                            tsv(tmp_path / "t.tsv", rows))] == [
        ("false",), ("true",)]
    path = jsonl(tmp_path / "health_claims_processed.jsonl",
                 [{"question": "Vitamin C prevents colds.", "answers": ["false"]}])
    [ex] = load_dataset_examples("pubhealth", path)
    assert (ex.question, ex.golden_answers) == (
        "Claim: Vitamin C prevents colds. True or false?", ("false",))


ARC_HF = [
    {"id": "Mercury_1", "question": "Which is a source of heat?",
     "choices": {"text": ["ice", "the Sun", "snow", "a cloud"], "label": ["A", "B", "C", "D"]},
     "answerKey": "B"},
    {"id": "NYSED_2", "question": "What do plants need?",
     "choices": {"text": ["light", "sand", "noise"], "label": ["1", "2", "3"]}, "answerKey": "1"},
]


def test_arc_hf_parquet(tmp_path):
    ex, numeric = load_dataset_examples("arc_challenge", parquet(tmp_path / "a.parquet", ARC_HF))
    assert ex == QAExample("Mercury_1", "Which is a source of heat?", ("the Sun",),
                           ("ice", "the Sun", "snow", "a cloud"),
                           {"answer_key": "B", "choice_labels": ["A", "B", "C", "D"]})
    assert (numeric.golden_answers, numeric.choices) == (("light",), ("light", "sand", "noise"))
    assert dict(numeric.metadata) == {"answer_key": "1", "choice_labels": ["1", "2", "3"]}


def test_arc_and_obqa_original_jsonl(tmp_path):
    original = [{"id": "q1", "answerKey": "C", "fact1": "heat melts ice",
                 "question": {"stem": "What melts ice?", "choices": [
                     {"text": "cold", "label": "A"}, {"text": "dark", "label": "B"},
                     {"text": "heat", "label": "C"}, {"text": "wind", "label": "D"}]}}]
    path = jsonl(tmp_path / "ARC-Easy-Train.jsonl", original)
    [arc] = load_dataset_examples("arc_easy", path)
    [obqa] = load_dataset_examples("obqa", path)
    for ex in (arc, obqa):
        assert (ex.id, ex.question, ex.golden_answers) == ("q1", "What melts ice?", ("heat",))
        assert ex.choices == ("cold", "dark", "heat", "wind")
        assert dict(ex.metadata) == {"answer_key": "C", "choice_labels": list("ABCD"),
                                     "fact": "heat melts ice"}


def test_obqa_hf_question_stem(tmp_path):
    row = {"id": "7-980", "question_stem": "The sun is responsible for",
           "choices": {"text": ["puppies", "plants sprouting", "rain", "night"],
                       "label": ["A", "B", "C", "D"]}, "answerKey": "B"}
    [ex] = load_dataset_examples("obqa", parquet(tmp_path / "obqa.parquet", [row]))
    assert (ex.question, ex.golden_answers, ex.metadata["answer_key"]) == (
        "The sun is responsible for", ("plants sprouting",), "B")


def test_nq_open_jsonl(tmp_path):
    path = jsonl(tmp_path / "nq.jsonl", [
        {"question": "who sang hey jude", "answer": ["The Beatles"]},
        {"question": "when was the eiffel tower built", "answer": ["1887", 1889]}])
    one, two = load_dataset_examples("nq", path)
    assert (one.id, one.question, one.golden_answers) == (
        "nq-1", "who sang hey jude", ("The Beatles",))
    assert (two.id, two.golden_answers) == ("nq-2", ("1887", "1889"))


def test_fever_and_wow_kilt_jsonl(tmp_path):
    fever = jsonl(tmp_path / "fever-train-kilt.jsonl", [
        {"id": "75397", "input": "Nikolaj Coster-Waldau worked with Fox.",
         "output": [{"answer": "SUPPORTS", "provenance": [{"wikipedia_id": "1", "title": "N"}]}]},
        {"id": "150448", "input": "Roman Atwood is a content creator",
         "output": [{"answer": "REFUTES"}]}])
    sup, ref = load_dataset_examples("fever", fever)
    assert (sup.id, sup.question, sup.golden_answers) == (
        "75397", "Claim: Nikolaj Coster-Waldau worked with Fox. True or false?", ("true",))
    assert dict(sup.metadata) == {"claim": "Nikolaj Coster-Waldau worked with Fox.",
                                  "label": "SUPPORTS"}
    assert (ref.golden_answers, ref.metadata["label"]) == (("false",), "REFUTES")

    wow = jsonl(tmp_path / "wow-train-kilt.jsonl", [
        {"id": "w1", "input": "I like blue.\nMe too, it is calming.",
         "output": [{"answer": "Blue is one of the three primary colours.",
                     "provenance": [{"wikipedia_id": "3", "title": "Blue"}]},
                    {"provenance": [{"wikipedia_id": "4", "title": "Colour"}]}]}])
    [ex] = load_dataset_examples("wow", wow)
    assert (ex.id, ex.question) == ("w1", "I like blue.\nMe too, it is calming.")
    assert ex.golden_answers == ("Blue is one of the three primary colours.",)
    assert dict(ex.metadata) == {"provenance_titles": ["Blue", "Colour"]}


ASQA = {"sample_id": "-9204", "ambiguous_question": "Who played Ben in Undercover?",
        "qa_pairs": [{"context": "", "question": "Who played Ben in season 1?",
                      "short_answers": ["Ben Wright"], "wikipage": "Undercover"},
                     {"context": "", "question": "Who played Ben in season 2?",
                      "short_answers": ["Tom Jones", "Tommy Jones"], "wikipage": None}],
        "wikipages": [{"title": "Undercover", "url": "u"}],
        "annotations": [{"knowledge": [], "long_answer": "Ben Wright, then Tom Jones."},
                        {"knowledge": [], "long_answer": "Season 1: Ben Wright."}]}


def check_asqa(ex):
    assert (ex.id, ex.question) == ("-9204", "Who played Ben in Undercover?")
    assert ex.golden_answers == ("Ben Wright, then Tom Jones.", "Season 1: Ben Wright.")
    assert dict(ex.metadata) == {
        "ambiguous": True,
        "sub_questions": ["Who played Ben in season 1?", "Who played Ben in season 2?"],
        "short_answers": [["Ben Wright"], ["Tom Jones", "Tommy Jones"]]}


def test_asqa_hf_parquet_and_original_json(tmp_path):
    check_asqa(load_dataset_examples("asqa", parquet(tmp_path / "asqa.parquet", [ASQA]))[0])
    path = tmp_path / "ASQA.json"  # {"train": {sample_id: record}, "dev": {...}}
    path.write_text(json.dumps({"train": {}, "dev": {ASQA["sample_id"]: ASQA}}))
    check_asqa(load_dataset_examples("asqa", path, split="dev")[0])


def test_flashrag_rows_pass_through_for_any_name(tmp_path):
    path = jsonl(tmp_path / "test.jsonl", [
        {"id": "test_0", "question": "Which is heavier?", "golden_answers": [1],
         "choices": ["a feather", "a brick"], "metadata": {"src": "arc"}},
    ])
    [ex] = load_dataset_examples("arc_challenge", path)
    assert (ex.golden_answers, ex.choices) == (("a brick",), ("a feather", "a brick"))
    assert dict(ex.metadata) == {"src": "arc", "answer_key": "B", "choice_labels": ["A", "B"]}
    path = jsonl(tmp_path / "pop.jsonl", [{"id": "1", "question": "Q?", "golden_answers": ["a"],
                                          "choices": [], "output": {}}])
    [ex] = load_dataset_examples("popqa", path)
    assert (ex.choices, dict(ex.metadata)) == (None, {"output": {}})


def test_loaded_examples_round_trip_through_the_shared_schema(tmp_path):
    examples = load_dataset_examples("arc_challenge", parquet(tmp_path / "a.parquet", ARC_HF))
    write_examples(tmp_path / "out.jsonl", examples)
    assert read_examples(tmp_path / "out.jsonl") == examples


# --- bad input: one JaxragError naming file:row and the field ------------------------------------

def error(*args, **kwargs) -> str:
    with pytest.raises(JaxragError) as info:
        load_dataset_examples(*args, **kwargs)
    return str(info.value)


def test_unknown_name_missing_file_and_unsupported_type(tmp_path):
    assert "unknown dataset 'hotpotqa'" in error("hotpotqa", tmp_path / "x.jsonl")
    assert "popqa" in error("hotpotqa")  # lists the known names
    assert f"{tmp_path / 'missing.jsonl'}: no such file" in error("nq", tmp_path / "missing.jsonl")
    (tmp_path / "d.xml").write_text("<a/>")
    assert "unsupported file type '.xml'" in error("nq", tmp_path / "d.xml")


def test_row_errors_name_file_row_and_field(tmp_path):
    path = jsonl(tmp_path / "nq.jsonl", [{"question": "q1", "answer": ["a"]},
                                         {"answer": ["b"]}])
    msg = error("nq", path)
    assert msg.startswith(f"{path}:2: field 'question': missing")

    path = jsonl(tmp_path / "tqa.jsonl", [{"question": "q", "answers": []}])
    assert error("triviaqa", path).startswith(f"{path}:1: field 'answers': missing")

    path = tsv(tmp_path / "popqa.tsv", [{**POPQA[0], "s_pop": "many"}])
    assert error("popqa", path).startswith(f"{path}:1: field 's_pop': expected a number")

    bad_key = {**ARC_HF[0], "answerKey": "E"}
    path = parquet(tmp_path / "arc.parquet", [ARC_HF[1], bad_key])
    assert error("arc_challenge", path).startswith(f"{path}:2: field 'answerKey': 'E' is not")

    path = jsonl(tmp_path / "fever.jsonl", [{"id": "1", "input": "c", "output": [{"answer": "MAYBE"}]}])
    assert error("fever", path).startswith(f"{path}:1: field 'output': unknown label 'MAYBE'")

    path = jsonl(tmp_path / "asqa.jsonl", [{"ambiguous_question": "q", "annotations": []}])
    assert error("asqa", path).startswith(f"{path}:1: field 'annotations': missing")


def test_invalid_json_duplicate_ids_and_empty_results(tmp_path):
    path = tmp_path / "nq.jsonl"
    path.write_text('{"question": "q", "answer": ["a"]}\n\n{"question": \n')
    assert error("nq", path).startswith(f"{path}:3: invalid JSON")

    path = jsonl(tmp_path / "dup.jsonl", [{"id": 1, "question": "q", "answer": ["a"]},
                                          {"id": "1", "question": "r", "answer": ["b"]}])
    assert error("nq", path) == f"{path}:2: field 'id': duplicate id '1' (first at row 1)"

    path = parquet(tmp_path / "popular.parquet", POPQA[1:])
    assert "no popqa examples" in error("popqa", path)


def test_hub_offline_says_how_to_point_at_local_files():
    msg = error("popqa")  # conftest sets HF_HUB_OFFLINE=1; nothing is cached
    assert msg.startswith("popqa: could not load akariasai/PopQA split 'test' from the Hugging Face Hub (")
    assert msg.endswith("Offline, point at a local file in a public format "
                        "(.jsonl/.json/.tsv/.csv/.parquet): --config.data.paths.popqa=/path/to/popqa.jsonl")
    assert error("asqa").endswith(" --config.data.paths.asqa=/path/to/asqa.jsonl")


# Every dataset, in each public format: a row without a usable question or answer stops the load.
BAD_ROWS = [  # (dataset, writer, file name, good row, bad row, the error after "file:2: ")
    ("popqa", tsv, "popqa.tsv", POPQA[0], {**POPQA[0], "id": 9, "possible_answers": "[]"},
     "field 'possible_answers': no answer"),
    ("popqa", jsonl, "popqa_longtail_w_gs.jsonl", {"question": "Q?", "answers": ["a"]},
     {"question": "Q?", "answers": ["<unk>"]}, "field 'answers': <unk>"),
    ("triviaqa", parquet, "tqa.parquet",
     {"question": "Q?", "question_id": "t1", "answer": {"value": "a", "aliases": []}},
     {"question": "R?", "question_id": "t2", "answer": {"value": "<unk>", "aliases": []}}, "field 'answer': <unk>"),
    ("triviaqa", jsonl, "triviaqa_test_w_gs.jsonl", {"question": "Q?", "answers": ["a"]},
     {"question": "  ", "answers": ["b"]}, "field 'question': missing or empty (nor 'input')"),
    ("pubhealth", parquet, "h.parquet", HEALTH_FACT[0], {**HEALTH_FACT[2], "claim": " "},
     "field 'claim': missing or empty (nor 'question', 'input')"),
    ("pubhealth", tsv, "h.tsv", {"claim_id": 1, "claim": "c", "label": "true"},
     {"claim_id": 2, "claim": " ", "label": "false"}, "field 'claim': missing or empty (nor 'question', 'input')"),
    ("pubhealth", jsonl, "health_claims_processed.jsonl", {"question": "c", "answers": ["true"]},
     {"question": "d", "answers": ["<unk>"]}, "field 'answers': <unk>"),
    ("arc_challenge", parquet, "arc.parquet", ARC_HF[0],
     {**ARC_HF[0], "id": "x", "choices": {"text": ["a", "", "c"], "label": ["A", "B", "C"]}},
     "field 'choices': option 'B' has no text"),
    ("arc_easy", jsonl, "ARC-Easy-Train.jsonl",
     {"id": "q1", "answerKey": "A", "question": {"stem": "S?", "choices": [{"text": "x", "label": "A"}]}},
     {"id": "q2", "answerKey": "A", "question": {"stem": " ", "choices": [{"text": "x", "label": "A"}]}},
     "question: field 'stem': missing or empty"),
    ("obqa", parquet, "obqa.parquet",
     {"id": "o1", "question_stem": "S", "choices": ARC_HF[0]["choices"], "answerKey": "A"},
     {"id": "o2", "question_stem": "S", "choices": ARC_HF[0]["choices"], "answerKey": ""},
     "field 'answerKey': missing or empty"),
    ("nq", jsonl, "nq.jsonl", {"question": "q", "answer": ["a"]}, {"question": "r", "answer": ["", " "]},
     "field 'answer': no answer"),
    ("wow", jsonl, "wow-train-kilt.jsonl", {"id": "w1", "input": "hi", "output": [{"answer": "x"}]},
     {"id": "w2", "input": "hi", "output": [{"provenance": [{"title": "T"}]}]}, "field 'output': no answer"),
    ("fever", jsonl, "fever-train-kilt.jsonl", {"id": "f1", "input": "c", "output": [{"answer": "SUPPORTS"}]},
     {"id": "f2", "input": "d", "output": []}, "field 'output': missing or empty"),
    ("asqa", parquet, "asqa.parquet", ASQA, {**ASQA, "sample_id": "s2", "annotations": [{"long_answer": " "}]},
     "field 'annotations': no long_answer"),
    ("nq", jsonl, "flashrag.jsonl", {"id": "1", "question": "q", "golden_answers": ["a"]},
     {"id": "2", "question": "q", "golden_answers": ["b", " "]}, "field 'golden_answers': entry 2 is empty"),
    ("popqa", jsonl, "flashrag.jsonl", {"id": "1", "question": "q", "golden_answers": ["a"]},
     {"id": "2", "question": "q", "golden_answers": ["<unk>"]}, "field 'golden_answers': <unk>"),
]
UNK = ("'<unk>' is the Hub's placeholder for a withheld answer, not an answer "
       "(TriviaQA's test split; use its validation split, huggingface/datasets#804)")


@pytest.mark.parametrize("name, write, file, good, bad, field", BAD_ROWS,
                         ids=[f"{r[0]}-{r[2]}" for r in BAD_ROWS])
def test_each_format_refuses_rows_without_question_or_answer(tmp_path, name, write, file, good, bad, field):
    path = write(tmp_path / file, [good, bad])
    assert len(load_dataset_examples(name, write(tmp_path / ("ok-" + file), [good]))) == 1
    assert error(name, path) == f"{path}:2: {field.replace('<unk>', UNK)}"
