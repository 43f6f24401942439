"""The SR-RAG policy datastore (paper §3.4): hidden state of `<EOQ>` -> preferred knowledge source.

Keys are middle-layer hidden states of the fine-tuned LLM; values are the source label plus the
question (id and text) it came from, so a person can audit, relabel, add and remove entries
(`python -m jaxrag.datastore`). At inference the k = 30 nearest keys give
p_D(<s>|q) = (# neighbours labelled s) / k  (`policy_distribution`).

It is a `VectorIndex` directory plus `values.jsonl` (one entry per row). Keys are L2-normalised
(cosine similarity: LLM hidden-state norms vary a lot and would otherwise dominate the inner
product); search is one matmul on device, or ScaNN beyond `DATASTORE_PARAMS.exact_below` (200k)
keys.
Every edit rewrites the directory atomically.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrag.errors import JaxragError
from jaxrag.models.tokens import DEFAULT_SOURCES
from jaxrag.retrieval.index import IndexParams, VectorIndex
from jaxrag.retrieval.writer import IndexWriter

DEFAULT_K = 30
KIND = "policy-datastore"
VALUES_FILE = "values.jsonl"
DATASTORE_PARAMS = IndexParams(exact_below=200_000, device_gb=4.0)


class Entry(NamedTuple):
    question_id: str
    question: str
    source: str


class Neighbours(NamedTuple):
    labels: np.ndarray  # [batch, k] int32 index into `sources`
    scores: np.ndarray  # [batch, k] float32 cosine similarity, best first
    rows: np.ndarray  # [batch, k] int64 datastore rows


def label_distribution(labels: np.ndarray, num_sources: int) -> np.ndarray:
    """labels [b, k] -> p_D(<s>|q) [b, num_sources]: the fraction of the k neighbours per source."""
    counts = np.stack([(labels == s).sum(-1) for s in range(num_sources)], -1)
    return (counts / labels.shape[-1]).astype(np.float32)


@functools.partial(jax.jit, static_argnames=("k", "num_sources"))
def knn_policy(queries: jax.Array, keys: jax.Array, labels: jax.Array, k: int, num_sources: int) -> jax.Array:
    """The whole §3.4 policy as one jittable function, for use inside a decode step:
    queries [b, d] (raw hidden states), keys [n, d] (normalised), labels [n] -> p_D [b, S]."""
    q = queries.astype(jnp.float32)
    q = q / jnp.maximum(jnp.linalg.norm(q, axis=-1, keepdims=True), 1e-12)
    _, rows = jax.lax.top_k(q @ keys.astype(jnp.float32).T, k)
    return jax.nn.one_hot(labels[rows], num_sources).mean(axis=1)


def _normalise(keys: np.ndarray) -> np.ndarray:
    keys = np.asarray(keys, np.float32)
    return keys / np.maximum(np.linalg.norm(keys, axis=-1, keepdims=True), 1e-12)


class PolicyDatastore:
    def __init__(self, path: str | os.PathLike):
        self.index = VectorIndex(path)
        extra = self.index.meta.extra
        if extra.get("kind") != KIND:
            raise JaxragError(f"{path}: not a policy datastore (an index of kind {extra.get('kind')!r})")
        self.path, self.sources = Path(path), tuple(extra["sources"])
        self.entries = _read_values(self.path / VALUES_FILE, self.index.count)
        self.labels = np.array([self.sources.index(e.source) for e in self.entries], np.int32)

    @classmethod
    def load(cls, path: str | os.PathLike) -> PolicyDatastore:
        return cls(path)

    @property
    def model(self) -> str:
        """The model (and layer) whose hidden states are the keys, e.g. `qwen2.5-7b-srrag@11`."""
        return self.index.meta.encoder

    def __len__(self) -> int:
        return len(self.entries)

    def row_of(self, question_id: str) -> int:
        if not hasattr(self, "_rows"):
            self._rows = {e.question_id: i for i, e in enumerate(self.entries)}
        if question_id not in self._rows:
            raise JaxragError(f"{self.path}: no entry with question id {question_id!r}")
        return self._rows[question_id]

    def keys(self, rows=None) -> np.ndarray:
        """Stored (normalised) keys [n, d] float32 of `rows` (all when None)."""
        v = self.index.vectors
        return np.asarray(v if rows is None else v[np.asarray(rows)], np.float32)

    def search(self, keys: np.ndarray, k: int = DEFAULT_K, *, model: str | None = None) -> Neighbours:
        """keys [b, d] hidden states -> the k nearest entries (k is capped at the datastore size)."""
        if model is not None:
            self.index.check_encoder(model)
        result = self.index.search(_normalise(self.index.check_queries(keys)), k)
        return Neighbours(self.labels[result.rows], result.scores, result.rows)

    def neighbour_labels(self, keys: np.ndarray, k: int = DEFAULT_K) -> np.ndarray:
        """keys [b, d] -> source indices [b, k] of the nearest entries (`policies.srrag.Neighbours`)."""
        return self.search(keys, k).labels

    def label_counts(self, keys: np.ndarray, k: int = DEFAULT_K) -> np.ndarray:
        """keys [b, d] -> [b, len(sources)] neighbour counts per source."""
        labels = self.search(keys, k).labels
        return np.stack([(labels == s).sum(-1) for s in range(len(self.sources))], -1)

    def policy_distribution(self, keys: np.ndarray, k: int = DEFAULT_K) -> np.ndarray:
        """keys [b, d] -> p_D(<s>|q) [b, len(sources)], columns in `sources` order."""
        return label_distribution(self.search(keys, k).labels, len(self.sources))

    def leave_one_out(self, k: int = DEFAULT_K) -> np.ndarray:
        """p_D(<s>|q) [n, len(sources)] of every entry from its k nearest *other* entries: how well
        the datastore predicts its own labels, i.e. whether neighbours in this hidden-state space
        share a preferred source at all (`python -m jaxrag.datastore audit`)."""
        if len(self) < 2:
            raise JaxragError(f"{self.path}: leave-one-out needs at least 2 entries, has {len(self)}")
        k = min(k, len(self) - 1)
        found = self.search(self.keys(), k + 1)
        own = found.rows == np.arange(len(self))[:, None]
        # drop the entry itself (or, where an exact duplicate outranked it, the farthest neighbour)
        drop = np.where(own.any(1), own.argmax(1), k)
        keep = np.ones_like(own)
        keep[np.arange(len(self)), drop] = False
        return label_distribution(found.labels[keep].reshape(len(self), k), len(self.sources))

    def device_arrays(self) -> tuple[jax.Array, jax.Array]:
        """(keys [n, d], labels [n]) on device, for `knn_policy` inside a jitted decode step."""
        return jnp.asarray(self.keys()), jnp.asarray(self.labels)

    # --- edits: each returns the rewritten datastore ------------------------------------------

    def add(self, keys: np.ndarray, sources: Sequence[str], question_ids: Sequence[str],
            questions: Sequence[str], *, replace: bool = False) -> PolicyDatastore:
        """Appends entries; an existing question id is an error unless `replace`."""
        keys = self.index.check_queries(keys)
        present = {e.question_id for e in self.entries}
        clash = {q for q in question_ids if q in present}
        if clash and not replace:
            raise JaxragError(f"{self.path}: question ids already present: {sorted(clash)[:5]} (use replace)")
        keep = [i for i, e in enumerate(self.entries) if e.question_id not in clash]
        old = [self.entries[i] for i in keep]
        new = [Entry(q, t, s) for q, t, s in zip(question_ids, questions, sources, strict=True)]
        return self._rewrite(np.concatenate([self.keys(keep), _normalise(keys)]), old + new)

    def remove(self, question_ids: Sequence[str]) -> PolicyDatastore:
        drop = {self.row_of(q) for q in question_ids}
        keep = [i for i in range(len(self)) if i not in drop]
        if not keep:
            raise JaxragError(f"{self.path}: removing these entries would leave the datastore empty")
        return self._rewrite(self.keys(keep), [self.entries[i] for i in keep])

    def relabel(self, question_ids: Sequence[str], source: str) -> PolicyDatastore:
        rows = {self.row_of(q) for q in question_ids}
        entries = [e._replace(source=source) if i in rows else e for i, e in enumerate(self.entries)]
        return self._rewrite(self.keys(), entries)

    def _rewrite(self, keys: np.ndarray, entries: list[Entry]) -> PolicyDatastore:
        params = IndexParams(**self.index.meta.extra.get("params", {}))  # as first built
        return write_datastore(self.path, keys, entries, sources=self.sources, model=self.model,
                               params=params, overwrite=True, normalised=True)

    def summary(self) -> dict:
        counts = {s: int((self.labels == i).sum()) for i, s in enumerate(self.sources)}
        m = self.index.meta
        return {"path": str(self.path), "model": m.encoder, "entries": len(self), "dim": m.dim,
                "search": m.kind, "sources": counts}


def _read_values(path: Path, count: int) -> list[Entry]:
    entries = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise JaxragError(f"{path}: cannot read datastore values ({e})") from e
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
            entries.append(Entry(str(row["question_id"]), str(row["question"]), str(row["source"])))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise JaxragError(f"{path}:{number}: malformed datastore entry ({e})") from e
    if len(entries) != count:
        raise JaxragError(f"{path}: {len(entries)} entries for {count} keys")
    return entries


def write_datastore(path: str | os.PathLike, keys: np.ndarray, entries: Sequence[Entry], *,
                    sources: Sequence[str] = DEFAULT_SOURCES, model: str, params: IndexParams = DATASTORE_PARAMS,
                    overwrite: bool = False, normalised: bool = False) -> PolicyDatastore:
    """keys [n, d] + one Entry per key -> a datastore directory (atomically)."""
    sources = tuple(sources)
    if len(set(sources)) != len(sources) or not sources:
        raise JaxragError(f"sources must be distinct names, got {list(sources)}")
    keys = np.asarray(keys, np.float32)
    if keys.ndim != 2 or len(keys) != len(entries):
        raise JaxragError(f"{path}: keys of shape {keys.shape} for {len(entries)} entries; expected [n, dim]")
    for e in entries:
        if e.source not in sources:
            raise JaxragError(f"{path}: entry {e.question_id!r} has source {e.source!r}; known: {list(sources)}")
    keys = keys if normalised else _normalise(keys)
    extra = {"kind": KIND, "sources": list(sources), "params": dataclasses.asdict(params)}
    with IndexWriter(path, dim=keys.shape[1], encoder=model, params=params, expected_rows=len(keys),
                     extra=extra, overwrite=overwrite) as writer:
        writer.add([e.question_id for e in entries], keys)
        with open(writer.tmp / VALUES_FILE, "w", encoding="utf-8") as f:
            for e in entries:
                f.write(json.dumps(e._asdict(), ensure_ascii=False) + "\n")
        writer.finish()
    return PolicyDatastore(path)


def build_datastore(path: str | os.PathLike, keys: np.ndarray, sources_of: Sequence[str],
                    question_ids: Sequence[str], questions: Sequence[str], *, model: str,
                    sources: Sequence[str] = DEFAULT_SOURCES, **kw) -> PolicyDatastore:
    """keys [n, d] hidden states, each with its preferred source name, question id and text."""
    if not (len(sources_of) == len(question_ids) == len(questions)):
        raise JaxragError(f"{path}: {len(sources_of)} labels, {len(question_ids)} ids, {len(questions)} questions")
    entries = [Entry(str(q), t, s) for q, t, s in zip(question_ids, questions, sources_of)]
    return write_datastore(path, keys, entries, sources=sources, model=model, **kw)
