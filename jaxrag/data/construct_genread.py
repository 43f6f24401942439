"""GenRead knowledge verbalization for data construction (SR-RAG App. B.1; Yu et al., 2023).

Round 1: one greedy zero-shot document per question (`prompts.genread_prompt_text`). GenRead is run per
training dataset: each dataset's (question + document) pairs are embedded and clustered with
k-means into `kmeans_clusters` clusters. Round 2 is GenRead's clustering-based prompting:
verbalization j of a question is prompted with `demos_per_cluster` (question, document)
demonstrations drawn from cluster j mod K of its dataset, so the n verbalizations follow n
different demonstration styles (the paper: "five clusters and five examples from each cluster"
for n = 5), and are sampled with temperature for further diversity.

Demonstrations are drawn per (question, j) from a seed and the question's id, so a question's
prompts do not depend on which shard or host handles it; a question never demonstrates itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxrag.runtime import host_memory
from jaxrag.data.schema import write_jsonl
from jaxrag.decode import engine
from jaxrag.decode.sampler import SamplingParams
from jaxrag.errors import JaxragError
from jaxrag.prompts import base_prompt_ids, genread_fewshot_text

AMBIGUOUS_DATASETS = frozenset({"asqa"})  # App. B.1: ASQA's prompt asks for one document per reading
ROUND1, POOLS = "round1", "pools.json"  # out_dir/round1/{shard-00000.jsonl, ..., pools.json}


class Verbalization(NamedTuple):
    text: str
    truncated: bool  # hit the token limit before EOS (the text is the first max tokens)


def is_ambiguous(dataset: str, example) -> bool:
    """ASQA-style questions get GenRead's "generate multiple documents" instruction."""
    return bool(example.metadata.get("ambiguous")) or dataset.lower() in AMBIGUOUS_DATASETS


def stable_hash(*parts: str) -> int:
    """A process-independent 32-bit hash (Python's `hash` is salted per process)."""
    return zlib.crc32("\x00".join(parts).encode("utf-8"))


def genread_prompt(tokenizer, question: str, ambiguous: bool, demos: Sequence[tuple[str, str]],
                   max_tokens: int = 0) -> tuple[list[int], int]:
    """Token ids of a GenRead prompt: the (question, document) demonstrations, each written as a
    completed zero-shot prompt, then the question's own prompt. While the prompt is longer than
    `max_tokens` (0 = no limit) the last demonstration is dropped; the question never is.
    Returns (ids, number of demonstrations kept)."""
    kept = len(demos)
    while True:
        ids = base_prompt_ids(tokenizer, [genread_fewshot_text(list(demos[:kept]), question, ambiguous)])[0]
        if kept == 0 or not max_tokens or len(ids) <= max_tokens:
            return ids, kept
        kept -= 1


EMPTY_REDRAWS = 3  # sampled redraws of an empty document before it is given up (counted in stats.json)


def verbalize(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, sampling: SamplingParams,
              rng: jax.Array, batch_size: int, redraw: SamplingParams | None = None,
              redraws: int = EMPTY_REDRAWS) -> list[Verbalization]:
    """Generates one document per prompt (token ids), stopping at EOS or after `max_new_tokens`.

    Prompts run through the generation engine's pool of `batch_size` rows, shortest first, a
    finished row replaced by the next prompt at once (`decode.engine.generate`); prompt i samples
    with its own key (`sampling.row_keys(rng, i)`), so the result is a pure function of the
    prompts and rng, whatever the rows or device a prompt runs in.

    A document that comes out empty (the first token was EOS) is drawn again with `redraw`
    sampling (default `sampling`; round 1 is greedy, so its own rule would repeat the empty text),
    at most `redraws` times; one still empty after that stays "" for the caller to drop."""
    out = _generate_documents(model, prompts, range(len(prompts)), max_new_tokens, sampling, rng, batch_size)
    for attempt in range(redraws):
        empty = [i for i, v in enumerate(out) if not v.text]
        if not empty:
            break
        again = _generate_documents(model, prompts, empty, max_new_tokens, redraw or sampling,
                                    jax.random.fold_in(jax.random.fold_in(rng, 1 << 20), attempt), batch_size)
        for i, v in zip(empty, again):
            out[i] = v
    return out


def redraw_sampling(params) -> SamplingParams:
    """How an empty document is drawn again: round 2's sampling (temperature 1 if that is greedy)."""
    return SamplingParams(temperature=params.verbalize_temperature or 1.0, top_p=params.verbalize_top_p)


def _generate_documents(model, prompts, rows: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
                        rng: jax.Array, batch_size: int) -> list[Verbalization]:
    """`verbalize`'s one pass over `prompts[rows]` -> their documents, in `rows` order: through the
    generation engine's pool of `batch_size` rows (`decode.engine.generate`), each prompt keyed by
    its index."""
    tok = model.tokenizer
    eos = tok.eos_token_id
    if eos is None:
        raise JaxragError("GenRead verbalization stops at EOS, but the tokenizer has no eos_token")
    generated = engine.generate(model.decoder, [prompts[r] for r in rows], max_new_tokens, [eos], sampling, rng,
                                row_ids=list(rows), slots=batch_size)
    out = []
    for ids in generated:
        stopped = bool(ids) and ids[-1] == eos
        out.append(Verbalization(tok.decode(ids[:-1] if stopped else ids, skip_special_tokens=True).strip(),
                                 not stopped))
    return out


def kmeans_clusters(embeddings: np.ndarray, k: int, seed: int) -> np.ndarray:
    """embeddings [n, dim] -> cluster ids [n] in 0..K-1 (K <= k: every cluster non-empty).
    sklearn's KMeans with a fixed seed; fewer points than k give one cluster per point."""
    n = len(embeddings)
    if n <= k:
        return np.arange(n)
    # lazy: sklearn: only GenRead's clustering needs it, and it takes seconds to import
    from sklearn.cluster import KMeans

    labels = KMeans(n_clusters=k, random_state=seed, n_init=10).fit_predict(np.asarray(embeddings, np.float64))
    return np.unique(labels, return_inverse=True)[1].reshape(-1)  # contiguous ids if a cluster collapsed


@dataclasses.dataclass
class DemoPool:
    """One dataset's round-1 (question, document) pairs with their k-means cluster."""

    ids: list[str]
    questions: list[str]
    documents: list[str]
    clusters: list[int]

    def __post_init__(self):
        self._members: dict[int, list[int]] = {}
        for row, c in enumerate(self.clusters):
            self._members.setdefault(int(c), []).append(row)

    @property
    def n_clusters(self) -> int:
        return len(self._members)

    def sample(self, cluster: int, m: int, exclude_id: str, rng: np.random.Generator) -> list[tuple[str, str]]:
        """Up to m demonstrations from `cluster`, in random order, never `exclude_id` itself."""
        rows = [r for r in self._members.get(cluster, []) if self.ids[r] != exclude_id]
        picked = rng.permutation(len(rows))[:m]
        return [(self.questions[rows[p]], self.documents[rows[p]]) for p in picked]

    def demos_for(self, question_id: str, j: int, m: int, seed: int, dataset: str) -> list[tuple[str, str]]:
        """Demonstrations for verbalization j of a question: m from cluster j mod K."""
        if not self.n_clusters or m <= 0:
            return []
        rng = np.random.default_rng([seed, stable_hash(dataset, question_id), j])
        return self.sample(j % self.n_clusters, m, question_id, rng)

    def to_dict(self) -> dict:
        return {"ids": self.ids, "questions": self.questions, "documents": self.documents,
                "clusters": [int(c) for c in self.clusters]}


def build_pools(round1: Sequence[dict], encoder, k: int, seed: int) -> dict[str, DemoPool]:
    """Round-1 rows {"dataset", "id", "question", "document"} -> one clustered pool per dataset.
    GenRead embeds the question together with its document."""
    by_dataset: dict[str, list[dict]] = {}
    for row in sorted(round1, key=lambda r: (r["dataset"], r["id"])):
        if row["document"]:  # still empty after the redraws: no demonstration (counted in stats.json)
            by_dataset.setdefault(row["dataset"], []).append(row)
    pools = {}
    for name, rows in by_dataset.items():
        texts = [f"{r['question']} {r['document']}" for r in rows]
        clusters = kmeans_clusters(np.asarray(encoder.encode(texts)), k, seed) if k > 0 else np.zeros(len(rows), int)
        pools[name] = DemoPool([r["id"] for r in rows], [r["question"] for r in rows],
                               [r["document"] for r in rows], [int(c) for c in clusters])
    return pools


def pools_from_dict(data: dict) -> dict[str, DemoPool]:
    return {name: DemoPool(**fields) for name, fields in data.items()}


# ---------------------------------------------------------------------------------------------
# Round 1 in the construct stage's output directory (sharded like the output, resumable)
# ---------------------------------------------------------------------------------------------

def round1_path(out_dir: Path, shard: int) -> Path:
    return out_dir / ROUND1 / f"shard-{shard:05d}.jsonl"


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


POLL_S = 2.0  # how often a process looks for the files of the others


def wait_for(paths: Sequence[Path], what: str, timeout_s: float) -> None:
    """Waits until every path exists (files other processes write on a shared filesystem)."""
    deadline = time.monotonic() + timeout_s
    while missing := [p for p in paths if not p.exists()]:
        if time.monotonic() > deadline:
            raise JaxragError(f"waited {timeout_s:.0f}s for {what}: {len(missing)} files missing, e.g. {missing[0]} "
                              "(is every process running, on a shared filesystem?)")
        time.sleep(POLL_S)


def genread_pools(model, shards: Sequence[Sequence], mine: Sequence[int], out_dir: Path, encoder, params, seed: int,
                  process_index: int, timeout_s: float = 24 * 3600, progress: bool = True
                  ) -> dict[str, DemoPool]:
    """GenRead round 1 (greedy zero-shot) -> k-means demonstration pools per dataset.

    shards: the construct stage's shards of items (`.dataset`, `.example`, `.question`); this
    process writes round 1 of its shards `mine` to `round1/shard-*.jsonl` (resumable like the
    output); process 0 clusters them once all exist and caches the pools in `round1/pools.json`,
    which every process then reads. params: `ConstructParams`."""
    pools_path = out_dir / ROUND1 / POOLS
    if not pools_path.exists():
        (out_dir / ROUND1).mkdir(exist_ok=True)
        todo = [k for k in mine if not round1_path(out_dir, k).exists()]
        with tqdm(total=sum(len(shards[k]) for k in todo), desc="construct: GenRead round 1", unit="q",
                  disable=not progress) as bar:
            for k in todo:
                host_memory.bound()
                prompts = [genread_prompt(model.tokenizer, it.question, is_ambiguous(it.dataset, it.example), [])[0]
                           for it in shards[k]]
                verbs = verbalize(model, prompts, params.verbalize_max_tokens, sampling=SamplingParams(),
                                  rng=jax.random.key(seed), batch_size=params.generate_batch_size,
                                  redraw=redraw_sampling(params))
                write_jsonl(round1_path(out_dir, k), (
                    {"dataset": it.dataset, "id": it.example.id, "question": it.question, "document": v.text,
                     "truncated": v.truncated} for it, v in zip(shards[k], verbs)))
                bar.update(len(shards[k]))
        if process_index == 0:
            paths = [round1_path(out_dir, k) for k in range(len(shards))]
            wait_for(paths, "GenRead round 1 of the other processes", timeout_s)
            pools = build_pools([r for p in paths for r in read_jsonl(p)], encoder, params.kmeans_clusters, seed)
            write_json(pools_path, {name: pool.to_dict() for name, pool in pools.items()})
        wait_for([pools_path], "process 0's k-means demonstration pools", timeout_s)
    return pools_from_dict(json.loads(pools_path.read_text(encoding="utf-8")))
