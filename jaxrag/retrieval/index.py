"""One vector index for passages and the policy datastore: exact (one matmul on device) or ScaNN.

An index directory holds

    meta.json      IndexMeta: format, encoder, dim, count, kind, storage dtype, shards, params
    vectors.bin    raw row-major [count, dim] float32/float16, opened as a read-only memmap
    ids.txt        one id per line, row order
    offsets.bin    optional int64 [count]: byte offset of each row's line in the corpus file
    scann/00000/   ScaNN searchers (tree + asymmetric hashing + reorder), one per shard of rows

and is only ever created complete: `IndexWriter` builds under `DIR.partial` and renames it into
place after meta.json is written, so a directory without meta.json is an interrupted build.

Scores are inner products (embeddings that should be compared by cosine are normalised before
they reach the index). Search returns rows; `ids`/`passages` map rows to what they stand for.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrag.errors import JaxragError
from jaxrag.models.encoder_io import embedding_space
from jaxrag.retrieval.corpus import Passage, PassageStore, file_signature

FORMAT = "jaxrag-index/1"
META_FILE, VECTORS_FILE, IDS_FILE = "meta.json", "vectors.bin", "ids.txt"
OFFSETS_FILE, SCANN_DIR = "offsets.bin", "scann"
_GB = 1 << 30


@dataclasses.dataclass(frozen=True)
class IndexParams:
    """How to index; zeros/`auto` are derived from the corpus size (`derive`)."""

    exact_below: int = 20_000  # fewer rows: exact search only (no ScaNN build)
    num_leaves: int = 0  # 0: ~sqrt(rows per shard)
    leaves_to_search: int = 0  # 0: ~10% of the leaves, at least min(leaves, 16)
    reorder_k: int = 0  # candidates rescored exactly; 0: max(200, 10 k)
    dims_per_block: int = 2  # asymmetric hashing: 16 centres per 2-dim block
    anisotropic_threshold: float | None = None  # None: 0.2 for unit-norm data, off otherwise
    training_sample_size: int = 250_000
    shard_rows: int = 4_000_000  # one ScaNN tree per shard, so a shard's float32 copy fits RAM
    storage: str = "auto"  # float32 | float16 | auto: float16 when float32 exceeds memory_gb
    reorder: str = "auto"  # scann (float32 copy in RAM) | memmap (rescore from vectors.bin) | auto
    memory_gb: float = 8.0  # host RAM the index may hold as float32
    device_gb: float = 1.0  # exact search keeps the whole matrix on device below this

    def storage_dtype(self, rows: int | None, dim: int) -> str:
        if self.storage != "auto":
            return self.storage
        return "float16" if rows is not None and rows * dim * 4 > self.memory_gb * _GB else "float32"

    def derive(self, rows: int, dim: int) -> dict:
        """Concrete settings for `rows` vectors of `dim` dims (see the field comments)."""
        kind = "exact" if rows < self.exact_below else "scann"
        shards = max(1, math.ceil(rows / self.shard_rows))
        per_shard = math.ceil(rows / shards)
        leaves = self.num_leaves or max(1, round(math.sqrt(per_shard)))
        leaves = min(leaves, max(1, per_shard // 20))  # keep partitions populated
        to_search = self.leaves_to_search or max(min(leaves, 16), math.ceil(0.1 * leaves))
        reorder = self.reorder
        if reorder == "auto":
            reorder = "scann" if rows * dim * 4 <= self.memory_gb * _GB else "memmap"
        return {"kind": kind, "shards": shards, "num_leaves": leaves, "leaves_to_search": min(to_search, leaves),
                "reorder_k": self.reorder_k, "reorder": reorder, "dims_per_block": self.dims_per_block,
                "anisotropic_threshold": self.anisotropic_threshold,
                "training_sample_size": min(self.training_sample_size, per_shard), "device_gb": self.device_gb}


@dataclasses.dataclass
class IndexMeta:
    encoder: str  # name of the encoder (or model@layer) whose vector space this is
    dim: int
    count: int
    kind: str  # exact | scann
    storage: str  # float32 | float16
    settings: dict  # IndexParams.derive(...) as used
    shard_rows: list[int] = dataclasses.field(default_factory=list)  # ScaNN shard sizes
    corpus: str | None = None  # corpus file the rows come from (passage indexes)
    corpus_signature: dict | None = None
    extra: dict = dataclasses.field(default_factory=dict)  # owner data (e.g. datastore sources)
    format: str = FORMAT

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def read(cls, path: Path) -> IndexMeta:
        file = path / META_FILE
        if not path.is_dir():
            raise JaxragError(f"{path}: index directory not found")
        if not file.exists():
            raise JaxragError(f"{path}: no {META_FILE}: not an index, or an interrupted build; rebuild it")
        try:
            meta = cls(**json.loads(file.read_text()))
        except (json.JSONDecodeError, TypeError) as e:
            raise JaxragError(f"{file}: unreadable index metadata ({e})") from e
        if meta.format != FORMAT:
            raise JaxragError(f"{file}: format {meta.format!r}, this jaxrag reads {FORMAT!r}")
        return meta


class SearchResult(NamedTuple):
    scores: np.ndarray  # [batch, k] float32, best first
    rows: np.ndarray  # [batch, k] int64 row numbers


@functools.partial(jax.jit, static_argnames=("k",))
def _top_k(queries, matrix, valid, k: int):
    """queries [b, d], matrix [n, d] -> top-k (scores, rows) over the first `valid` rows."""
    scores = jnp.einsum("bd,nd->bn", queries, matrix.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    scores = jnp.where(jnp.arange(matrix.shape[0]) < valid, scores, -jnp.inf)
    return jax.lax.top_k(scores, k)


def merge_top_k(scores: np.ndarray, rows: np.ndarray, k: int) -> SearchResult:
    """Candidates [b, m] from several searches -> the best k per query, best first."""
    k = min(k, scores.shape[1])
    part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    s, r = np.take_along_axis(scores, part, 1), np.take_along_axis(rows, part, 1)
    order = np.argsort(-s, axis=1, kind="stable")
    return SearchResult(np.take_along_axis(s, order, 1), np.take_along_axis(r, order, 1))


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())  # pad batches to powers of two: few compiles


def exact_search(queries: np.ndarray, matrix, k: int, *, chunk_rows: int = 1 << 18) -> SearchResult:
    """Brute-force inner-product top-k: queries [b, d] float32, matrix [n, d] (device array or
    host/memmap array, streamed to the device in fixed-size chunks) -> SearchResult."""
    b, n = len(queries), matrix.shape[0]
    k = min(k, n)
    q = np.zeros((_bucket(b), queries.shape[1]), np.float32)
    q[:b] = queries
    if isinstance(matrix, jax.Array):
        s, r = _top_k(q, matrix, n, k)
        return SearchResult(np.asarray(s)[:b], np.asarray(r, np.int64)[:b])
    chunk = min(chunk_rows, _bucket(n))
    found_s, found_r = [], []
    for start in range(0, n, chunk):
        block = np.asarray(matrix[start: start + chunk])
        if len(block) < chunk:  # same shape every chunk: one compile
            block = np.concatenate([block, np.zeros((chunk - len(block), block.shape[1]), block.dtype)])
        s, r = _top_k(q, block, min(chunk, n - start), min(k, chunk))
        found_s.append(np.asarray(s)[:b])
        found_r.append(np.asarray(r, np.int64)[:b] + start)
    return merge_top_k(np.concatenate(found_s, 1), np.concatenate(found_r, 1), k)


class VectorIndex:
    """A loaded index directory. `search(queries, k)` -> SearchResult; rows -> `ids`/`passages`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.meta = IndexMeta.read(self.path)
        self.vectors = self._open_vectors()
        self._ids: np.ndarray | None = None
        self._device_matrix = None
        self._searchers = None
        self._store = None

    @classmethod
    def load(cls, path: str | os.PathLike) -> VectorIndex:
        return cls(path)

    def _open_vectors(self) -> np.ndarray:
        file, m = self.path / VECTORS_FILE, self.meta
        want = m.count * m.dim * np.dtype(m.storage).itemsize
        if not file.exists() or file.stat().st_size != want:
            raise JaxragError(f"{file}: missing or truncated (expected {want} bytes: {m.count} x {m.dim} {m.storage})")
        return np.memmap(file, dtype=m.storage, mode="r", shape=(m.count, m.dim))

    @property
    def count(self) -> int:
        return self.meta.count

    @property
    def dim(self) -> int:
        return self.meta.dim

    @property
    def ids(self) -> np.ndarray:
        """[count] row ids (numpy bytes array, utf-8); `id_of` decodes."""
        if self._ids is None:
            data = (self.path / IDS_FILE).read_bytes()
            ids = np.array(data.split(b"\n")[: self.count])
            if len(ids) != self.count:
                raise JaxragError(f"{self.path / IDS_FILE}: {len(ids)} ids for {self.count} rows")
            self._ids = ids
        return self._ids

    def id_of(self, rows) -> list[str]:
        return [i.decode("utf-8") for i in self.ids[np.asarray(rows).reshape(-1)]]

    def check_encoder(self, encoder: str) -> None:
        """Raises unless queries from `encoder` live in the vector space this index was built in."""
        if embedding_space(encoder) != embedding_space(self.meta.encoder):
            raise JaxragError(f"{self.path}: built with encoder {self.meta.encoder!r}; "
                              f"queries come from {encoder!r} (a different embedding space)")

    def check_queries(self, queries) -> np.ndarray:
        q = np.ascontiguousarray(queries, dtype=np.float32)
        if q.ndim == 1:
            q = q[None]
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise JaxragError(f"{self.path}: queries of shape {tuple(np.shape(queries))}; this index holds "
                              f"{self.dim}-dim vectors, so queries must be [batch, {self.dim}]")
        if not np.isfinite(q).all():
            raise JaxragError(f"{self.path}: queries contain NaN or inf")
        return q

    def search(self, queries, k: int, *, encoder: str | None = None, exact: bool | None = None,
               leaves_to_search: int | None = None) -> SearchResult:
        """queries [b, dim] -> top-k by inner product. exact=None uses the index's kind; pass the
        query `encoder` name to have the embedding space checked."""
        if encoder is not None:
            self.check_encoder(encoder)
        if k < 1:
            raise JaxragError(f"k must be >= 1, got {k}")
        q = self.check_queries(queries)
        if exact or (exact is None and self.meta.kind == "exact") or not self.meta.shard_rows:
            return self.search_exact(q, k)
        return self.search_scann(q, k, leaves_to_search=leaves_to_search)

    def search_exact(self, q: np.ndarray, k: int) -> SearchResult:
        if self._device_matrix is None and self.count * self.dim * 4 <= self.meta.settings["device_gb"] * _GB:
            self._device_matrix = jnp.asarray(self.vectors, jnp.float32)
        return exact_search(q, self._device_matrix if self._device_matrix is not None else self.vectors, k)

    def searchers(self) -> list:
        if self._searchers is None:
            # lazy: scann: a large native library, loaded only where an index is built or searched
            from scann.scann_ops.py import scann_ops_pybind

            dirs = [self.path / SCANN_DIR / f"{i:05d}" for i in range(len(self.meta.shard_rows))]
            self._searchers = [scann_ops_pybind.load_searcher(str(d)) for d in dirs]
        return self._searchers

    def search_scann(self, q: np.ndarray, k: int, *, leaves_to_search: int | None = None) -> SearchResult:
        s = self.meta.settings
        k = min(k, self.count)
        reorder_k = max(s["reorder_k"] or 200, 10 * k)
        leaves = leaves_to_search or s["leaves_to_search"]
        found_s, found_r, start = [], [], 0
        for searcher, rows in zip(self.searchers(), self.meta.shard_rows):
            # Large batches use ScaNN's thread pool; a few queries are faster on one thread.
            search = searcher.search_batched_parallel if len(q) >= 32 else searcher.search_batched
            if s["reorder"] == "memmap":  # AH candidates only; rescored exactly below
                idx, dist = search(q, final_num_neighbors=min(reorder_k, rows), leaves_to_search=leaves)
            else:
                idx, dist = search(q, final_num_neighbors=min(k, rows), leaves_to_search=leaves,
                                   pre_reorder_num_neighbors=min(reorder_k, rows))
            found_s.append(np.asarray(dist, np.float32))
            found_r.append(np.asarray(idx, np.int64) + start)
            start += rows
        scores, rows = np.concatenate(found_s, 1), np.concatenate(found_r, 1)
        if s["reorder"] == "memmap":
            scores = self._rescore(q, rows)
        return merge_top_k(scores, rows, k)

    def _rescore(self, q: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Exact inner products of each query with its candidate rows, read from the memmap."""
        flat = rows.reshape(-1)
        order = np.argsort(flat)  # ascending reads: sequential-ish access to the file
        vecs = np.empty((len(flat), self.dim), np.float32)
        vecs[order] = self.vectors[flat[order]]
        return np.einsum("bd,bmd->bm", q, vecs.reshape(*rows.shape, self.dim))

    def passages(self, rows) -> list[Passage]:
        """Passage text of rows, read from the corpus file by byte offset (passage indexes)."""
        if self._store is None:
            self._store = self._open_store()
        return self._store.get(rows)

    def _open_store(self) -> PassageStore:
        m = self.meta
        if not m.corpus or not (self.path / OFFSETS_FILE).exists():
            raise JaxragError(f"{self.path}: index has no corpus offsets; it was not built from a corpus file")
        if not Path(m.corpus).is_file():
            raise JaxragError(f"{self.path}: corpus {m.corpus} (recorded at build time) not found")
        if m.corpus_signature and file_signature(m.corpus)["size"] != m.corpus_signature["size"]:
            raise JaxragError(f"{m.corpus}: changed since index {self.path} was built; rebuild the index")
        offsets = np.memmap(self.path / OFFSETS_FILE, dtype=np.int64, mode="r")
        if len(offsets) != self.count:
            raise JaxragError(f"{self.path / OFFSETS_FILE}: {len(offsets)} offsets for {self.count} rows")
        return PassageStore(m.corpus, offsets)
