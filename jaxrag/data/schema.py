"""The shared QA-example schema (FlashRAG-compatible JSONL), corpus records, atomic I/O.

QA example:
`{"id", "question", "golden_answers": [..], "choices": [..] | absent, "metadata": {..}}`.
Corpus record: `{"id", "contents": "title\\ntext"}`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxrag.errors import JaxragError

_FIELDS = ("id", "question", "golden_answers", "choices", "metadata")
# The Hub's stand-in for a withheld answer (TriviaQA's test split: every answer is "<unk>",
# huggingface/datasets#804); scored as gold it would make accuracy ~0 without a word.
UNK_ANSWER = "<unk>"
# How a claim is asked (FEVER, PubHealth and the embedded world's claim sets); answers "true" / "false".
CLAIM = "Claim: {s} True or false?"


@dataclass(frozen=True)
class QAExample:
    """One question with its gold answers; `choices` is None unless multiple choice."""

    id: str
    question: str
    golden_answers: tuple[str, ...]
    choices: tuple[str, ...] | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @classmethod
    def from_dict(cls, record: Any, where: str = "record") -> QAExample:
        """Validates a decoded JSON record; errors name `where` (e.g. `file:line`) and the field."""
        if not isinstance(record, dict):
            raise JaxragError(f"{where}: expected a JSON object, got {type(record).__name__}")
        unknown = sorted(set(record) - set(_FIELDS))
        if unknown:
            raise JaxragError(f"{where}: field {unknown[0]!r}: unknown field (allowed: {_FIELDS})")
        ident = _required(record, "id", where)
        if not isinstance(ident, (str, int)) or isinstance(ident, bool) or str(ident) == "":
            raise JaxragError(f"{where}: field 'id': expected a non-empty string, got {ident!r}")
        question = _required(record, "question", where)
        if not isinstance(question, str) or not question.strip():
            raise JaxragError(f"{where}: field 'question': expected a non-empty string")
        answers = _string_list(_required(record, "golden_answers", where), "golden_answers", where)
        if any(a.strip() == UNK_ANSWER for a in answers):
            raise JaxragError(f"{where}: field 'golden_answers': {unk_message()}")
        choices = record.get("choices")
        if choices is not None:
            choices = _string_list(choices, "choices", where)
        metadata = record.get("metadata", {})
        if not isinstance(metadata, dict):
            raise JaxragError(f"{where}: field 'metadata': expected an object")
        return cls(str(ident), question, answers, choices, metadata)

    def to_dict(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "id": self.id,
            "question": self.question,
            "golden_answers": list(self.golden_answers),
        }
        if self.choices is not None:
            record["choices"] = list(self.choices)
        record["metadata"] = dict(self.metadata)
        return record

    def prompt_question(self) -> str:
        """The question as the model sees it: multiple-choice options are appended inline."""
        if self.choices is None:
            return self.question
        return f"{self.question} Choices: {', '.join(self.choices)}."


def question_key(dataset: str, question_id: str) -> str:
    """A question's name across the training mixture: ids are unique within a dataset only
    (FlashRAG numbers every file's rows `train_0`, `train_1`, ...), so the dataset leads, as in
    the embedded world's ids (`nq-train-00012`): `nq-train_7` and `fever-train_7`."""
    return f"{dataset}-{question_id}"


def _required(record: dict, name: str, where: str) -> Any:
    if name not in record:
        raise JaxragError(f"{where}: field {name!r}: missing")
    return record[name]


def unk_message() -> str:
    return (f"{UNK_ANSWER!r} is the Hub's placeholder for a withheld answer, not an answer "
            "(TriviaQA's test split; use its validation split, huggingface/datasets#804)")


def _string_list(value: Any, name: str, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise JaxragError(f"{where}: field {name!r}: expected a non-empty list of strings")
    blank = next((i for i, v in enumerate(value, start=1) if not v.strip()), None)
    if blank is not None:
        raise JaxragError(f"{where}: field {name!r}: entry {blank} is empty")
    return tuple(value)


def corpus_record(passage_id: str, title: str, text: str) -> dict[str, str]:
    """A corpus passage in the shared JSONL form; the title is the first line of `contents`."""
    if "\n" in title:
        raise ValueError(f"passage {passage_id}: title must be one line, got {title!r}")
    return {"id": passage_id, "contents": f"{title}\n{text}"}


def read_examples(path: str | os.PathLike) -> list[QAExample]:
    """Reads a QA JSONL file; errors name `file:line` and the offending field."""
    examples, first_line = [], {}
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise JaxragError(f"{where}: invalid JSON: {e.msg}") from None
            example = QAExample.from_dict(record, where)
            if example.id in first_line:
                raise JaxragError(
                    f"{where}: field 'id': duplicate id {example.id!r} "
                    f"(first on line {first_line[example.id]})"
                )
            first_line[example.id] = line_no
            examples.append(example)
    return examples


def write_examples(path: str | os.PathLike, examples: Iterable[QAExample]) -> None:
    write_jsonl(path, (e.to_dict() for e in examples))


def write_jsonl(path: str | os.PathLike, records: Iterable[Mapping[str, Any]]) -> None:
    """Writes one JSON object per line to a temp file in the same folder, then renames it, so
    readers never see a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # plain open: honours the umask
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
