"""Each public release's rows -> a `QAExample` record: one converter per dataset for its own
releases, and FlashRAG's shared schema finished the same dataset's way (`jaxrag.data.loaders`
reads the rows and picks the converter). A row the paper does not evaluate or train on (a
popular PopQA entity, a claim that is neither true nor false, a PubHealth row without a label)
comes back as `LeftOut(reason)`, counted per reason by the loader. Every error names `file:row`
(`where`) and the field."""

from __future__ import annotations

import ast
import json
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxrag.data.schema import CLAIM, UNK_ANSWER, unk_message
from jaxrag.errors import JaxragError

Row = dict[str, Any]
Record = dict[str, Any]  # a QAExample.from_dict record, validated by it


@dataclass(frozen=True)
class LeftOut:
    """A row left out on purpose; `reason` is how the loader counts it (load message, data summary)."""

    reason: str


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


def _snake(key: str) -> str:
    """TriviaQA's original JSON names fields in CamelCase (`QuestionId`, `NormalizedAliases`);
    its Hub rows name the same fields in snake_case (`question_id`, `normalized_aliases`)."""
    return re.sub(r"(?<=[a-z])(?=[A-Z])", "_", key).lower()


def _answers(row: Row, keys: tuple[str, ...], where: str) -> list[str]:
    """Gold strings from a list, a string, TriviaQA's {value, aliases, human_answers} (either
    release's field names) or KILT's output list."""
    key = _key(row, keys, where)
    value = _decode(row[key])
    if isinstance(value, dict):
        value = {_snake(k): v for k, v in value.items()}
        value = [value.get("value"), *(value.get("aliases") or []), *(value.get("human_answers") or [])]
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
    """FlashRAG's JSONL (`{"id", "question", "golden_answers", "metadata"}`; multiple choice adds
    `choices` and gives the gold option's index), before its dataset's own finishing
    (`DatasetSpec.finish`: the same handling as the dataset's other releases)."""
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


def as_is(record: Record, where: str) -> Record:
    return record


# --- one converter per dataset, and its finishing of FlashRAG's rows -----------------------------

def short_qa(answer_keys: tuple[str, ...], id_keys: tuple[str, ...] = ("id",),
              meta_keys: tuple[str, ...] = ()) -> Callable[[Row, str], Record]:
    """Open questions: PopQA, TriviaQA, NQ (nq_open, KILT, DPR's CSV) and WoW (KILT: `input` is
    the dialogue so far, the answer its next turn)."""
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


def long_tail(record: Record, where: str) -> Record | LeftOut:
    """PopQA as the paper (after Self-RAG) evaluates it: the 1,399 long-tail questions, whose
    subject's Wikipedia page views `s_pop` are < 100. Rows without `s_pop` (Self-RAG's
    popqa_longtail_w_gs.jsonl) are that subset already."""
    metadata = record["metadata"]
    for key in ("s_pop", "o_pop"):
        if metadata.get(key) not in (None, ""):
            try:
                metadata[key] = int(float(metadata[key]))  # TSV/CSV cells are strings
            except (TypeError, ValueError):
                raise JaxragError(
                    f"{where}: field {key!r}: expected a number, got {metadata[key]!r}") from None
    if metadata.get("s_pop", 0) >= 100:
        return LeftOut("not long-tail (s_pop >= 100)")
    return record


_popqa_fields = short_qa(("possible_answers", "answers", "answer"),
                          meta_keys=("subj", "prop", "obj", "s_wiki_title", "o_wiki_title", "s_pop", "o_pop"))


def popqa(row: Row, where: str) -> Record | LeftOut:
    return long_tail(_popqa_fields(row, where), where)


_TRIVIAQA_PUNCTUATION = set(string.punctuation + "\u2018\u2019\u00b4`")


def triviaqa_normalize(text: str) -> str:
    """TriviaQA's own answer normalization (its evaluation's `normalize_answer`, which made the
    release's `normalized_aliases`): underscores and punctuation (curly quotes and accents too)
    become spaces, articles go, whitespace collapses. SQuAD's normalization (the metric's) drops
    punctuation instead, so a prediction "Eugene O Neill" matches "Eugene O'Neill" only in this
    form ("eugene o neill")."""
    text = text.replace("_", " ").lower()
    text = "".join(" " if ch in _TRIVIAQA_PUNCTUATION else ch for ch in text)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def with_normalized_aliases(record: Record, where: str, normalized: list | tuple = ()) -> Record:
    """TriviaQA's golds as its evaluation counts them: the aliases and their normalized forms
    (the release's `normalized_aliases`, or the same normalization where a release has none)."""
    golds = record.get("golden_answers")
    if isinstance(golds, list) and all(isinstance(g, str) for g in [*golds, *normalized]):
        forms = [*golds, *normalized, *map(triviaqa_normalize, golds)]
        record["golden_answers"] = list(dict.fromkeys(g for g in forms if g.strip()))
    return record


_triviaqa_fields = short_qa(("answers", "answer"), ("question_id", "id"))


def triviaqa(row: Row, where: str) -> Record:
    """TriviaQA: Hub rows (`answer: {value, aliases, normalized_aliases}`), the original release's
    JSON (`Question`, `QuestionId`, `Answer: {Value, Aliases, NormalizedAliases}`), Self-RAG's
    JSONL and DPR's CSV (`answers`)."""
    row = {_snake(k): v for k, v in row.items()}
    answer = _decode(row.get("answer"))
    answer = {_snake(k): v for k, v in answer.items()} if isinstance(answer, dict) else {}
    return with_normalized_aliases(_triviaqa_fields(row, where), where,
                                   list(answer.get("normalized_aliases") or []))


_CLAIM_LABELS = {"true": "true", "supports": "true", "false": "false", "refutes": "false"}
_LEFT_OUT = {"mixture", "unproven", "not enough info"}  # the paper keeps true/false only
_HEALTH_FACT_NAMES = ("false", "mixture", "true", "unproven")  # HF health_fact ClassLabel order
_CLAIM_FORM = re.compile(r"Claim: (.+) True or false\?", re.S)  # CLAIM, as jaxrag writes it


def _claim(ident: Any, text: str, label: str, where: str, key: str) -> Record | LeftOut:
    if label.lower() in _LEFT_OUT:
        return LeftOut(f"label {label.lower()}")
    if label.lower() not in _CLAIM_LABELS:
        raise JaxragError(f"{where}: field {key!r}: unknown label {label!r} "
                          f"(expected one of {sorted(_CLAIM_LABELS | dict.fromkeys(_LEFT_OUT))})")
    sentence = text if text[-1:] in ".!?" else text + "."
    return {"id": ident, "question": CLAIM.format(s=sentence),
            "golden_answers": [_CLAIM_LABELS[label.lower()]],
            "metadata": {"claim": text, "label": label}}


def _release_label(raw: Any) -> str | LeftOut:
    """PubHealth's `label` column (HF health_fact's class index or the TSV's name). The release
    has rows without a usable one (the TSV empty or stray labels, HF's health_fact -1 for them):
    they are left out and counted, never scored."""
    if isinstance(raw, str) and raw.strip().lstrip("-").isdigit():
        raw = int(raw)  # health_fact labels written to TSV/CSV
    if isinstance(raw, int) and not isinstance(raw, bool):
        if raw == -1:
            return LeftOut("no label")
        return _HEALTH_FACT_NAMES[raw] if 0 <= raw < len(_HEALTH_FACT_NAMES) else LeftOut("unknown label")
    if not isinstance(raw, str) or not raw.strip():
        return LeftOut("no label")
    known = raw.strip().lower() in _CLAIM_LABELS or raw.strip().lower() in _LEFT_OUT
    return raw.strip() if known else LeftOut("unknown label")


def claim(row: Row, where: str) -> Record | LeftOut:
    """PubHealth (HF health_fact, the TSV release, Self-RAG's processed JSONL) and FEVER (KILT)."""
    text = _text(row, ("claim", "question", "input"), where).strip()
    key = next((k for k in ("label", "answers", "answer", "output") if k in row), "label")
    label = _release_label(row[key]) if key == "label" else _answers(row, (key,), where)[0]
    if isinstance(label, LeftOut):
        return label
    return _claim(_id(row, "claim_id", "id"), text, label, where, key)


def shared_claim(record: Record, where: str) -> Record | LeftOut:
    """FlashRAG's FEVER (`golden_answers: ["SUPPORTS"]`) and PubHealth rows: the question is the
    claim, asked and labelled as the other releases are ("true"/"false")."""
    golds, question = record.get("golden_answers"), record.get("question")
    if not isinstance(question, str) or not question.strip():
        raise JaxragError(f"{where}: field 'question': expected a non-empty string")
    if not isinstance(golds, list) or not golds or not isinstance(golds[0], str) or not golds[0].strip():
        raise JaxragError(f"{where}: field 'golden_answers': expected the claim's label first")
    asked = _CLAIM_FORM.fullmatch(question.strip())  # jaxrag's own files ask it already
    out = _claim(record.get("id"), asked.group(1) if asked else question.strip(), golds[0].strip(),
                 where, "golden_answers")
    if isinstance(out, dict):
        out["metadata"] = {**record["metadata"], **out["metadata"]}
    return out


def multiple_choice(row: Row, where: str) -> Record:
    """ARC and OpenBookQA: HF (`question` or `question_stem` + `choices: {text, label}`), the
    original JSONL (`question: {stem, choices: [{text, label}]}`) and TFDS's openbookqa
    (`question: {stem, choice_A, .., choice_D}`), all with `answerKey`."""
    question = _field(row, ("question", "question_stem"), where)
    if isinstance(question, dict):
        stem, choices = _text(question, ("stem",), where + ": question"), question.get("choices")
        lettered = sorted(k for k in question if re.fullmatch(r"choice_[A-Z]", k))
        if choices is None and lettered:
            choices = {"text": [question[k] for k in lettered], "label": [k[-1] for k in lettered]}
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


def shared_choice(record: Record, where: str) -> Record:
    """FlashRAG's ARC and OpenBookQA rows: the options in `choices`, the gold one among them."""
    choices, golds = record.get("choices"), record.get("golden_answers")
    if not isinstance(choices, list) or not choices:
        raise JaxragError(f"{where}: field 'choices': missing or empty (a multiple-choice row gives "
                          "its options in `choices` and the gold option's index in `golden_answers`)")
    if not isinstance(golds, list) or not golds or golds[0] not in choices:
        raise JaxragError(f"{where}: field 'golden_answers': expected the gold option, one of the "
                          f"choices (or its index), got {golds!r}")
    labels = _letters(len(choices))
    record["metadata"].setdefault("answer_key", labels[choices.index(golds[0])])
    record["metadata"].setdefault("choice_labels", labels)
    return record


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
