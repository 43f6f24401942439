"""Retrieval throughput: encoder passages/s, ScaNN vs exact search latency and recall, and the
policy-datastore lookup (k = 30) at the paper's batch size B = 10. Prints one JSON object.

    python benchmarks/bench_index.py [--passages 1024] [--rows 50000] [--dim 384]

The search corpus is synthetic but shaped like text embeddings: unit vectors clustered on a
low-rank subspace (`--clusters`, `--intrinsic-dim`). Isotropic full-rank clusters are much harder
for any partitioned index; raise leaves_to_search for such data. Recall@k is measured against
exact search over the same index.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np


def timed(fn, repeat: int = 3) -> tuple[float, object]:
    """Best-of-`repeat` wall time in seconds (the first call, which compiles, is not counted)."""
    out = fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def synthetic_passages(n: int, words: int = 100, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    vocab = [w.strip() for w in "the of and to in is was for on as by with he at from his an it were are which this "
             "be or has had first one their its new after who they have her she two been other when there all "
             "during into school time may years more most only over city some world would where later up such "
             "used many can state about national out known university united then made".split()]
    return [" ".join(rng.choice(vocab, words)) for _ in range(n)]


def bench_encoder(n: int, batch_size: int) -> dict:
    from jaxrag.models.encoder_io import load_encoder

    encoder = load_encoder()
    texts = synthetic_passages(n)
    encoder.encode(texts[:batch_size], batch_size=batch_size)  # compile the bucket used below
    seconds, _ = timed(lambda: encoder.encode(texts, batch_size=batch_size), repeat=1)
    tokens = np.mean([len(t) for t in encoder.tokenizer(texts[:256])["input_ids"]])
    return {"encoder": encoder.name, "passages": n, "batch_size": batch_size, "mean_tokens": float(tokens),
            "passages_per_s": round(n / seconds, 1)}


def clustered(n: int, dim: int, clusters: int, intrinsic_dim: int, seed: int = 0) -> np.ndarray:
    """Unit vectors that, like text embeddings, cluster on a low-dimensional subspace: clustered
    points in R^intrinsic_dim, mapped linearly to R^dim, plus a little full-rank noise."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, intrinsic_dim))
    z = centres[rng.integers(0, clusters, n)] + 0.6 * rng.normal(size=(n, intrinsic_dim))
    x = z @ (rng.normal(size=(intrinsic_dim, dim)) / np.sqrt(intrinsic_dim)) + 0.05 * rng.normal(size=(n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(found, truth)]))


def bench_search(rows: int, dim: int, clusters: int, intrinsic_dim: int, queries: int, k: int, workdir: Path) -> dict:
    from jaxrag.retrieval.writer import build_index

    x = clustered(rows, dim, clusters, intrinsic_dim)
    rng = np.random.default_rng(1)
    q = x[rng.integers(0, rows, queries)] + 0.02 * rng.normal(size=(queries, dim))
    q = (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)
    start = time.perf_counter()
    index = build_index(workdir / "index", x, [str(i) for i in range(rows)], encoder="bench")
    build_s = time.perf_counter() - start
    exact_s, exact = timed(lambda: index.search(q, k, exact=True))
    exact1_s, _ = timed(lambda: index.search(q[:1], k, exact=True), repeat=10)
    out = {"rows": rows, "dim": dim, "intrinsic_dim": intrinsic_dim, "clusters": clusters, "queries": queries,
           "k": k, "build_s": round(build_s, 2),
           "settings": {key: index.meta.settings[key] for key in ("num_leaves", "leaves_to_search", "reorder")},
           "exact": {"batch_ms_per_query": round(1e3 * exact_s / queries, 3),
                     "single_query_ms": round(1e3 * exact1_s, 2)},
           "scann": []}
    default = index.meta.settings["leaves_to_search"]
    for leaves in sorted({max(1, default // 2), default, 2 * default}):
        scann_s, approx = timed(lambda: index.search(q, k, leaves_to_search=leaves))
        scann1_s, _ = timed(lambda: index.search(q[:1], k, leaves_to_search=leaves), repeat=10)
        out["scann"].append({"leaves_to_search": leaves, "recall_at_k": round(recall(approx.rows, exact.rows), 4),
                             "batch_ms_per_query": round(1e3 * scann_s / queries, 3),
                             "single_query_ms": round(1e3 * scann1_s, 2)})
    return out


def bench_datastore(keys: int, dim: int, workdir: Path) -> dict:
    from jaxrag.retrieval.datastore import build_datastore

    rng = np.random.default_rng(2)
    hidden = rng.normal(size=(keys, dim)).astype(np.float32)
    labels = np.array(["wiki", "self"])[rng.integers(0, 2, keys)]
    ds = build_datastore(workdir / "ds", hidden, labels, [str(i) for i in range(keys)], [""] * keys, model="bench")
    batch = rng.normal(size=(10, dim)).astype(np.float32)
    seconds, _ = timed(lambda: ds.policy_distribution(batch, 30), repeat=5)
    return {"keys": keys, "dim": dim, "batch": 10, "k": 30, "search": ds.index.meta.kind,
            "policy_ms_per_batch": round(1e3 * seconds, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--passages", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rows", type=int, default=50_000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--clusters", type=int, default=1_000)
    p.add_argument("--intrinsic-dim", type=int, default=32, help="rank of the synthetic embeddings' subspace")
    p.add_argument("--queries", type=int, default=1_000)
    p.add_argument("-k", type=int, default=10)
    p.add_argument("--datastore-keys", type=int, default=50_000)
    p.add_argument("--datastore-dim", type=int, default=3584)  # Qwen2.5-7B hidden size
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
                  "encode": bench_encoder(args.passages, args.batch_size),
                  "search": bench_search(args.rows, args.dim, args.clusters, args.intrinsic_dim, args.queries,
                                         args.k, Path(tmp)),
                  "datastore": bench_datastore(args.datastore_keys, args.datastore_dim, Path(tmp))}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
