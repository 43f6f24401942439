"""Passage corpora: DPR `psgs_w100.tsv`, JSONL `{"id", "contents": "title\\ntext"}`, chunking.

Readers stream (the DPR file is 13 GB): one line at a time, with its byte offset, so an index can
keep an offset per row and fetch passage text later by seeking (`PassageStore`) instead of
holding 21M strings. Every malformed line is reported as `file:line`. Gzipped files stream too,
but cannot be seeked into.
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from jaxrag.errors import JaxragError

TSV_COLUMNS = ("id", "text", "title")
PASSAGE_WORDS = 100


@dataclasses.dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str

    @property
    def contents(self) -> str:
        """FlashRAG's `contents` field: `title\\ntext`."""
        return f"{self.title}\n{self.text}"

    def to_prompt(self) -> str:
        """One line for a prompt's knowledge block: `(Title: T) text` (FlashRAG's style)."""
        return f"(Title: {self.title}) {self.text}" if self.title else self.text


def corpus_format(path: str | os.PathLike) -> str:
    """`tsv` or `jsonl`, from the file name (a trailing `.gz` is allowed)."""
    name = str(path).lower().removesuffix(".gz")
    if name.endswith(".tsv"):
        return "tsv"
    if name.endswith((".jsonl", ".json")):
        return "jsonl"
    raise JaxragError(f"{path}: unknown corpus format; expected .tsv (DPR) or .jsonl (FlashRAG)")


def _lines(path: Path) -> Iterator[tuple[int, int, str]]:
    """(1-based line number, byte offset or -1 for gzip, decoded line without newline)."""
    if not path.is_file():
        raise JaxragError(f"{path}: corpus file not found")
    gz = path.suffix == ".gz"
    with (gzip.open(path, "rb") if gz else open(path, "rb")) as f:
        offset = 0
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise JaxragError(f"{path}:{number}: not valid UTF-8 ({e.reason})") from e
            yield number, -1 if gz else offset, line
            offset += len(raw)


def _tsv_fields(line: str, where: str) -> list[str]:
    if '"' not in line:  # fast path: most lines carry no quoting
        return line.split("\t")
    try:
        return next(csv.reader([line], delimiter="\t", strict=True))
    except csv.Error as e:
        raise JaxragError(f"{where}: malformed TSV quoting ({e})") from e


def _tsv_header(line: str, where: str) -> tuple[int, int, int]:
    """Column positions of (id, text, title) from the header row."""
    fields = [f.strip().lower() for f in line.split("\t")]
    if sorted(fields) != sorted(TSV_COLUMNS):
        raise JaxragError(f"{where}: expected a header row with columns id, text, title; got {fields}")
    return tuple(fields.index(c) for c in TSV_COLUMNS)


def _tsv_passage(line: str, columns: tuple[int, int, int], where: str) -> Passage:
    fields = _tsv_fields(line, where)
    if len(fields) != 3:
        raise JaxragError(f"{where}: expected 3 tab-separated fields (id, text, title), got {len(fields)}")
    pid, text, title = (fields[c] for c in columns)
    return _checked(Passage(pid.strip(), title, text), where)


def _json_passage(line: str, where: str) -> Passage:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise JaxragError(f"{where}: malformed JSON ({e.msg})") from e
    if not isinstance(row, dict) or "id" not in row:
        raise JaxragError(f"{where}: expected an object with an `id` field")
    if isinstance(row.get("contents"), str):
        title, sep, text = row["contents"].partition("\n")
        if not sep:  # no title line: all of it is text
            title, text = "", title
    elif isinstance(row.get("text"), str):
        title, text = str(row.get("title") or ""), row["text"]
    else:
        raise JaxragError(f"{where}: row {row['id']!r} has no `contents` (or `text`) string")
    return _checked(Passage(str(row["id"]).strip(), title, text), where)


def _checked(p: Passage, where: str) -> Passage:
    if not p.id:
        raise JaxragError(f"{where}: empty passage id")
    if not p.text.strip():
        raise JaxragError(f"{where}: passage {p.id!r} has no text")
    return p


def is_int_id(pid: str) -> bool:
    """Canonical decimal ids ("17", not "017"), which map one-to-one to ints (DPR's 1..21M)."""
    return pid.isdigit() and len(pid) < 11 and (pid == "0" or pid[0] != "0")


class SeenIds:
    """Duplicate-id detector that stays small at 21M ids: a bitmap for integer ids, a set else."""

    def __init__(self):
        self._bits = np.zeros(1 << 20, bool)
        self._other: set[str] = set()

    def add(self, pid: str) -> bool:
        """Records `pid`; False if it was seen before."""
        if is_int_id(pid):
            i = int(pid)
            if i >= len(self._bits):
                grown = np.zeros(max(i + 1, 2 * len(self._bits)), bool)
                grown[: len(self._bits)] = self._bits
                self._bits = grown
            seen, self._bits[i] = self._bits[i], True
            return not seen
        if pid in self._other:
            return False
        self._other.add(pid)
        return True


def read_corpus_rows(path: str | os.PathLike) -> Iterator[tuple[Passage, int]]:
    """Streams (passage, byte offset of its line; -1 for gzip). Raises JaxragError with
    file:line on a malformed line, an empty text, a duplicate id, or an empty corpus."""
    path = Path(path)
    fmt, seen, count = corpus_format(path), SeenIds(), 0
    columns = None
    for number, offset, line in _lines(path):
        where = f"{path}:{number}"
        if fmt == "tsv" and columns is None:
            columns = _tsv_header(line, where)
            continue
        if not line.strip():
            continue
        p = _tsv_passage(line, columns, where) if fmt == "tsv" else _json_passage(line, where)
        if not seen.add(p.id):
            raise JaxragError(f"{where}: duplicate passage id {p.id!r}")
        count += 1
        yield p, offset
    if count == 0:
        raise JaxragError(f"{path}: corpus has no passages")


def read_corpus(path: str | os.PathLike) -> Iterator[Passage]:
    """Streams the passages of a DPR TSV or JSONL corpus (see `read_corpus_rows`)."""
    return (p for p, _ in read_corpus_rows(path))


def chunk_words(text: str, words: int = PASSAGE_WORDS) -> list[str]:
    """Splits on whitespace into consecutive chunks of `words` words (DPR's 100-word passages);
    the last chunk holds the remainder."""
    tokens = text.split()
    return [" ".join(tokens[i: i + words]) for i in range(0, len(tokens), words)]


def chunk_documents(docs: Iterable[Passage], words: int = PASSAGE_WORDS) -> Iterator[Passage]:
    """Documents -> passages `{doc.id}-{i}` of `words` words, each keeping the document title."""
    for doc in docs:
        for i, chunk in enumerate(chunk_words(doc.text, words)):
            yield Passage(f"{doc.id}-{i}", doc.title, chunk)


def _atomic_writer(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    return os.fdopen(fd, "w", encoding="utf-8"), Path(tmp)


def write_jsonl_corpus(passages: Iterable[Passage], path: str | os.PathLike) -> int:
    """Writes `{"id", "contents"}` lines to a temp file, renamed into place when complete.
    Returns the number of passages."""
    path, count = Path(path), 0
    f, tmp = _atomic_writer(path)
    seen = SeenIds()
    try:
        with f:
            for p in passages:
                if not seen.add(p.id):
                    raise JaxragError(f"{path}: duplicate passage id {p.id!r} while writing")
                f.write(json.dumps({"id": p.id, "contents": p.contents}, ensure_ascii=False) + "\n")
                count += 1
        if count == 0:
            raise JaxragError(f"{path}: refusing to write an empty corpus")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return count


def file_signature(path: str | os.PathLike) -> dict:
    """Size and mtime: enough to notice that a corpus changed under an index built on it."""
    st = Path(path).stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


class PassageStore:
    """Random access to passages of an uncompressed corpus file by byte offset.

    offsets [n] int64 are aligned with index rows; `get(rows)` seeks and parses one line each.
    """

    def __init__(self, path: str | os.PathLike, offsets: np.ndarray):
        self.path = Path(path)
        if self.path.suffix == ".gz":
            raise JaxragError(f"{self.path}: passages need random access; decompress the corpus (gunzip)")
        if not self.path.is_file():
            raise JaxragError(f"{self.path}: corpus file not found")
        self.format = corpus_format(self.path)
        self.offsets = offsets
        self._columns = None
        if self.format == "tsv":
            with open(self.path, "rb") as f:
                self._columns = _tsv_header(f.readline().decode("utf-8").rstrip("\r\n"), f"{self.path}:1")

    def __len__(self) -> int:
        return len(self.offsets)

    def get(self, rows: Sequence[int] | np.ndarray) -> list[Passage]:
        out = []
        with open(self.path, "rb") as f:
            for row in np.asarray(rows).reshape(-1):
                f.seek(int(self.offsets[row]))
                line = f.readline().decode("utf-8").rstrip("\r\n")
                where = f"{self.path}@{int(self.offsets[row])}"
                out.append(_tsv_passage(line, self._columns, where) if self._columns else _json_passage(line, where))
        return out
