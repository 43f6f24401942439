"""Retrieval: ScaNN vs exact search over one `jaxrag.retrieval` index (recall@10, queries/s, build).

    python -m benchmarks.retrieval --n 100000 --dim 384 --json OUT [--queries 1000]

The vectors are synthetic but shaped like text embeddings: unit vectors clustered on a low-rank
subspace (`--clusters`, `--intrinsic-dim`). Isotropic full-rank clusters are much harder for any
partitioned index; raise leaves_to_search for such data. The index is built with ScaNN at every
size (`exact_below=0`) and its other settings derived as the pipeline derives them. Queries are
perturbed corpus vectors. recall_at_10 is ScaNN's top 10 against numpy's brute-force top 10 (by
score, so tied rows count either way); qps is batched throughput (one call for all queries, best
of `--repeats`); `sweep` adds recall and qps at half and twice the default leaves_to_search.
index_bytes is the index directory on disk (vectors.bin for exact search + the ScaNN searcher).

Beside the comparison: `encoder` (the pipeline's retriever encoder, passages/s on ~100-word
passages; `--encoder-passages 0` skips it) and `datastore` (the policy datastore's kNN
p_D(<Wiki>) for a batch of B = 10 at k = 30 over `--datastore-keys` hidden states of Qwen2.5-7B's
width; 0 skips it).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from benchmarks.common import Parser, environment, positive_int, write_json

K = 10


def clustered(n: int, dim: int, clusters: int, intrinsic_dim: int, seed: int = 0) -> np.ndarray:
    """[n, dim] float32 unit vectors that, like text embeddings, cluster on a low-dimensional
    subspace: clustered points in R^intrinsic_dim, mapped linearly to R^dim, plus a little
    full-rank noise."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, intrinsic_dim))
    z = centres[rng.integers(0, clusters, n)] + 0.6 * rng.normal(size=(n, intrinsic_dim))
    x = z @ (rng.normal(size=(intrinsic_dim, dim)) / np.sqrt(intrinsic_dim)) + 0.05 * rng.normal(size=(n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def queries_near(x: np.ndarray, count: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q = x[rng.integers(0, len(x), count)] + 0.02 * rng.normal(size=(count, x.shape[1]))
    return (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)


def brute_force_kth(x: np.ndarray, q: np.ndarray, k: int, chunk: int = 256) -> np.ndarray:
    """[queries] the k-th best inner product of each query (numpy, float64), in query chunks."""
    out = np.empty(len(q))
    for start in range(0, len(q), chunk):
        scores = q[start: start + chunk].astype(np.float64) @ x.T.astype(np.float64)
        out[start: start + chunk] = -np.partition(-scores, k - 1, axis=1)[:, k - 1]
    return out


def recall_at_k(x: np.ndarray, q: np.ndarray, rows: np.ndarray, kth: np.ndarray, tol: float = 1e-5) -> float:
    """Fraction of the true top k found: a returned row counts when its exact score reaches the
    k-th best score (so either of two tied rows is right); duplicate rows count once."""
    hits = 0
    for query, found, bar in zip(q, rows, kth):
        found = np.unique(found[found >= 0])
        hits += min(int(np.sum(x[found] @ query >= bar - tol)), rows.shape[1])
    return hits / rows.size


def best_time(fn, repeats: int) -> tuple[float, object]:
    """Best-of-`repeats` wall time of fn() after one untimed call (compiles, loads searchers)."""
    out, best = fn(), float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bench(x: np.ndarray, q: np.ndarray, workdir: Path, repeats: int = 3) -> tuple[dict, np.ndarray]:
    """(result, ScaNN's rows [queries, K] at the default settings) for corpus x and queries q."""
    from jaxrag.retrieval.index import IndexParams
    from jaxrag.retrieval.writer import build_index

    start = time.perf_counter()
    index = build_index(workdir / "index", x, [str(i) for i in range(len(x))], encoder="bench",
                        params=IndexParams(exact_below=0))
    build_s = time.perf_counter() - start
    exact_s, exact = best_time(lambda: index.search(q, K, exact=True), repeats)
    scann_s, scann = best_time(lambda: index.search(q, K), repeats)
    kth = brute_force_kth(x, q, K)
    settings = index.meta.settings
    result = {"n": len(x), "dim": x.shape[1], "queries": len(q), "k": K,
              "recall_at_10": round(recall_at_k(x, q, scann.rows, kth), 4),
              "scann_qps": round(len(q) / scann_s, 1), "exact_qps": round(len(q) / exact_s, 1),
              "build_s": round(build_s, 2), "index_bytes": dir_bytes(index.path),
              "exact_recall_at_10": round(recall_at_k(x, q, exact.rows, kth), 4),
              "scann_bytes": dir_bytes(index.path / "scann"),
              "settings": {key: settings[key] for key in ("num_leaves", "leaves_to_search", "reorder", "dims_per_block")},
              "sweep": []}
    default = settings["leaves_to_search"]
    for leaves in tqdm(sorted({max(1, default // 2), 2 * default}), desc="leaves_to_search sweep", unit="setting"):
        seconds, found = best_time(lambda: index.search(q, K, leaves_to_search=leaves), repeats)
        result["sweep"].append({"leaves_to_search": leaves, "recall_at_10": round(recall_at_k(x, q, found.rows, kth), 4),
                                "scann_qps": round(len(q) / seconds, 1)})
    return result, scann.rows


def synthetic_passages(n: int, words: int = 100, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    vocab = ("the of and to in is was for on as by with he at from his an it were are which this be or has had "
             "first one their its new after who they have her she two been other when there all during into "
             "school time may years more most only over city some world would where later up such used many can "
             "state about national out known university united then made").split()
    return [" ".join(rng.choice(vocab, words)) for _ in range(n)]


def bench_encoder(n: int, batch_size: int = 64) -> dict:
    from jaxrag.models.encoder_io import load_encoder

    encoder = load_encoder()
    texts = synthetic_passages(n)
    seconds, _ = best_time(lambda: encoder.encode(texts, batch_size=batch_size), 1)
    tokens = np.mean([len(t) for t in encoder.tokenizer(texts[:256])["input_ids"]])
    return {"encoder": encoder.name, "passages": n, "batch_size": batch_size, "mean_tokens": round(float(tokens), 1),
            "passages_per_s": round(n / seconds, 1)}


def bench_datastore(keys: int, workdir: Path, dim: int = 3584, batch: int = 10, k: int = 30) -> dict:
    from jaxrag.retrieval.datastore import build_datastore

    rng = np.random.default_rng(2)
    hidden = rng.normal(size=(keys, dim)).astype(np.float32)
    labels = np.array(["wiki", "self"])[rng.integers(0, 2, keys)]
    ds = build_datastore(workdir / "ds", hidden, labels, [str(i) for i in range(keys)], [""] * keys, model="bench")
    queries = rng.normal(size=(batch, dim)).astype(np.float32)
    seconds, _ = best_time(lambda: ds.policy_distribution(queries, k), 5)
    return {"keys": keys, "dim": dim, "batch": batch, "k": k, "search": ds.index.meta.kind,
            "policy_ms_per_batch": round(1e3 * seconds, 2)}


def main(argv=None) -> dict:
    parser = Parser(prog="python -m benchmarks.retrieval", description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=positive_int, default=100_000, help="corpus vectors")
    parser.add_argument("--dim", type=positive_int, default=384)
    parser.add_argument("--json", required=True, metavar="OUT", help="where to write the result (JSON)")
    parser.add_argument("--queries", type=positive_int, default=1_000)
    parser.add_argument("--clusters", type=positive_int, default=1_000)
    parser.add_argument("--intrinsic-dim", type=positive_int, default=32, help="rank of the embeddings' subspace")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--encoder-passages", type=int, default=512, help="0 skips the encoder")
    parser.add_argument("--datastore-keys", type=int, default=50_000, help="0 skips the datastore")
    args = parser.parse_args(argv)
    if args.n < 20 * K:
        parser.error(f"--n {args.n}: ScaNN needs at least {20 * K} vectors to partition")
    if not Path(args.json).parent.is_dir():
        parser.error(f"--json {args.json}: directory {Path(args.json).parent} does not exist")
    env = environment()
    x = clustered(args.n, args.dim, args.clusters, min(args.intrinsic_dim, args.dim))
    q = queries_near(x, args.queries)
    with tempfile.TemporaryDirectory() as tmp:
        found, _ = bench(x, q, Path(tmp), args.repeats)
        if args.encoder_passages > 0:
            found["encoder"] = bench_encoder(args.encoder_passages)
        if args.datastore_keys > 0:
            found["datastore"] = bench_datastore(args.datastore_keys, Path(tmp))
    result = {**env, **found}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
