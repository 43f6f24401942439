"""Latency measured, not modelled (paper App. B.2, Figure 4).

A method's questions are routed for real: `route()` with the method's own policy, in batches of
`inference.batch_size` (paper: B = 10), calling the real retriever. Each batch phase's measured
time is shared by the rows in it (`route`): T_d (prefill + the policy's own compute, e.g. SeaKR's
samples) by all rows, T_v by the rows that verbalize, T_r by the rows that retrieve, T_g by all;
an item's latency is T_d + (T_v or T_r) + T_g. So a batch whose one verbalization is long costs
its verbalizing rows that long, and nothing here is linear in % retrieval by construction. A batch
during which JAX compiled anything (a shape, or a policy's own program, seen for the first time)
is routed again and the second run kept (`harness.without_compiles`): compilation is not latency.

Accuracy keeps coming from the decode-once harness (exact for greedy decoding); the routed
answers are checked against it (`agreement`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from tqdm.auto import tqdm

from jaxrag.decode.routing import RouteConfig, Routed, route
from jaxrag.eval.harness import Decision, Item, Paths, questions_of, without_compiles
from jaxrag.eval.metrics import score_prediction
from jaxrag.models.model import Model
from jaxrag.models.tokens import WIKI
from jaxrag.policies import Policy
from jaxrag.policies.srrag import Neighbours, srrag_policy

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


def route_items(model: Model, items: Sequence[Item], policy: Policy, retrieve: Callable, cfg: RouteConfig,
                batch_size: int, desc: str) -> list[Routed]:
    """`route()` over items, batch by batch within each dataset (a batch never mixes datasets, so
    per-dataset latency is that dataset's own)."""
    out: list[Routed | None] = [None] * len(items)
    questions = questions_of(items)
    names = [name for name, _ in items]
    batches = []
    for name in dict.fromkeys(names):
        idx = [i for i, n in enumerate(names) if n == name]
        batches += [idx[s:s + batch_size] for s in range(0, len(idx), batch_size)]
    for batch in tqdm(batches, desc=desc, unit="batch", leave=False):
        routed = without_compiles(lambda batch=batch: route(model, [questions[i] for i in batch], policy, retrieve, cfg))
        for i, r in zip(batch, routed):
            out[i] = r
    return out


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


def figure4(model: Model, items: Sequence[Item], score: np.ndarray, neighbours: Neighbours | None,
            retrieve: Callable, cfg: RouteConfig, batch_size: int, points: int) -> list[dict]:
    """Figure 4: SR-RAG routed for real at `points` verbalization proportions from 0 to 1, set by
    thresholds at quantiles of its own score on these questions (an illustration of the
    trade-off, not an operating point)."""
    curve = []
    for frac in np.linspace(0.0, 1.0, points):
        # retrieve iff score > t: t below every score retrieves all, t at the max verbalizes all
        t = float(score.min() - 1.0) if frac == 0 else float(np.quantile(score, 1.0 - frac, method="lower"))
        t = float(score.max()) if frac == 1 else t
        routed = route_items(model, items, srrag_policy(neighbours, t), retrieve, cfg, batch_size,
                             f"figure 4 [{frac:.0%} verbalized]")
        s = summarize(items, routed)
        curve.append({"threshold": t, "verbalized_frac": 1.0 - s["rag_frac"], "rag_frac": s["rag_frac"],
                      "acc": s["acc"], "latency_s": s["latency_s"], "phases": s["phases"]})
    return curve
