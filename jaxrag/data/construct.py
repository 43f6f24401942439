"""Training-data construction: SR-RAG's Algorithm 1 (paper §3.3, App. B.1).

For each (q, a) of the training mixture: n retrieved passages c_e, n GenRead verbalizations c_i
(`construct_genread`), l_j = log p_M(a | q, c_j) for all 2n contexts and log p_M(a | q) with no
context, the preferred source (`label_source`, `construct_labels`) and the best / worst context of each source.

    out = construct(model, [("nq", example), ...], retriever.retrieve_texts, retriever.encoder,
                    cfg.construct, workdir / "construct", rng_seed=cfg.seed)
    records = read_construct(out, model.sources)  # stage 1 / stage 2 input

One JSONL record per question (`train.batches.read_records` reads each shard):

    {"id", "dataset", "question" (as the model sees it: `QAExample.prompt_question()`),
     "golden_answers" (non-empty ones; the first is scored), "label": "self" | "wiki",
     "contexts": [{"source": "self", "text", "loglik", "truncated", "cluster", "demos"},
                  {"source": "wiki", "text", "loglik", "rank"}],   # self first, then wiki
     "no_context_loglik", "best": {"self": i, "wiki": j}, "worst": {"self": i, "wiki": j},
     "source_loglik": {"self": log sum_i p_i, "wiki": ... | null},
     "selective_label": "wiki" | "none", "no_kv_label": "wiki" | "self",
     "problems": {"truncated", "empty_verbalizations", "demos_dropped", "empty_passages",
                  "missing_passages"}}

Output directory: `manifest.json` (inputs and settings; a rerun with others is refused),
`round1/` (GenRead round 1 and its k-means pools), `shard-00000.jsonl`, ... and, last, `stats.json`
(the completion marker). Questions are sorted by (dataset, id) and cut into shards of
`shard_size`; process p of P builds the shards with `shard % P == p`. A shard is written to a temp
file and renamed, so a rerun skips finished shards and redoes an interrupted one: a kill -9 at any
moment loses and duplicates nothing. Sampling is seeded per shard, so a redone shard is identical.
With several hosts `out_dir` must be on a shared filesystem, and each process's decoder must be
placed on its own local devices (shards are built independently, without collectives).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxrag.runtime import host_memory
from jaxrag.data.construct_genread import (
    POOLS,
    ROUND1,
    DemoPool,
    genread_pools,
    genread_prompt,
    is_ambiguous,
    redraw_sampling,
    round1_path,
    verbalize,
    wait_for,
    write_json,
)
from jaxrag.data.construct_labels import best_worst, label_source, no_context_label, source_logliks
from jaxrag.data.construct_stats import construct_stats, stats_markdown
from jaxrag.data.schema import QAExample, write_jsonl
from jaxrag.decode.sampler import SamplingParams
from jaxrag.decode.scoring import score
from jaxrag.errors import JaxragError
from jaxrag.models.tokens import NONE, SELF, WIKI
from jaxrag.prompts import answer_ids, answer_prefix_ids, base_prompt_ids, base_prompt_text, prompt_ids
from jaxrag.train.batches import read_records

__all__ = ["ConstructParams", "answer_logliks", "best_worst", "construct", "construct_done", "construct_stats",
           "label_source", "no_context_label", "read_construct", "source_logliks", "stats_markdown"]

MANIFEST, STATS = "manifest.json", "stats.json"
Retrieve = Callable[[Sequence[str], int], list[list[str]]]


@dataclasses.dataclass(frozen=True)
class ConstructParams:
    """`cfg.construct`. Paper values: n = 5 contexts per source, verbalizations <= 150 tokens,
    GenRead round 2 with 5 k-means clusters x 5 demonstrations (App. B.1)."""

    n_contexts: int = 5
    verbalize_max_tokens: int = 150
    kmeans_clusters: int = 5
    demos_per_cluster: int = 5
    label_rule: str = "sum"  # Algorithm 1 line 11; "majority" = §3.3's majority of the top-n
    verbalize_temperature: float = 0.7  # round 2 (round 1 is greedy, as GenRead's zero-shot step)
    verbalize_top_p: float = 0.9
    max_prompt_tokens: int = 0  # GenRead prompt budget; 0 = model max positions - verbalize_max_tokens
    shard_size: int = 256  # questions per output shard (the unit of resumption)
    generate_batch_size: int = 64
    score_batch_size: int = 32

    @classmethod
    def from_config(cls, section=None) -> ConstructParams:
        """A ConfigDict / dict (missing fields take the defaults above); unknown fields are errors."""
        values = {} if section is None else dict(section.to_dict() if hasattr(section, "to_dict") else section)
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise JaxragError(f"config.construct: unknown field {unknown[0]!r} (known: {', '.join(names)})")
        params = cls(**values)
        problems = [f"{name} must be >= {low}" for name, low in
                    (("n_contexts", 1), ("verbalize_max_tokens", 1), ("kmeans_clusters", 1), ("demos_per_cluster", 0),
                     ("max_prompt_tokens", 0), ("shard_size", 1), ("generate_batch_size", 1), ("score_batch_size", 1))
                    if getattr(params, name) < low]
        if params.label_rule not in ("sum", "majority"):
            problems.append(f"label_rule must be 'sum' or 'majority', got {params.label_rule!r}")
        if params.verbalize_temperature < 0 or not 0 < params.verbalize_top_p <= 1:
            problems.append("verbalize_temperature must be >= 0 and verbalize_top_p in (0, 1]")
        if problems:
            raise JaxragError("config.construct: " + "; ".join(problems))
        return params


# ---------------------------------------------------------------------------------------------
# Likelihoods
# ---------------------------------------------------------------------------------------------

def answer_logliks(model, questions: Sequence[str], answers: Sequence[str], contexts: Sequence[Sequence[str]],
                   batch_size: int = 32) -> tuple[list[np.ndarray], np.ndarray]:
    """log p_M(a | q, c) for every context of every question ([len(contexts[i])] each) and
    log p_M(a | q) with no context ([n]). Prefix = `base_prompt_ids(base_prompt_text(q, [c]))`,
    target = `answer_ids(a)` (the answer and EOS). A question's rows are one `score` group: their
    shared leading tokens (the prompt's header and the question) run once."""
    tok = model.tokenizer
    texts, owner = [], []
    for i, (q, cs) in enumerate(zip(questions, contexts)):
        texts += [base_prompt_text(q)] + [base_prompt_text(q, [c]) for c in cs]
        owner += [i] * (1 + len(cs))
    prefixes = base_prompt_ids(tok, texts)
    targets = answer_ids(tok, list(answers))
    flat = score(model.decoder, prefixes, [targets[i] for i in owner], batch_size, groups=owner).total
    out, no_context, start = [], np.empty(len(questions), np.float64), 0
    for i, cs in enumerate(contexts):
        no_context[i] = flat[start]
        out.append(flat[start + 1:start + 1 + len(cs)])
        start += 1 + len(cs)
    return out, no_context


# ---------------------------------------------------------------------------------------------
# One shard
# ---------------------------------------------------------------------------------------------

class Item(NamedTuple):
    dataset: str
    example: QAExample
    answers: tuple[str, ...]  # the non-empty golden answers

    @property
    def question(self) -> str:
        return self.example.prompt_question()


def _prompt_limit(model, params: ConstructParams) -> int:
    if params.max_prompt_tokens:
        return params.max_prompt_tokens
    max_positions = int(getattr(model.hf_config, "max_position_embeddings", 0) or 0)
    return max(max_positions - params.verbalize_max_tokens, 0)


def _retrieved(retrieve: Retrieve, questions: list[str], n: int) -> tuple[list[list[str]], list[dict]]:
    """Up to n non-empty passages per question, and per question the problems met."""
    results = retrieve(questions, n)
    if len(results) != len(questions):
        raise JaxragError(f"retrieve returned {len(results)} result lists for {len(questions)} questions")
    passages, problems = [], []
    for found in results:
        found = list(found or [])[:n]
        kept = [p.strip() for p in found if isinstance(p, str) and p.strip()]
        passages.append(kept)
        problems.append({"empty_passages": len(found) - len(kept), "missing_passages": n - len(kept)})
    return passages, problems


def construct_shard(model, items: Sequence[Item], shard: int, pools: dict[str, DemoPool], retrieve: Retrieve,
                    params: ConstructParams, seed: int) -> list[dict]:
    """Algorithm 1 for one shard's questions -> their records."""
    n, tok = params.n_contexts, model.tokenizer
    questions = [it.question for it in items]
    passages, problems = _retrieved(retrieve, questions, n)
    prompts, meta, limit = [], [], _prompt_limit(model, params)
    for it, q in zip(items, questions):
        pool = pools.get(it.dataset)
        for j in range(n):
            demos = pool.demos_for(it.example.id, j, params.demos_per_cluster, seed, it.dataset) if pool else []
            ids, kept = genread_prompt(tok, q, is_ambiguous(it.dataset, it.example), demos, limit)
            prompts.append(ids)
            meta.append({"cluster": j % pool.n_clusters if pool and pool.n_clusters else -1, "demos": kept,
                         "dropped": len(demos) - kept})
    sampling = SamplingParams(temperature=params.verbalize_temperature, top_p=params.verbalize_top_p)
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 2), shard)  # stream 2: round 2
    verbs = verbalize(model, prompts, params.verbalize_max_tokens, sampling=sampling, rng=rng,
                      batch_size=params.generate_batch_size, redraw=redraw_sampling(params))
    # Still empty after the redraws: not a context (never c_i+ / c_i-), counted in problems.
    kept = [[(v, m) for v, m in zip(verbs[i * n:(i + 1) * n], meta[i * n:(i + 1) * n]) if v.text]
            for i in range(len(items))]
    texts = [[v.text for v, _ in kept[i]] + passages[i] for i in range(len(items))]
    logliks, no_context = answer_logliks(model, questions, [it.answers[0] for it in items], texts,
                                         params.score_batch_size)
    records = []
    for i, it in enumerate(items):
        k = len(kept[i])
        contexts = [{"source": SELF, "text": v.text, "loglik": float(x), "truncated": v.truncated,
                     "cluster": m["cluster"], "demos": m["demos"]} for (v, m), x in zip(kept[i], logliks[i])]
        contexts += [{"source": WIKI, "text": p, "loglik": float(x), "rank": r}
                     for r, (p, x) in enumerate(zip(passages[i], logliks[i][k:]))]
        if not contexts:
            continue  # nothing to learn from (counted in stats.json as no_context)
        sources, ll = [c["source"] for c in contexts], [c["loglik"] for c in contexts]
        best, worst = best_worst(sources, ll)
        no_kv = no_context_label(ll[k:], float(no_context[i]), n, params.label_rule, n)
        records.append({
            "id": it.example.id, "dataset": it.dataset, "question": questions[i], "golden_answers": list(it.answers),
            "label": label_source(sources, ll, params.label_rule, n), "contexts": contexts,
            "no_context_loglik": float(no_context[i]), "best": best, "worst": worst,
            "source_loglik": {s: None if t == -math.inf else t for s, t in source_logliks(sources, ll).items()},
            "selective_label": WIKI if no_kv == WIKI else NONE, "no_kv_label": no_kv,
            "problems": {"truncated": sum(v.truncated for v, _ in kept[i]),
                         "empty_verbalizations": n - k,
                         "demos_dropped": sum(m["dropped"] for m in meta[i * n:(i + 1) * n]), **problems[i]},
        })
    return records


# ---------------------------------------------------------------------------------------------
# The stage: shards, resumption, hosts
# ---------------------------------------------------------------------------------------------

def training_lengths(tokenizer, items: Sequence[Item]) -> list[int]:
    """Tokens of each item's stage-1 sequence without its knowledge (`train.batches.assemble`:
    the prompt up to <EOQ>, the source token, `<EOK> Answer:` and the answer + EOS), the part
    that training never truncates."""
    prompts = prompt_ids(tokenizer, [it.question for it in items])
    answers = answer_ids(tokenizer, [it.answers[0] for it in items])
    tail = len(answer_prefix_ids(tokenizer))
    return [len(p) + 1 + tail + len(a) for p, a in zip(prompts, answers)]


def drop_too_long(tokenizer, items: list[Item], max_length: int) -> tuple[list[Item], Counter]:
    """Items whose question and answer alone exceed the training length `max_length` are dropped
    here (their knowledge would be cut to nothing), counted per dataset, never raised in stage 1."""
    if not max_length or not items:
        return items, Counter()
    lengths = training_lengths(tokenizer, items)
    dropped = Counter(it.dataset for it, n in zip(items, lengths) if n > max_length)
    if dropped:
        warnings.warn(f"construct: dropping {sum(dropped.values())} questions whose question and answer alone take "
                      f"more than model.max_length={max_length} tokens "
                      f"({', '.join(f'{d}: {k}' for d, k in sorted(dropped.items()))})", stacklevel=3)
    return [it for it, n in zip(items, lengths) if n <= max_length], dropped


def prepare_items(examples: Iterable[tuple[str, QAExample]]) -> tuple[list[Item], Counter]:
    """(dataset, example) pairs -> items sorted by (dataset, id), and per dataset the number of
    questions skipped for having no non-empty golden answer (never silently: a warning too)."""
    items, skipped, seen = [], Counter(), set()
    for dataset, ex in examples:
        if (dataset, ex.id) in seen:
            raise JaxragError(f"training mixture: dataset {dataset!r} has question id {ex.id!r} twice")
        seen.add((dataset, ex.id))
        answers = tuple(a.strip() for a in ex.golden_answers if isinstance(a, str) and a.strip())
        if answers:
            items.append(Item(dataset, ex, answers))
        else:
            skipped[dataset] += 1
    if skipped:
        warnings.warn(f"construct: skipping {sum(skipped.values())} questions without a golden answer "
                      f"({', '.join(f'{d}: {k}' for d, k in sorted(skipped.items()))})", stacklevel=3)
    return sorted(items, key=lambda it: (it.dataset, it.example.id)), skipped


def shard_path(out_dir: Path, shard: int) -> Path:
    return out_dir / f"shard-{shard:05d}.jsonl"


def _check_manifest(out_dir: Path, manifest: dict, process_index: int, timeout_s: float) -> None:
    path = out_dir / MANIFEST
    if process_index == 0 and not path.exists():
        write_json(path, manifest)
    wait_for([path], "the manifest of process 0", timeout_s)
    old = json.loads(path.read_text(encoding="utf-8"))
    if old != manifest:
        changed = sorted(k for k in set(old) | set(manifest) if old.get(k) != manifest.get(k))
        raise JaxragError(f"{out_dir}: holds a construct run with other inputs or settings ({', '.join(changed)} "
                          "differ); delete it or choose another directory")


def construct(model, examples: Iterable[tuple[str, QAExample]], retrieve: Retrieve, encoder, section,
              out_dir: str | os.PathLike, *, rng_seed: int = 0, process_index: int | None = None,
              process_count: int | None = None, progress: bool = True,
              wait_timeout_s: float = 24 * 3600, max_length: int = 0) -> Path:
    """Algorithm 1 over the training mixture -> `out_dir` (shards + stats.json; see module doc).

    model: the base `Model` (decoder + tokenizer). examples: (dataset name, QAExample) pairs.
    retrieve(questions, k) -> k passage texts per question (`Retriever.retrieve_texts`).
    encoder: `.encode(texts) -> [n, dim]`, embeds GenRead round 1 for k-means.
    section: `cfg.construct` (`ConstructParams` fields); a batch's rows are split over the
    model's mesh (`sampler.placement`), the shards between the processes. max_length: the
    training sequence length (`model.max_length`; 0 = no limit): longer question + answer
    pairs are dropped and counted (`drop_too_long`).
    Returns `out_dir`; rerunning resumes, a finished run returns at once."""
    params = ConstructParams.from_config(section)
    out_dir = Path(out_dir)
    pi = jax.process_index() if process_index is None else int(process_index)
    pc = jax.process_count() if process_count is None else int(process_count)
    if not 0 <= pi < pc:
        raise JaxragError(f"process_index {pi} outside 0..{pc - 1}")
    items, skipped = prepare_items(examples)
    if not items:
        raise JaxragError("construct: the training mixture is empty (data.train / data.train_sizes) or no question "
                          "has a golden answer")
    items, too_long = drop_too_long(model.tokenizer, items, int(max_length))
    if not items:
        raise JaxragError(f"construct: every question of the training mixture is longer than model.max_length="
                          f"{max_length} tokens with its answer; raise --config.model.max_length")
    shards = [items[s:s + params.shard_size] for s in range(0, len(items), params.shard_size)]
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = hashlib.sha256("\n".join(f"{it.dataset}\t{it.example.id}" for it in items).encode()).hexdigest()
    manifest = {"format": "jaxrag-construct-1", "params": dataclasses.asdict(params), "seed": int(rng_seed),
                "questions": len(items), "shards": len(shards), "ids_sha256": ids,
                "skipped": dict(sorted(skipped.items())), "too_long": dict(sorted(too_long.items()))}
    _check_manifest(out_dir, manifest, pi, wait_timeout_s)
    if construct_done(out_dir):
        return out_dir
    mine = [k for k in range(len(shards)) if k % pc == pi]
    for k in mine:  # temp files of this process's shards left by a killed run
        for path in (shard_path(out_dir, k), round1_path(out_dir, k)):
            for stale in path.parent.glob(f".{path.name}.*.tmp"):
                stale.unlink(missing_ok=True)
    todo = [k for k in mine if not shard_path(out_dir, k).exists()]
    demos = params.demos_per_cluster > 0  # zero-shot round 2 needs no round 1 or pools
    if todo or (demos and not (out_dir / ROUND1 / POOLS).exists()):
        pools = genread_pools(model, shards, mine, out_dir, encoder, params, int(rng_seed), pi,
                              wait_timeout_s, progress) if demos else {}
        done = sum(len(shards[k]) for k in mine) - sum(len(shards[k]) for k in todo)
        with tqdm(total=done + sum(len(shards[k]) for k in todo), initial=done, desc="construct", unit="q",
                  disable=not progress) as bar:
            for k in todo:
                host_memory.bound()
                write_jsonl(shard_path(out_dir, k),
                            construct_shard(model, shards[k], k, pools, retrieve, params, int(rng_seed)))
                bar.update(len(shards[k]))
    if pi == 0:
        wait_for([shard_path(out_dir, k) for k in range(len(shards))], "the other processes' shards", wait_timeout_s)
        stats = construct_stats(out_dir, dict(skipped), Counter(it.dataset for it in items), params, dict(too_long))
        write_json(out_dir / STATS, stats)
        if any(stats["all"][k] for k in ("truncated_verbalizations", "short_retrieval", "skipped_no_answer", "too_long")):
            warnings.warn("construct: problems counted in stats.json:\n" + stats_markdown(stats), stacklevel=2)
    return out_dir


def construct_done(out_dir: str | os.PathLike) -> bool:
    """Whether the stage finished: `stats.json` is written last, after every shard."""
    return (Path(out_dir) / STATS).is_file()


def read_construct(out_dir: str | os.PathLike, sources: Sequence[str]) -> list:
    """All records of a finished run as `train.batches.TrainRecord`s, in shard order."""
    out_dir = Path(out_dir)
    if not construct_done(out_dir):
        raise JaxragError(f"{out_dir}: the construct stage has not finished (no {STATS})")
    return [r for path in sorted(out_dir.glob("shard-*.jsonl")) for r in read_records(path, sources)]
