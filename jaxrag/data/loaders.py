"""The paper's ten real datasets -> the shared `QAExample` schema.

Evaluation: PopQA (long-tail subset), TriviaQA, PubHealth, ARC-Challenge. Training mixture: Wizard
of Wikipedia, Natural Questions, FEVER, OpenBookQA, ARC-Easy, ASQA. Each dataset loads from a local
file in any of its public formats (.jsonl, .json, .tsv, .csv, .parquet; the row's field names
decide which release it is; DPR's question CSVs are tab-separated `question<TAB>['answer', ..]`
lines without a header), from a TFDS build (`tfds:BUILDER/CONFIG[:split]` in
`data.tfds_data_dir`, `jaxrag.data.tfds_source`) or, with no path, by name from the Hugging Face
Hub. A row in the shared (FlashRAG) schema, i.e. with `golden_answers`, is finished the dataset's
own way (`DatasetSpec.finish`): claims labelled "true"/"false", PopQA's long tail, multiple
choice with its options.

Rows left out on purpose (PopQA's popular entities, claims neither true nor false, PubHealth rows
without a usable label) are counted per reason: `left_out(name, path)`, printed once per file
read, and recorded in the eval's data summary.

Conventions shared with the embedded world (`world_datasets`), so one prompt format and one metric
serve both: claims (PubHealth, FEVER) become `Claim: ... True or false?` with gold "true"/"false";
multiple choice keeps the option texts in `choices` and the correct option's text as the gold
answer, with the public answer key and labels in metadata.
"""

from __future__ import annotations

import ast
import csv
import hashlib
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxrag.data import tfds_source
from jaxrag.data.formats import (LeftOut, Record, Row, as_is, asqa, claim, long_tail, multiple_choice, popqa,
                                 shared_choice, shared_claim, shared_schema, short_qa, triviaqa,
                                 with_normalized_aliases)
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
    convert: Callable[[Row, str], Record | LeftOut]  # the dataset's own releases' rows
    finish: Callable[[Record, str], Record | LeftOut] = as_is  # a shared-schema (FlashRAG) row's record


def load_dataset_examples(name: str, path: str | Path | None = None, split: str | None = None,
                          tfds_data_dir: str = "") -> list[QAExample]:
    """Examples of dataset `name` (a `DATASETS` key) from the local file `path`, a TFDS build
    (`path` = `tfds:BUILDER/CONFIG[:split]` in `tfds_data_dir`), or the Hub.

    `split` defaults to the paper's (`DATASETS[name].split`); for a local file it only selects
    the split of a JSON object keyed by split (ASQA's `ASQA.json`). Every row is validated as it
    is read: errors are one JaxragError naming `file:row` (the JSONL line; the data row for
    TSV/CSV/parquet) and the field; a file that repeats an id is refused. A source is read once
    per process: later calls with the same contents (the pipeline's preflight, construct and
    eval) get the examples already read.
    """
    return list(_loaded(name, path, split, tfds_data_dir)[0])


def left_out(name: str, path: str | Path | None = None, split: str | None = None,
             tfds_data_dir: str = "") -> dict[str, int]:
    """Rows of that source left out on purpose, per reason (e.g. {"no label": 2})."""
    return dict(_loaded(name, path, split, tfds_data_dir)[1])


def _loaded(name: str, path: str | Path | None, split: str | None,
            tfds_data_dir: str) -> tuple[list[QAExample], Counter]:
    if name not in DATASETS:
        raise JaxragError(f"unknown dataset {name!r} (known: {', '.join(DATASETS)})")
    split = split or DATASETS[name].split
    key = (name, split, None)
    if path is not None and tfds_source.is_tfds(path):
        key = (name, split, f"{path} in {tfds_data_dir}")  # a TFDS build does not change
    elif path is not None:
        if not (path := Path(path)).is_file():
            raise JaxragError(f"{path}: no such file")
        with open(path, "rb") as f:  # by contents: a rewritten file is read again
            key = (name, split, hashlib.file_digest(f, "sha256").hexdigest())
    if key not in _LOADED:
        _LOADED[key] = _load(name, path, split, tfds_data_dir)
    return _LOADED[key]


_LOADED: dict[tuple[str, str, str | None], tuple[list[QAExample], Counter]] = {}

# FlashRAG's `arc` holds ARC-Challenge and ARC-Easy together, numbered `train_0`, ... with nothing
# in a row saying which set it is from (the original ids' prefixes, Mercury_ or NYSEDREGENTS_,
# occur in both sets). Its files hold the two sets' sizes added: 1,119 + 2,251, 299 + 570,
# 1,172 + 2,376 questions.
FLASHRAG_ARC_SIZES = {3370: "train", 869: "dev", 3548: "test"}


def _load(name: str, path: Path | str | None, split: str, tfds_data_dir: str) -> tuple[list[QAExample], Counter]:
    spec = DATASETS[name]
    if path is None:
        source, rows = f"{spec.hub}[{split}]", _hub_rows(name, spec, split)
    elif tfds_source.is_tfds(path):
        source, rows = tfds_source.tfds_rows(path, split, tfds_data_dir)
    else:
        source, rows = str(path), _file_rows(path, split)
    examples, first_row, left, shared, n = [], {}, Counter(), 0, 0
    for n, row in rows:
        where = f"{source}:{n}"
        if not isinstance(row, dict):
            raise JaxragError(f"{where}: expected a JSON object, got {type(row).__name__}")
        if "golden_answers" in row:
            shared += 1
            record = spec.finish(shared_schema(row, where), where)
        else:
            record = spec.convert(row, where)
        if isinstance(record, LeftOut):
            left[record.reason] += 1
            continue
        if record.get("id") in (None, ""):
            record["id"] = f"{name}-{n}"  # e.g. nq_open has no ids: the row number is stable
        example = QAExample.from_dict(record, where)
        if example.id in first_row:
            raise JaxragError(f"{where}: field 'id': duplicate id {example.id!r} "
                              f"(first at row {first_row[example.id]})")
        first_row[example.id] = n
        examples.append(example)
    if name in ("arc_challenge", "arc_easy") and shared == n and n in FLASHRAG_ARC_SIZES:
        config = spec.config or name
        raise JaxragError(
            f"{source}: {n} rows, the size of FlashRAG's combined `arc` {FLASHRAG_ARC_SIZES[n]} file "
            f"(ARC-Challenge and ARC-Easy together; no field of a row says which), not {name}. Give "
            f"{config} alone (allenai/ai2_arc {config}: the Hub, its parquet, the original "
            f"{config}-*.jsonl or tfds:ai2_arc/{config}), or split FlashRAG's file by keeping the rows "
            f"whose question is in {config}'s file of the same split")
    if not examples:
        raise JaxragError(f"{source}: no {name} examples (every row was left out: "
                          f"{_counts(left) or 'the file is empty'})")
    if left:
        print(f"{name}: {source}: {len(examples)} questions; left out {sum(left.values())} rows "
              f"({_counts(left)})", file=sys.stderr)
    return examples, left


def _counts(left: Counter) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(left.items()))


# --- reading rows -------------------------------------------------------------------------------

def _file_rows(path: Path, split: str) -> Iterator[tuple[int, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _jsonl_rows(path)
    if suffix == ".json":
        return _json_rows(path, split)
    if suffix in (".tsv", ".csv") and _is_dpr_questions(path):
        return _dpr_rows(path)
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


def _is_dpr_questions(path: Path) -> bool:
    """DPR's question files (`nq-test.csv`, `trivia-test.csv`, ...): no header, each line the
    question, a tab and the answers as a Python list literal."""
    with open(path, encoding="utf-8", newline="") as f:
        first = next(csv.reader(f, delimiter="\t"), [])
    return len(first) == 2 and first[1].startswith("[") and first[1].endswith("]")


def _dpr_rows(path: Path) -> Iterator[tuple[int, Any]]:
    with open(path, encoding="utf-8", newline="") as f:  # read as DPR's CsvQASrc reads them
        for n, fields in enumerate(csv.reader(f, delimiter="\t"), start=1):
            try:
                question, answers = fields
                answers = ast.literal_eval(answers)
            except (ValueError, SyntaxError):
                raise JaxragError(f"{path}:{n}: expected DPR's `question<TAB>['answer', ...]`, "
                                  f"got {fields!r}") from None
            yield n, {"question": question, "answers": answers}


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
    if isinstance(data, dict) and isinstance(data.get("Data"), list):  # TriviaQA's own release
        data = data["Data"]
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
    "popqa": DatasetSpec("eval", "akariasai/PopQA", None, "test", "match", popqa, long_tail),
    # The open-domain TriviaQA test set (11,313) is the unfiltered validation split.
    "triviaqa": DatasetSpec("eval", "mandarjoshi/trivia_qa", "unfiltered.nocontext", "validation",
                            "match", triviaqa, with_normalized_aliases),
    "pubhealth": DatasetSpec("eval", "ImperialCollegeLondon/health_fact", None, "test",
                             "true_false", claim, shared_claim),
    "arc_challenge": DatasetSpec("eval", "allenai/ai2_arc", "ARC-Challenge", "test", "choice",
                                 multiple_choice, shared_choice),
    "wow": DatasetSpec("train", "facebook/kilt_tasks", "wow", "train", "f1",
                       short_qa(("output", "answers", "answer"))),
    "nq": DatasetSpec("train", "google-research-datasets/nq_open", None, "train", "match",
                      short_qa(("answer", "answers", "output"))),
    "fever": DatasetSpec("train", "facebook/kilt_tasks", "fever", "train", "true_false", claim,
                         shared_claim),
    "obqa": DatasetSpec("train", "allenai/openbookqa", "main", "train", "choice",
                        multiple_choice, shared_choice),
    "arc_easy": DatasetSpec("train", "allenai/ai2_arc", "ARC-Easy", "train", "choice",
                            multiple_choice, shared_choice),
    "asqa": DatasetSpec("train", "din0s/asqa", None, "train", "str_em", asqa),
}
