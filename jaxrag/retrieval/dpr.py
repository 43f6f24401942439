"""DPR's released precomputed Wikipedia passage embeddings (`wikipedia_passages_{i}.pkl`).

Each shard is a pickle of a list of `(passage_id, np.ndarray [768])` tuples (what DPR's
`generate_dense_embeddings.py` writes); a `(ids, np.ndarray [n, d])` pair is accepted too.
Unpickling is restricted to numpy arrays and builtins, so a shard cannot run code.
"""

from __future__ import annotations

import glob
import os
import pickle
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from jaxrag.errors import JaxragError

DPR_CTX_ENCODER = "facebook/dpr-ctx_encoder-single-nq-base"
_ALLOWED = {
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    ("builtins", "tuple"), ("builtins", "list"), ("_codecs", "encode"),
}


class _NumpyOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")
        return super().find_class(module, name)


def _natural_key(path: Path):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def dpr_embedding_files(spec: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """A glob (`.../wikipedia_passages_*`), a directory, or a list of files -> shard files in
    natural order (`_2` before `_10`)."""
    if isinstance(spec, (str, os.PathLike)):
        spec = Path(spec)
        files = [Path(p) for p in glob.glob(str(spec / "*.pkl" if spec.is_dir() else spec))]
    else:
        files = [Path(p) for p in spec]
    if not files:
        raise JaxragError(f"no DPR embedding shards match {spec}")
    return sorted(files, key=_natural_key)


def _as_matrix(obj, where: str) -> tuple[list, np.ndarray]:
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[1], np.ndarray) and obj[1].ndim == 2:
        return list(obj[0]), obj[1]
    if isinstance(obj, list) and obj and all(isinstance(r, tuple) and len(r) == 2 for r in obj[:1]):
        try:
            return [r[0] for r in obj], np.stack([np.asarray(r[1]).reshape(-1) for r in obj])
        except ValueError as e:
            raise JaxragError(f"{where}: vectors of different sizes ({e})") from e
    raise JaxragError(f"{where}: expected a list of (id, vector) tuples or an (ids, [n, d] array) pair")


def read_dpr_shard(path: str | os.PathLike, *, strip_prefix: str = "wiki:") -> tuple[list[str], np.ndarray]:
    """One shard -> (ids, embeddings [n, d] float32). DPR's newer ids carry a `wiki:` prefix; it
    is stripped so ids match `psgs_w100.tsv`."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            obj = _NumpyOnlyUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        raise JaxragError(f"{path}: cannot read DPR embedding shard ({e})") from e
    ids, vectors = _as_matrix(obj, str(path))
    if len(ids) != len(vectors):
        raise JaxragError(f"{path}: {len(ids)} ids but {len(vectors)} vectors")
    ids = [str(i).removeprefix(strip_prefix) for i in ids]
    return ids, np.ascontiguousarray(vectors, dtype=np.float32)


def read_dpr_embeddings(spec, *, strip_prefix: str = "wiki:") -> Iterator[tuple[list[str], np.ndarray]]:
    """Streams shards (one in memory at a time) as (ids, [n, d] float32); all must share d."""
    dim = None
    for path in dpr_embedding_files(spec):
        ids, vectors = read_dpr_shard(path, strip_prefix=strip_prefix)
        if dim is not None and vectors.shape[1] != dim:
            raise JaxragError(f"{path}: dimension {vectors.shape[1]}, earlier shards have {dim}")
        dim = vectors.shape[1]
        yield ids, vectors
