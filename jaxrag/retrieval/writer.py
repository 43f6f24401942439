"""Building an index directory from shards of vectors, never half-written.

`IndexWriter` appends (ids, vectors[, corpus offsets]) batches to files under `DIR.partial`,
so a 21M x 768 corpus streams through one host shard by shard; `finish()` builds one ScaNN
searcher per `shard_rows` rows (each from a float32 copy of that shard only), writes meta.json
last and renames the directory into place. An exception, or leaving the `with` block without
`finish()`, deletes the partial directory; a killed process leaves only `DIR.partial`, which
`VectorIndex` refuses to load and the next build removes.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from jaxrag.errors import JaxragError
from jaxrag.retrieval.corpus import SeenIds, file_signature
from jaxrag.retrieval.index import (IDS_FILE, OFFSETS_FILE, SCANN_DIR, VECTORS_FILE, META_FILE, IndexMeta,
                                    IndexParams, VectorIndex)


class IndexWriter:
    def __init__(self, path: str | os.PathLike, *, dim: int, encoder: str, params: IndexParams = IndexParams(),
                 corpus: str | os.PathLike | None = None, expected_rows: int | None = None,
                 extra: dict | None = None, overwrite: bool = False, progress: bool = False):
        self.path = Path(path)
        if self.path.exists() and not overwrite:
            raise JaxragError(f"{self.path}: already exists; remove it or overwrite it (overwrite=True, --overwrite)")
        if corpus is not None and Path(corpus).suffix == ".gz":
            raise JaxragError(f"{corpus}: an index needs byte offsets into the corpus; decompress it (gunzip)")
        self.tmp = self.path.with_name(self.path.name + ".partial")
        if self.tmp.exists():  # left by an interrupted build
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
        self.dim, self.encoder, self.params, self.extra = dim, encoder, params, dict(extra or {})
        self.corpus = None if corpus is None else str(Path(corpus).resolve())
        self.storage = params.storage_dtype(expected_rows, dim)
        self.count, self._seen, self._finished, self.progress = 0, SeenIds(), False, progress
        self._vectors = open(self.tmp / VECTORS_FILE, "wb")
        self._ids = open(self.tmp / IDS_FILE, "w", encoding="utf-8")
        self._offsets = open(self.tmp / OFFSETS_FILE, "wb") if corpus is not None else None
        self._bar = tqdm(total=expected_rows, desc=f"index {self.path.name}", unit="row", disable=not progress)

    def __enter__(self) -> IndexWriter:
        return self

    def __exit__(self, *exc) -> None:
        if not self._finished:
            self.abort()

    def add(self, ids: Sequence[str], vectors: np.ndarray, offsets: Sequence[int] | None = None) -> None:
        """Appends rows: ids [n] (unique, non-empty, no newline), vectors [n, dim], and the byte
        offsets [n] of their corpus lines when the index was opened with `corpus`."""
        vectors = np.asarray(vectors)
        if vectors.ndim != 2 or vectors.shape[1] != self.dim:
            raise JaxragError(f"{self.path}: vectors of shape {vectors.shape}; expected [n, {self.dim}]")
        if len(ids) != len(vectors):
            raise JaxragError(f"{self.path}: {len(ids)} ids for {len(vectors)} vectors")
        if not np.isfinite(vectors).all():
            last = self.count + len(ids) - 1
            raise JaxragError(f"{self.path}: vectors contain NaN or inf (rows {self.count}..{last})")
        for i in ids:
            if not i or "\n" in i:
                raise JaxragError(f"{self.path}: invalid id {i!r} (empty or containing a newline)")
            if not self._seen.add(i):
                raise JaxragError(f"{self.path}: duplicate id {i!r}")
        if (offsets is None) != (self._offsets is None):
            raise JaxragError(f"{self.path}: corpus offsets must be given exactly when the index has a corpus")
        if offsets is not None:
            offsets = np.asarray(offsets, np.int64)
            if len(offsets) != len(ids) or (offsets < 0).any():
                raise JaxragError(f"{self.path}: need one non-negative corpus offset per row")
            self._offsets.write(offsets.tobytes())
        self._vectors.write(np.ascontiguousarray(vectors, dtype=self.storage).tobytes())
        self._ids.write("".join(f"{i}\n" for i in ids))
        self.count += len(ids)
        self._bar.update(len(ids))

    def _close_files(self) -> None:
        for f in (self._vectors, self._ids, self._offsets):
            if f is not None:
                f.close()
        self._bar.close()

    def abort(self) -> None:
        self._close_files()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._finished = True

    def finish(self) -> VectorIndex:
        """Builds the searchers, writes meta.json and renames the index into place."""
        self._close_files()
        if self.count == 0:
            raise JaxragError(f"{self.path}: nothing to index (no rows were added: empty corpus?)")
        vectors = np.memmap(self.tmp / VECTORS_FILE, dtype=self.storage, mode="r", shape=(self.count, self.dim))
        settings = self.params.derive(self.count, self.dim)
        if settings["anisotropic_threshold"] is None:
            settings["anisotropic_threshold"] = _anisotropic_threshold(vectors)
        shard_rows = []
        if settings["kind"] == "scann":
            shard_rows = build_scann_shards(vectors, settings, self.tmp / SCANN_DIR, self.progress)
        meta = IndexMeta(encoder=self.encoder, dim=self.dim, count=self.count, kind=settings["kind"],
                         storage=self.storage, settings=settings, shard_rows=shard_rows, corpus=self.corpus,
                         corpus_signature=file_signature(self.corpus) if self.corpus else None, extra=self.extra)
        del vectors
        (self.tmp / META_FILE).write_text(meta.to_json())  # the completion marker: written last
        self._publish()
        self._finished = True
        return VectorIndex(self.path)

    def _publish(self) -> None:
        if not self.path.exists():
            os.rename(self.tmp, self.path)
            return
        old = self.path.with_name(f"{self.path.name}.old-{os.getpid()}")
        os.rename(self.path, old)
        os.rename(self.tmp, self.path)
        shutil.rmtree(old)


def _anisotropic_threshold(vectors: np.ndarray) -> float:
    """ScaNN's recommended 0.2 assumes unit-norm data; unnormalised (e.g. DPR) gets plain AH."""
    sample = np.asarray(vectors[: 10_000], np.float32)
    norms = np.linalg.norm(sample, axis=1)
    return 0.2 if np.allclose(norms, 1.0, atol=1e-2) else float("nan")


def build_scann_shards(vectors: np.ndarray, settings: dict, out: Path, progress: bool = True) -> list[int]:
    """One ScaNN searcher (tree + AH [+ reorder]) per contiguous shard of rows -> shard sizes."""
    # lazy: scann: a large native library, loaded only where an index is built or searched
    from scann.scann_ops.py import scann_ops_pybind

    bounds = np.linspace(0, len(vectors), settings["shards"] + 1).astype(int)
    sizes = []
    for i in tqdm(range(settings["shards"]), desc="build ScaNN", unit="shard", disable=not progress):
        data = np.ascontiguousarray(vectors[bounds[i]: bounds[i + 1]], dtype=np.float32)
        leaves = min(settings["num_leaves"], max(1, len(data) // 20))
        builder = scann_ops_pybind.builder(data, 10, "dot_product")
        if leaves >= 2:
            builder = builder.tree(num_leaves=leaves, num_leaves_to_search=min(settings["leaves_to_search"], leaves),
                                   training_sample_size=min(settings["training_sample_size"], len(data)))
        thr = settings["anisotropic_threshold"]
        builder = builder.score_ah(settings["dims_per_block"], anisotropic_quantization_threshold=thr)
        if settings["reorder"] == "scann":
            builder = builder.reorder(max(settings["reorder_k"], 200))
        shard_dir = out / f"{i:05d}"
        shard_dir.mkdir(parents=True)
        builder.build().serialize(str(shard_dir), relative_path=True)
        sizes.append(len(data))
        del data
    return sizes


def build_index(path: str | os.PathLike, vectors: np.ndarray, ids: Sequence[str], *, encoder: str,
                params: IndexParams = IndexParams(), chunk: int = 65_536, **writer_kw) -> VectorIndex:
    """An in-memory (or memmapped) [n, dim] array + ids -> a complete index directory."""
    vectors = np.asarray(vectors) if not isinstance(vectors, np.ndarray) else vectors
    if vectors.ndim != 2:
        raise JaxragError(f"{path}: vectors must be [n, dim], got shape {vectors.shape}")
    with IndexWriter(path, dim=vectors.shape[1], encoder=encoder, params=params, expected_rows=len(vectors),
                     **writer_kw) as writer:
        for start in range(0, max(len(vectors), 1), chunk):
            if len(vectors):
                writer.add(ids[start: start + chunk], vectors[start: start + chunk])
        return writer.finish()
