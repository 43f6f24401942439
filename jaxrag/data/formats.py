"""Each public release's rows -> a `QAExample` record: one converter per dataset, and FlashRAG's
shared schema for any of them (`jaxrag.data.loaders` reads the rows and picks the converter).
Every error names `file:row` (`where`) and the field."""

from __future__ import annotations

import ast
import json
import string
from collections.abc import Callable
from typing import Any

from jaxrag.data.schema import CLAIM, UNK_ANSWER, unk_message
from jaxrag.errors import JaxragError

Row = dict[str, Any]
Record = dict[str, Any]  # a QAExample.from_dict record, validated by it


# --- field helpers ------------------------------------------------------------------------------

def _present(value: Any) -> bool:
    return value not in (None, [], {}) and not (isinstance(value, str) and not value.strip())


def _key(row: Row, keys: tuple[str, ...], where: str) -> str:
    """The first of `keys` present and non-blank: public releases name the same field differently."""
    for key in keys:
        if _present(row.get(key)):
            return key
    also = f" (nor {', '.join(map(repr, keys[1:]))})" if len(keys) > 1 else ""
    raise JaxragError(f"{where}: field {keys[0]!r}: missing or empty{also}")


def _field(row: Row, keys: tuple[str, ...], where: str) -> Any:
    return row[_key(row, keys, where)]


def _decode(value: Any) -> Any:
    """Lists/objects stored as strings (PopQA's JSON-encoded `possible_answers`, CSV cells)."""
    if isinstance(value, str) and value and value[0] in "[{":
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            try:
                return ast.literal_eval(value)  # Python reprs, as pandas writes lists to CSV
            except (ValueError, SyntaxError):
                return value
    return value


def _answers(row: Row, keys: tuple[str, ...], where: str) -> list[str]:
    """Gold strings from a list, a string, TriviaQA's {value, aliases} or KILT's output list."""
    key = _key(row, keys, where)
    value = _decode(row[key])
    if isinstance(value, dict):
        value = [value.get("value"), *(value.get("aliases") or [])]
    items = value if isinstance(value, list) else [value]
    answers = []
    for item in items:
        if isinstance(item, dict):
            item = item.get("answer")  # KILT: entries with only provenance carry no answer
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            item = str(item)  # a year or count written as a JSON number
        if isinstance(item, str) and item.strip() == UNK_ANSWER:
            raise JaxragError(f"{where}: field {key!r}: {unk_message()}")
        if isinstance(item, str) and item.strip() and item not in answers:
            answers.append(item)
        elif item is not None and not isinstance(item, str):
            raise JaxragError(f"{where}: field {key!r}: expected strings, got {item!r}")
    if not answers:
        raise JaxragError(f"{where}: field {key!r}: no answer")
    return answers


def _text(row: Row, keys: tuple[str, ...], where: str) -> str:
    value = _field(row, keys, where)
    if not isinstance(value, str):
        raise JaxragError(f"{where}: field {keys[0]!r}: expected a string, got {value!r}")
    return value


def _id(row: Row, *keys: str) -> str | None:
    return next((str(row[k]) for k in keys if row.get(k) not in (None, "")), None)


def _letters(n: int) -> list[str]:
    return list(string.ascii_uppercase[:n])


def shared_schema(row: Row, where: str) -> Record:
    """FlashRAG's JSONL: the shared schema, where multiple choice gives gold option indices."""
    record = {k: row[k] for k in ("id", "question", "golden_answers", "choices") if k in row}
    metadata = row.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise JaxragError(f"{where}: field 'metadata': expected an object")
    metadata = dict(metadata)
    metadata.update({k: v for k, v in row.items() if k not in (*record, "metadata")})
    golds, choices = row.get("golden_answers"), row.get("choices") or None
    if choices and isinstance(golds, list) and golds and all(type(g) is int for g in golds):
        if not all(0 <= g < len(choices) for g in golds):
            raise JaxragError(f"{where}: field 'golden_answers': option index out of range")
        record["golden_answers"] = [choices[g] for g in golds]
        metadata["answer_key"] = _letters(len(choices))[golds[0]]
    if not choices:
        record.pop("choices", None)  # FlashRAG writes [] for open questions
    record["metadata"] = metadata
    return record


# --- one converter per dataset ------------------------------------------------------------------

def short_qa(answer_keys: tuple[str, ...], id_keys: tuple[str, ...] = ("id",),
              meta_keys: tuple[str, ...] = ()) -> Callable[[Row, str], Record]:
    """Open questions: PopQA, TriviaQA, NQ (nq_open, KILT) and WoW (KILT: `input` is the dialogue
    so far, the answer its next turn)."""
    def convert(row: Row, where: str) -> Record:
        metadata = {k: _decode(row[k]) for k in meta_keys if row.get(k) not in (None, "")}
        if isinstance(row.get("output"), list):  # KILT: keep the provenance pages' titles
            titles = [p["title"] for o in row["output"] if isinstance(o, dict)
                      for p in o.get("provenance") or [] if p.get("title")]
            if titles:
                metadata["provenance_titles"] = list(dict.fromkeys(titles))
        return {"id": _id(row, *id_keys), "question": _text(row, ("question", "input"), where),
                "golden_answers": _answers(row, answer_keys, where), "metadata": metadata}
    return convert


_popqa_fields = short_qa(("possible_answers", "answers", "answer"),
                          meta_keys=("subj", "prop", "obj", "s_wiki_title", "o_wiki_title"))


def popqa(row: Row, where: str) -> Record | None:
    record = _popqa_fields(row, where)
    for key in ("s_pop", "o_pop"):
        if row.get(key) not in (None, ""):
            try:
                record["metadata"][key] = int(float(row[key]))  # TSV/CSV cells are strings
            except ValueError:
                raise JaxragError(
                    f"{where}: field {key!r}: expected a number, got {row[key]!r}") from None
    # The paper (after Self-RAG) evaluates the 1,399 long-tail questions: subject page views < 100.
    # Rows without s_pop (Self-RAG's popqa_longtail_w_gs.jsonl) are that subset already.
    if record["metadata"].get("s_pop", 0) >= 100:
        return None
    return record


_CLAIM_LABELS = {"true": "true", "supports": "true", "false": "false", "refutes": "false"}
_LEFT_OUT = {"mixture", "unproven", "not enough info"}  # the paper keeps true/false only
_HEALTH_FACT_NAMES = ("false", "mixture", "true", "unproven")  # HF health_fact ClassLabel order


def claim(row: Row, where: str) -> Record | None:
    """PubHealth (HF health_fact, the TSV release, Self-RAG's processed JSONL) and FEVER (KILT)."""
    text = _text(row, ("claim", "question", "input"), where).strip()
    key = next((k for k in ("label", "answers", "answer", "output") if k in row), "label")
    raw = _field(row, (key,), where)
    if isinstance(raw, str) and raw.strip().lstrip("-").isdigit():
        raw = int(raw)  # health_fact labels written to TSV/CSV
    if isinstance(raw, int) and not isinstance(raw, bool):
        if raw == -1:  # health_fact rows without a label
            return None
        if not 0 <= raw < len(_HEALTH_FACT_NAMES):
            raise JaxragError(f"{where}: field {key!r}: label {raw} is not 0..3")
        label = _HEALTH_FACT_NAMES[raw]
    else:
        label = _answers(row, (key,), where)[0]
    if label.lower() in _LEFT_OUT:
        return None
    if label.lower() not in _CLAIM_LABELS:
        raise JaxragError(f"{where}: field {key!r}: unknown label {label!r} "
                          f"(expected one of {sorted(_CLAIM_LABELS | dict.fromkeys(_LEFT_OUT))})")
    sentence = text if text[-1:] in ".!?" else text + "."
    return {"id": _id(row, "claim_id", "id"), "question": CLAIM.format(s=sentence),
            "golden_answers": [_CLAIM_LABELS[label.lower()]],
            "metadata": {"claim": text, "label": label}}


def multiple_choice(row: Row, where: str) -> Record:
    """ARC and OpenBookQA: HF (`question` or `question_stem` + `choices: {text, label}`) and the
    original JSONL (`question: {stem, choices: [{text, label}]}`), both with `answerKey`."""
    question = _field(row, ("question", "question_stem"), where)
    if isinstance(question, dict):
        stem, choices = _text(question, ("stem",), where + ": question"), question.get("choices")
    else:
        stem, choices = _text(row, ("question_stem", "question"), where), row.get("choices")
    choices = _decode(choices)
    if isinstance(choices, dict):
        texts, labels = choices.get("text"), choices.get("label")
    elif isinstance(choices, list) and all(isinstance(c, dict) for c in choices):
        texts, labels = [c.get("text") for c in choices], [c.get("label") for c in choices]
    else:
        texts = labels = None
    if (not texts or not isinstance(texts, list) or not isinstance(labels, list)
            or len(texts) != len(labels) or not all(isinstance(t, str) for t in texts)):
        raise JaxragError(f"{where}: field 'choices': expected {{text: [..], label: [..]}} "
                          "or a list of {text, label}")
    labels = [str(label) for label in labels]
    blank = next((label for label, text in zip(labels, texts) if not text.strip()), None)
    if blank is not None:
        raise JaxragError(f"{where}: field 'choices': option {blank!r} has no text")
    key = str(_field(row, ("answerKey",), where)).strip()
    if key not in labels:
        raise JaxragError(f"{where}: field 'answerKey': {key!r} is not a choice label {labels}")
    metadata = {"answer_key": key, "choice_labels": labels}
    if row.get("fact1"):
        metadata["fact"] = row["fact1"]  # OpenBookQA "additional": the science fact it tests
    return {"id": _id(row, "id"), "question": stem, "golden_answers": [texts[labels.index(key)]],
            "choices": texts, "metadata": metadata}


def asqa(row: Row, where: str) -> Record:
    """ASQA (HF din0s/asqa or ASQA.json): gold = the long answers; the disambiguated
    sub-questions' short answers go to metadata (for str-em)."""
    annotations = _decode(_field(row, ("annotations",), where))
    if not isinstance(annotations, list):
        raise JaxragError(f"{where}: field 'annotations': expected a list")
    long_answers = [a["long_answer"] for a in annotations
                    if isinstance(a, dict) and isinstance(a.get("long_answer"), str)
                    and a["long_answer"].strip()]
    if not long_answers:
        raise JaxragError(f"{where}: field 'annotations': no long_answer")
    pairs = [p for p in _decode(row.get("qa_pairs") or []) if isinstance(p, dict)]
    return {"id": _id(row, "sample_id", "id"),
            "question": _text(row, ("ambiguous_question", "question"), where),
            "golden_answers": long_answers,
            "metadata": {"ambiguous": True,
                         "sub_questions": [p.get("question", "") for p in pairs],
                         "short_answers": [list(p.get("short_answers") or []) for p in pairs]}}
