"""Answer metrics as the paper reports them (after Self-RAG's short-form evaluation), plus the
source-selection numbers of its Table 2.

"Lexical postprocessing ... accuracy for PubHealth and ARC and substring matching for PopQA and
TriviaQA": `substring_match` (normalized gold inside the normalized prediction),
`true_false_accuracy` (the first true/false word of the prediction) and `choice_accuracy` (the
option letter, or the option text, the prediction picks). Self-RAG's `match` compares raw strings;
normalizing both sides (SQuAD's `normalize_answer`, as FlashRAG's `acc`) only forgives case and
punctuation. Training-mixture datasets get ASQA's str-em and WoW's (KILT) token F1.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

from jaxrag.data.loaders import DATASETS
from jaxrag.data.schema import QAExample
from jaxrag.errors import JaxragError

_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD: lowercase, drop punctuation and articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def substring_match(prediction: str, golden_answers: Sequence[str]) -> float:
    """1.0 when some normalized gold answer occurs in the normalized prediction (PopQA, TriviaQA,
    NQ). Golds that normalize to nothing (e.g. "The") are skipped: "" is in every string."""
    pred = normalize_answer(prediction)
    return float(any(gold and gold in pred for gold in map(normalize_answer, golden_answers)))


_TRUE_FALSE = {"true": "true", "supports": "true", "false": "false", "refutes": "false"}


def extract_true_false(prediction: str) -> str | None:
    """The first true/false word (FEVER's SUPPORTS/REFUTES too, as Self-RAG maps them), or None."""
    for word in normalize_answer(prediction).split():
        if word in _TRUE_FALSE:
            return _TRUE_FALSE[word]
    return None


def true_false_accuracy(prediction: str, golden_answers: Sequence[str]) -> float:
    """PubHealth / FEVER: the extracted label equals the gold "true"/"false"."""
    label = extract_true_false(prediction)
    return float(label is not None and label == normalize_answer(golden_answers[0]))


# A bare option letter, as "B", "B.", "B)", "(B)", "B:" or "Answer: B". A letter followed by a
# word ("A plant needs ...") is an article, not a choice, and falls through to text matching.
_LETTER = re.compile(
    r"^\s*(?i:(?:the\s+)?(?:correct\s+)?(?:answer|option|choice)\s*(?:is)?\s*:?\s*)?"  # prefix
    r"(?:\(([A-Z]|[1-9])\)|([A-Z]|[1-9])(?:[.:)]|\s*$))")


def extract_choice(prediction: str, choices: Sequence[str],
                   labels: Sequence[str] | None = None) -> int | None:
    """Index of the option the prediction picks: its letter (A, B, ... by position, or the
    dataset's own labels such as ARC's "1".."4"), else the option text occurring first in it
    (the longest at the same place, so "heat energy" beats "heat"), else None."""
    m = _LETTER.match(prediction)
    if m:
        letter = m.group(1) or m.group(2)
        for candidates in (labels or [], string.ascii_uppercase[:len(choices)]):
            if letter in candidates:
                return list(candidates).index(letter)
    pred = f" {normalize_answer(prediction)} "
    best = None  # (position, -length, index)
    for i, choice in enumerate(choices):
        option = normalize_answer(choice)
        pos = pred.find(f" {option} ") if option else -1  # whole words only
        if pos >= 0 and (best is None or (pos, -len(option)) < best[:2]):
            best = (pos, -len(option), i)
    return None if best is None else best[2]


def choice_accuracy(prediction: str, example: QAExample) -> float:
    """ARC / OpenBookQA: the picked option is the gold one (`golden_answers[0]` is its text)."""
    if not example.choices or example.golden_answers[0] not in example.choices:
        raise JaxragError(f"example {example.id}: multiple choice needs `choices` holding the "
                          "gold answer")
    picked = extract_choice(prediction, example.choices, example.metadata.get("choice_labels"))
    return float(picked is not None and example.choices[picked] == example.golden_answers[0])


def token_f1(prediction: str, golden_answers: Sequence[str]) -> float:
    """SQuAD/KILT token F1, the best over the golds (Wizard of Wikipedia)."""
    pred = normalize_answer(prediction).split()
    best = 0.0
    for gold in golden_answers:
        gold_tokens = normalize_answer(gold).split()
        same = sum((Counter(pred) & Counter(gold_tokens)).values())
        if same:
            precision, recall = same / len(pred), same / len(gold_tokens)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def str_em(prediction: str, short_answers: Sequence[Sequence[str]]) -> float:
    """ASQA (ALCE): the fraction of disambiguated sub-questions whose short answers occur."""
    if not short_answers:
        return 0.0
    return sum(substring_match(prediction, golds) for golds in short_answers) / len(short_answers)


METRICS = {
    "match": lambda pred, ex: substring_match(pred, ex.golden_answers),
    "true_false": lambda pred, ex: true_false_accuracy(pred, ex.golden_answers),
    "choice": choice_accuracy,
    "f1": lambda pred, ex: token_f1(pred, ex.golden_answers),
    # ASQA rows carry sub-question short answers; without them, match against the golds.
    "str_em": lambda pred, ex: str_em(pred, ex.metadata.get("short_answers")
                                      or [[g] for g in ex.golden_answers]),
}


def metric_name(dataset_or_metric: str) -> str:
    """A dataset name (`loaders.DATASETS`, same names as the embedded world's) or a metric name."""
    if dataset_or_metric in DATASETS:
        return DATASETS[dataset_or_metric].metric
    if dataset_or_metric in METRICS:
        return dataset_or_metric
    raise JaxragError(f"unknown dataset or metric {dataset_or_metric!r} "
                      f"(datasets: {', '.join(DATASETS)}; metrics: {', '.join(METRICS)})")


def score_prediction(dataset_or_metric: str, prediction: str, example: QAExample) -> float:
    """The paper's per-example score (0/1, or a fraction for f1/str_em) of `prediction`."""
    return METRICS[metric_name(dataset_or_metric)](prediction, example)


def dataset_accuracy(dataset_or_metric: str, predictions: Sequence[str],
                     examples: Sequence[QAExample]) -> float:
    """Mean score over a dataset (Table 1's numbers, as a fraction)."""
    if len(predictions) != len(examples) or not examples:
        raise JaxragError(f"{len(predictions)} predictions for {len(examples)} examples")
    score = METRICS[metric_name(dataset_or_metric)]
    return sum(score(p, ex) for p, ex in zip(predictions, examples)) / len(examples)


def retrieval_preferred(verbalized_scores: Sequence[float],
                        retrieved_scores: Sequence[float]) -> list[int]:
    """Table 2 bottom's label: 1 where retrieval scores strictly higher than verbalization."""
    if len(verbalized_scores) != len(retrieved_scores):
        raise JaxragError("verbalized and retrieved scores differ in length")
    return [int(r > v) for v, r in zip(verbalized_scores, retrieved_scores)]


def source_selection_accuracy(retrieved: Sequence[bool], verbalized_scores: Sequence[float],
                              retrieved_scores: Sequence[float]) -> float:
    """Table 2 top, "Accuracy (Verbalization >= Retrieval)", read as "not harming performance
    when abstaining": verbalizing is right iff verbalization scores >= retrieval, retrieving is
    right iff retrieval scores >= verbalization, so a tie is right either way. (The paper does
    not spell out its scores; with 0/1 task scores, counting a retrieval on a tie as an error
    would make its 0.959 on PopQA at ~96% retrieval unreachable.)"""
    if not (len(retrieved) == len(verbalized_scores) == len(retrieved_scores)) or not len(retrieved):
        raise JaxragError(f"{len(retrieved)} decisions for {len(verbalized_scores)} verbalized and "
                          f"{len(retrieved_scores)} retrieved scores")
    right = [(r >= v) if d else (v >= r) for d, v, r in zip(retrieved, verbalized_scores, retrieved_scores)]
    return sum(right) / len(right)


def auroc(labels: Sequence[int], scores: Sequence[float]) -> float:
    """Table 2 bottom, "AUROC (Retrieval > Verbalization)": labels from `retrieval_preferred`,
    scores the policy's retrieval score. NaN when only one class occurs (AUROC is undefined)."""
    from sklearn.metrics import roc_auc_score  # slow import: only where AUROC is wanted

    if len(labels) != len(scores):
        raise JaxragError(f"{len(labels)} labels for {len(scores)} scores")
    if len(set(labels)) < 2:
        return float("nan")
    return float(roc_auc_score(labels, scores))
