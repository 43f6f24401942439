"""Latency measured, not modelled (paper App. B.2, Figure 4).

Every method is timed the same way, on the same questions (`latency_indices`: the first
`eval.latency_questions` test questions of each set) in the same batches (`latency_batches`:
`inference.batch_size` rows, paper B = 10, never mixing datasets), calling the real retriever:
the fine-tuned models' methods, constant ones included, are routed for real by `route()` with the
method's own policy; the untuned model's always-RAG and GenRead run the same batches through its
own prompts (`untuned_route_items`: retrieve or verbalize, then answer). Each batch phase's
measured time is shared by the rows in it (`phases.charge_phases`): T_d (prefill + the policy's
own compute, e.g. SeaKR's samples) by all rows, T_v by the rows that verbalize, T_r by the rows
that retrieve, T_g by all; an item's latency is T_d + (T_v or T_r) + T_g. So a batch whose one
verbalization is long costs its verbalizing rows that long, and nothing here is linear in %
retrieval by construction. A batch during which JAX compiled anything (a shape, or a policy's own
program, seen for the first time) is run again and the second run kept
(`harness.without_compiles`): compilation is not latency.

Accuracy keeps coming from the decode-once harness (exact for greedy decoding); the routed
answers are checked against it (`agreement`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxrag.decode.phases import charge_phases
from jaxrag.decode.policy import Policy
from jaxrag.decode.routing import RouteConfig, Routed, route
from jaxrag.decode.sampler import generate
from jaxrag.eval.harness import Decision, Item, Mapper, Paths, local_map, questions_of, without_compiles
from jaxrag.eval.metrics import score_prediction
from jaxrag.models.model import Model
from jaxrag.models.tokens import SELF, WIKI
from jaxrag.policies.srrag import Neighbours, srrag_policy
from jaxrag.prompts import base_prompt_ids, base_prompt_text, genread_prompt_text, join_passages

PHASES = ("T_d", "T_v", "T_r", "T_g")


def latency_indices(items: Sequence[Item], per_dataset: int) -> np.ndarray:
    """Indices of the first `per_dataset` questions of each dataset (test order)."""
    seen: dict[str, int] = {}
    keep = []
    for i, (name, _) in enumerate(items):
        if seen.get(name, 0) < per_dataset:
            seen[name] = seen.get(name, 0) + 1
            keep.append(i)
    return np.array(keep, int)


def latency_batches(items: Sequence[Item], batch_size: int) -> list[list[int]]:
    """Item indices in batches of `batch_size` within each dataset (a batch never mixes
    datasets, so per-dataset latency is that dataset's own): every method's batches."""
    names = [name for name, _ in items]
    batches = []
    for name in dict.fromkeys(names):
        idx = [i for i, n in enumerate(names) if n == name]
        batches += [idx[s:s + batch_size] for s in range(0, len(idx), batch_size)]
    return batches


def route_items(model: Model, items: Sequence[Item], policy: Policy, retrieve: Callable, cfg: RouteConfig,
                batch_size: int, desc: str, mapper: Mapper | None = None) -> list[Routed]:
    """`route()` over items in `latency_batches` (mapped by `mapper`, `harness.Mapper`)."""
    questions = questions_of(items)
    batches = latency_batches(items, batch_size)
    done = (mapper or local_map)(
        lambda batch: without_compiles(lambda: route(model, [questions[i] for i in batch], policy, retrieve, cfg,
                                                     rows=batch_size)), batches, desc)
    return _in_item_order(len(items), batches, done)


def _in_item_order(n: int, batches: list[list[int]], done: list[list[Routed]]) -> list[Routed]:
    out: list[Routed | None] = [None] * n
    for batch, routed in zip(batches, done):
        for i, r in zip(batch, routed):
            out[i] = r
    return out


def _timed(fn, clock):
    start = clock()
    out = fn()
    return out, clock() - start


def untuned_route_items(model: Model, items: Sequence[Item], source: str, retrieve: Callable, cfg: RouteConfig,
                        batch_size: int, desc: str, clock: Callable[[], float] = time.perf_counter,
                        mapper: Mapper | None = None) -> list[Routed]:
    """The untuned model's constant methods in `latency_batches`, on its own prompts (as
    `harness.untuned_paths`): `wiki` = always-RAG (one batched retrieval, T_r, then the answer
    with the passages, T_g); `self` = GenRead (the background document, T_v, then the answer
    with it, T_g). No source selection runs (T_d = 0). `clock`: seconds, injectable for tests."""
    if source not in (WIKI, SELF):
        raise ValueError(f"untuned_route_items: source {source!r} is neither {WIKI!r} nor {SELF!r}")
    tok = model.tokenizer
    eos = [] if tok.eos_token_id is None else [tok.eos_token_id]
    questions = questions_of(items)

    def gen(prompts: list[str], max_new: int) -> list[str]:
        out = generate(model.decoder, base_prompt_ids(tok, prompts), max_new, stop_ids=eos, rows=batch_size)
        return [tok.decode(o, skip_special_tokens=True).strip() for o in out]

    def run(batch: list[int]) -> list[Routed]:
        qs = [questions[i] for i in batch]
        if source == WIKI:
            knowledge, t_k = _timed(lambda: retrieve(qs), clock)
            prompts = [base_prompt_text(q, p) for q, p in zip(qs, knowledge)]
            phase = "T_r"
        else:
            knowledge, t_k = _timed(lambda: gen([genread_prompt_text(q) for q in qs], cfg.max_verbal_tokens), clock)
            prompts = [base_prompt_text(q, [d]) for q, d in zip(qs, knowledge)]
            phase = "T_v"
        answers, t_g = _timed(lambda: gen(prompts, cfg.max_answer_tokens), clock)
        charged = charge_phases({phase: t_k, "T_g": t_g}, [source] * len(qs))
        return [Routed(question=q, source=source, p_model=[], p_datastore=None, score=None,
                       knowledge=k if isinstance(k, str) else join_passages(k), answer=a, knowledge_truncated=False,
                       latency={p: v for p, v in c.items() if p != "T_d"})
                for q, k, a, c in zip(qs, knowledge, answers, charged)]

    batches = latency_batches(items, batch_size)
    done = (mapper or local_map)(lambda batch: without_compiles(lambda: run(batch)), batches, desc)
    return _in_item_order(len(items), batches, done)


def item_seconds(r: Routed) -> float:
    return float(sum(r.latency.values()))


def summarize(items: Sequence[Item], routed: Sequence[Routed]) -> dict:
    """Measured latency per dataset and averaged over datasets (as Table 1 averages), each
    phase's mean per item, % retrieval and the routed answers' own accuracy."""
    names = np.array([name for name, _ in items])
    secs = np.array([item_seconds(r) for r in routed])
    acc = np.array([score_prediction(name, r.answer, ex) for (name, ex), r in zip(items, routed)])
    wiki = np.array([r.source == WIKI for r in routed])
    per = {name: {"latency_s": float(secs[names == name].mean()), "acc": float(acc[names == name].mean()),
                  "rag_frac": float(wiki[names == name].mean()), "n": int((names == name).sum())}
           for name in dict.fromkeys(names.tolist())}
    phases = {p: float(np.mean([r.latency.get(p, 0.0) for r in routed])) for p in PHASES}
    return {"latency_s": float(np.mean([v["latency_s"] for v in per.values()])),
            "acc": float(np.mean([v["acc"] for v in per.values()])),
            "rag_frac": float(np.mean([v["rag_frac"] for v in per.values()])),
            "phases": phases, "per_dataset": per, "n": len(routed)}


def agreement(routed: Sequence[Routed], idx: np.ndarray, paths: Paths, decision: Decision) -> dict:
    """How often the real routed run made the harness's decision and wrote the harness's answer
    along the path it took (differences come from near-ties under another batch padding)."""
    same_source, same_answer = [], []
    for r, i in zip(routed, idx):
        source = WIKI if decision.retrieve[i] else paths.other
        same_source.append(r.source == source)
        same_answer.append(r.answer == paths.answers[r.source][i])
    return {"decisions_equal_harness": float(np.mean(same_source)),
            "answers_equal_harness": float(np.mean(same_answer))}


def figure4(model: Model, items: Sequence[Item], validation_score: np.ndarray, neighbours: Neighbours | None,
            retrieve: Callable, cfg: RouteConfig, batch_size: int, points: int,
            mapper: Mapper | None = None) -> list[dict]:
    """Figure 4: SR-RAG routed for real on `items` at `points` thresholds, set at quantiles of its
    score on the validation questions (`validation_score`: never a test question) so that
    0, 1/(points-1), ..., 1 of the validation questions are verbalized; each point reports the
    share of the validation questions its threshold verbalizes (tied scores fall on one side of a
    threshold together, so it can differ from the asked share) and the proportion the test questions
    actually verbalized (an illustration of the trade-off, not an operating point)."""
    curve = []
    for frac in np.linspace(0.0, 1.0, points):
        t = figure4_threshold(validation_score, frac)
        routed = route_items(model, items, srrag_policy(neighbours, t), retrieve, cfg, batch_size,
                             f"figure 4 [{frac:.0%} of validation verbalized]", mapper)
        s = summarize(items, routed)
        curve.append({"threshold": t, "verbalized_frac_validation": float(np.mean(np.asarray(validation_score) <= t)),
                      "verbalized_frac": 1.0 - s["rag_frac"], "rag_frac": s["rag_frac"],
                      "acc": s["acc"], "latency_s": s["latency_s"], "phases": s["phases"]})
    return curve


def figure4_threshold(score: np.ndarray, verbalized: float) -> float:
    """The t in `retrieve iff score > t` that verbalizes the `verbalized` share of `score`'s
    questions: below every score at 0 (retrieve all), the maximum at 1 (verbalize all)."""
    score = np.asarray(score, np.float64)
    if verbalized <= 0:
        return float(score.min() - 1.0)
    if verbalized >= 1:
        return float(score.max())
    return float(np.quantile(score, verbalized, method="lower"))
