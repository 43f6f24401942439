"""The paper's ten real datasets -> the shared `QAExample` schema.

Evaluation: PopQA (long-tail subset), TriviaQA, PubHealth, ARC-Challenge. Training mixture: Wizard
of Wikipedia, Natural Questions, FEVER, OpenBookQA, ARC-Easy, ASQA. Each dataset loads from a local
file in any of its public formats (.jsonl, .json, .tsv, .csv, .parquet; the row's field names
decide which release it is) or, with no path, by name from the Hugging Face Hub. A row that is
already in the shared (FlashRAG) schema, i.e. has `golden_answers`, passes through for any name.

Conventions shared with the embedded world (`world_datasets`), so one prompt format and one metric
serve both: claims (PubHealth, FEVER) become `Claim: ... True or false?` with gold "true"/"false";
multiple choice keeps the option texts in `choices` and the correct option's text as the gold
answer, with the public answer key and labels in metadata.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxrag.data.formats import Record, Row, asqa, claim, multiple_choice, popqa, shared_schema, short_qa
from jaxrag.data.schema import QAExample
from jaxrag.errors import JaxragError


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset: where it lives on the Hub, the split the paper uses, how it is scored."""

    role: str  # "eval" | "train": listed in config.data.eval or config.data.train
    hub: str
    config: str | None
    split: str
    metric: str  # a jaxrag.eval.metrics.METRICS name
    convert: Callable[[Row, str], Record | None]  # None leaves the row out (e.g. "mixture")


def load_dataset_examples(name: str, path: str | Path | None = None,
                          split: str | None = None) -> list[QAExample]:
    """Examples of dataset `name` (a `DATASETS` key) from the local file `path`, or from the Hub.

    `split` defaults to the paper's (`DATASETS[name].split`); for a local file it only selects
    the split of a JSON object keyed by split (ASQA's `ASQA.json`). Every row is validated as it
    is read: errors are one JaxragError naming `file:row` (the JSONL line; the data row for
    TSV/CSV/parquet) and the field. A file is parsed once per process: later calls with the same
    contents (the pipeline's preflight, construct and eval) get the examples already read.
    """
    if name not in DATASETS:
        raise JaxragError(f"unknown dataset {name!r} (known: {', '.join(DATASETS)})")
    split = split or DATASETS[name].split
    key = (name, split, None)
    if path is not None:
        if not (path := Path(path)).is_file():
            raise JaxragError(f"{path}: no such file")
        with open(path, "rb") as f:  # by contents: a rewritten file is read again
            key = (name, split, hashlib.file_digest(f, "sha256").hexdigest())
    if key not in _LOADED:
        _LOADED[key] = _load(name, path, split)
    return list(_LOADED[key])


_LOADED: dict[tuple[str, str, str | None], list[QAExample]] = {}


def _load(name: str, path: Path | None, split: str) -> list[QAExample]:
    spec = DATASETS[name]
    if path is None:
        source, rows = f"{spec.hub}[{split}]", _hub_rows(name, spec, split)
    else:
        source, rows = str(path), _file_rows(path, split)
    examples, first_row = [], {}
    for n, row in rows:
        where = f"{source}:{n}"
        if not isinstance(row, dict):
            raise JaxragError(f"{where}: expected a JSON object, got {type(row).__name__}")
        record = shared_schema(row, where) if "golden_answers" in row else spec.convert(row, where)
        if record is None:
            continue
        if record.get("id") in (None, ""):
            record["id"] = f"{name}-{n}"  # e.g. nq_open has no ids: the row number is stable
        example = QAExample.from_dict(record, where)
        if example.id in first_row:
            raise JaxragError(f"{where}: field 'id': duplicate id {example.id!r} "
                              f"(first at row {first_row[example.id]})")
        first_row[example.id] = n
        examples.append(example)
    if not examples:
        raise JaxragError(f"{source}: no {name} examples (every row was left out)")
    return examples


# --- reading rows -------------------------------------------------------------------------------

def _file_rows(path: Path, split: str) -> Iterator[tuple[int, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _jsonl_rows(path)
    if suffix == ".json":
        return _json_rows(path, split)
    if suffix in (".tsv", ".csv"):
        # lazy: pandas: only the parquet loader needs it
        import pandas as pd

        # dtype=str and no NA parsing: values stay exactly as written ("None" is a real answer).
        frame = pd.read_csv(path, sep="\t" if suffix == ".tsv" else ",", dtype=str,
                            keep_default_na=False)
        return enumerate(frame.to_dict("records"), start=1)
    if suffix == ".parquet":
        # lazy: pyarrow: only the parquet loader needs it
        import pyarrow.parquet as pq

        return enumerate(pq.read_table(path).to_pylist(), start=1)
    raise JaxragError(f"{path}: unsupported file type {suffix!r} "
                      "(expected .jsonl, .json, .tsv, .csv or .parquet)")


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                try:
                    yield line_no, json.loads(line)
                except json.JSONDecodeError as e:
                    raise JaxragError(f"{path}:{line_no}: invalid JSON: {e.msg}") from None


def _json_rows(path: Path, split: str) -> Iterator[tuple[int, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several releases name JSON-lines files .json
            return _jsonl_rows(path)
        raise JaxragError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
    if isinstance(data, dict) and split in data:  # ASQA.json: {"train": {..}, "dev": {..}}
        data = data[split]
    if isinstance(data, dict) and all(isinstance(v, dict) for v in data.values()):
        data = [{"id": key, **record} for key, record in data.items()]  # keyed by example id
    if not isinstance(data, list):
        raise JaxragError(f"{path}: expected a list of records, or an object keyed by split "
                          f"({split!r} not found) or by example id")
    return enumerate(data, start=1)


def _hub_rows(name: str, spec: DatasetSpec, split: str) -> Iterator[tuple[int, Any]]:
    try:
        # lazy: datasets: only the hub loader needs it (it imports pyarrow and pandas)
        import datasets

        rows = datasets.load_dataset(spec.hub, spec.config, split=split)
    # Offline / not cached (OSError: ConnectionError, DatasetNotFoundError), no such split
    # (ValueError), a script-only dataset (RuntimeError): all mean "use a local file".
    except (ImportError, OSError, ValueError, RuntimeError) as e:
        hub = spec.hub + (f" ({spec.config})" if spec.config else "")
        raise JaxragError(
            f"{name}: could not load {hub} split {split!r} from the Hugging Face Hub "
            f"({type(e).__name__}: {e}). Offline, point at a local file in a public format "
            f"(.jsonl/.json/.tsv/.csv/.parquet): --config.data.paths.{name}="
            f"/path/to/{name}.jsonl") from None
    return enumerate(rows, start=1)


# Names match config.EVAL_DATASETS / TRAIN_DATASETS and the embedded world's dataset names.
DATASETS: dict[str, DatasetSpec] = {
    "popqa": DatasetSpec("eval", "akariasai/PopQA", None, "test", "match", popqa),
    # The open-domain TriviaQA test set (11,313) is the unfiltered validation split.
    "triviaqa": DatasetSpec("eval", "mandarjoshi/trivia_qa", "unfiltered.nocontext", "validation",
                            "match", short_qa(("answers", "answer"), ("question_id", "id"))),
    "pubhealth": DatasetSpec("eval", "ImperialCollegeLondon/health_fact", None, "test",
                             "true_false", claim),
    "arc_challenge": DatasetSpec("eval", "allenai/ai2_arc", "ARC-Challenge", "test", "choice",
                                 multiple_choice),
    "wow": DatasetSpec("train", "facebook/kilt_tasks", "wow", "train", "f1",
                       short_qa(("output", "answers", "answer"))),
    "nq": DatasetSpec("train", "google-research-datasets/nq_open", None, "train", "match",
                      short_qa(("answer", "answers", "output"))),
    "fever": DatasetSpec("train", "facebook/kilt_tasks", "fever", "train", "true_false", claim),
    "obqa": DatasetSpec("train", "allenai/openbookqa", "main", "train", "choice",
                        multiple_choice),
    "arc_easy": DatasetSpec("train", "allenai/ai2_arc", "ARC-Easy", "train", "choice",
                            multiple_choice),
    "asqa": DatasetSpec("train", "din0s/asqa", None, "train", "str_em", asqa),
}
