"""The twelve methods of docs/method.md and the paper's protocol, for the `eval` stage
(`jaxrag.pipeline.eval`, which writes `W/results.json`, `W/report.md` and `W/plots/`).

Methods are data (`METHODS`: name -> whose knowledge paths, which decision rule); one loop runs
them. Knowledge paths are decoded once per model (`harness`); a method is a decision per question.

Thresholds (`eval.thresholds`):
  paper (default)  SR-RAG and its ablations: `inference.tau` on p_M(<Wiki>) * p_D(<Wiki>) (w/o
                   kNN: on p_M alone); Selective RAG: `inference.selective_tau` on p(<Wiki>) after
                   <EOQ>; IK: retrieve iff P(know) < 0.5; SeaKR: its threshold searched on
                   training questions, as its paper does; CCSK: its paper's published taus.
                   Uniform constants, no dataset-specific or test-set tuning.
  validation       opt-in variant: every threshold but CCSK's tuned for accuracy on the training
                   mixture's validation split (never a test question); reported under its name.
IK, SeaKR and CCSK judge the untuned model's knowledge (as their papers) and route the SR-RAG
model's paths, so only the selection differs. Accuracy comes from the harness; latency from real
routed batches (`latency`); every average carries a bootstrap interval and the paper's claimed
differences a paired one (`stats`). Latency: every method, the untuned and constant ones included,
timed in the same routed batches on the same test questions (`latency`).

Chosen on validation, never on test: Figure 4's thresholds (quantiles of SR-RAG's score on the
validation questions) and `selective_rag_at_srrag_retrieval` (Selective RAG's threshold at which
its validation % retrieval matches SR-RAG's). The threshold sweeps in `curves` are on the test
split and labelled post hoc (`post_hoc`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from ml_collections import ConfigDict

from jaxrag.errors import JaxragError
from jaxrag.eval import harness, latency, stats
from jaxrag.eval.harness import Decision, Paths
from jaxrag.eval.selectors import SeedSelectors
from jaxrag.models.tokens import WIKI
from jaxrag.policies import always
from jaxrag.policies import srrag as srrag_policies

PAPER_VERSION = ("SR-RAG: Binding Selective Retrieval with Knowledge Verbalization (arXiv 2504.01018, revised "
                 "text: +7.9/2.1/4.7% over Selective RAG with 26/40/21% fewer retrievals for Llama-2 / Phi-3.5 / Qwen2.5)")


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    model: str  # whose knowledge paths: untuned | selective | srrag | no_dpo | no_kv_label
    rule: str  # always_rag | genread | tau | tau_no_knn | selective_tau | ik | seakr | ccsk


METHODS = (
    Method("no_ft_always_rag", "untuned", "always_rag"),
    Method("no_ft_genread", "untuned", "genread"),
    Method("selective_always_rag", "selective", "always_rag"),
    Method("selective_rag", "selective", "selective_tau"),
    Method("srrag_always_rag", "srrag", "always_rag"),
    Method("srrag", "srrag", "tau"),
    Method("srrag_no_knn", "srrag", "tau_no_knn"),
    Method("ik", "srrag", "ik"),
    Method("seakr", "srrag", "seakr"),
    Method("ccsk", "srrag", "ccsk"),
    Method("srrag_no_dpo", "no_dpo", "tau"),
    Method("srrag_no_kv_label", "no_kv_label", "tau"),
)
CONSTANT = {"always_rag": True, "genread": False}
# The paper's claims: SR-RAG against each of these (paired differences of average accuracy), and
# against the untuned model's always-RAG and GenRead (what fine-tuning bought at all).
COMPARED = ("selective_rag", "srrag_always_rag", "srrag_no_knn", "srrag_no_kv_label", "srrag_no_dpo",
            "ik", "seakr", "ccsk", "no_ft_always_rag", "no_ft_genread")
# Table 2's kNN claim: the same model's two paths, so both AUROCs rank the same labels. SR-RAG
# against Selective RAG is not compared: their positives differ ("retrieval beats verbalizing" vs
# "retrieval beats no knowledge"), so the difference of AUROCs would not be one quantity.
AUROC_COMPARED = ("srrag_no_knn",)
POST_HOC = {"curves": "threshold sweeps on the test split itself (post hoc; for plots only)"}
PROTOCOLS = ("paper", "validation")


class Evaluation:
    """Runs every method's decisions and collects the results.json schema."""

    def __init__(self, cfg: ConfigDict, selectors: SeedSelectors | None, mapper: harness.Mapper | None = None):
        self.cfg, self.selectors, self.mapper = cfg, selectors, mapper  # mapper: how batches are mapped (harness)
        self.protocol = str(cfg.eval.thresholds)
        if self.protocol not in PROTOCOLS:
            raise JaxragError(f"--config.eval.thresholds={self.protocol!r}: choose one of {', '.join(PROTOCOLS)}")
        self.bs = int(cfg.inference.batch_size)
        self.results = {"datasets": {}, "average": {}, "source_selection": {}, "curves": {}, "latency": {}}
        self.thresholds: dict[str, float] = {}
        self.correct: dict[str, np.ndarray] = {}
        self.decisions: dict[str, tuple[Paths, Decision]] = {}

    def score_policy(self, rule: str, neighbours):
        """threshold t -> a Policy retrieving iff its score > t (the rules with a threshold)."""
        if rule == "tau":
            return lambda t: srrag_policies.srrag_policy(neighbours, t)
        if rule in ("tau_no_knn", "selective_tau"):
            return lambda t: srrag_policies.srrag_policy(None, t)
        return self.selectors.score_policy(rule)

    def paper_threshold(self, rule: str) -> float:
        inf = self.cfg.inference
        if rule in ("tau", "tau_no_knn"):
            return float(inf.tau)
        if rule == "selective_tau":
            return float(inf.selective_tau)
        return self.selectors.paper_threshold(rule)

    def decide(self, m: Method, test: Paths, val: Paths | None, neighbours):
        """(decision on test, the policy that routes it for real)."""
        if m.rule in CONSTANT:
            source = WIKI if CONSTANT[m.rule] else test.other
            return harness.constant(test, CONSTANT[m.rule]), always(source)
        if m.rule == "ccsk":
            policy = self.selectors.ccsk_policy()
            return harness.decide(policy, test, self.bs, self.mapper, f"{m.name} decisions"), policy
        make = self.score_policy(m.rule, neighbours)
        if self.protocol == "paper":
            t = self.paper_threshold(m.rule)
        else:
            t = harness.tune_threshold(harness.decide(make(0.0), val, self.bs, self.mapper,
                                                      f"{m.name} validation decisions").score, val)
        self.thresholds[m.name] = t
        d = harness.decide(make(t), test, self.bs, self.mapper, f"{m.name} decisions")
        return Decision(d.score > t, d.score, d.seconds), make(t)

    def add(self, m: Method, test: Paths, d: Decision) -> None:
        per, avg = harness.summarize(test, d)
        for name, s in per.items():
            self.results["datasets"].setdefault(name, {})[m.name] = s
        self.results["average"][m.name] = avg
        self.correct[m.name] = np.where(d.retrieve, test.correct[WIKI], test.correct[test.other])
        self.decisions[m.name] = (test, d)
        if kinds := harness.by_kind(test, d):
            self.results.setdefault("by_kind", {})[m.name] = kinds
        if d.score is not None:
            self.results["source_selection"][m.name] = harness.source_selection(test, d)
            self.results["curves"][m.name] = harness.sweep(test, d.score, d.seconds)

    def measured(self, m: Method, routed, test: Paths, d: Decision, idx: np.ndarray) -> None:
        """Latency from real routed batches on the latency questions (`latency`), every method."""
        items = [test.items[i] for i in idx]
        s = {**latency.summarize(items, routed), **latency.agreement(routed, idx, test, d)}
        self.results["latency"][m.name] = s
        self.results["average"][m.name]["latency_s"] = s["latency_s"]
        for name, e in s["per_dataset"].items():
            self.results["datasets"][name][m.name]["latency_s"] = e["latency_s"]
        print(f"  {m.name:22s} acc {self.results['average'][m.name]['acc']:.3f}  "
              f"rag {self.results['average'][m.name]['rag_frac']:.0%}  latency {s['latency_s']:.4f}s (measured)",
              flush=True)

    def intervals(self, test_items) -> None:
        """95% bootstrap intervals: each average, and SR-RAG's paired differences."""
        boot = stats.StratifiedBootstrap([n for n, _ in test_items], int(self.cfg.eval.bootstrap_samples),
                                         int(self.cfg.seed))
        for m, c in self.correct.items():
            self.results["average"][m]["acc_ci95"] = stats.interval(boot.average(c))
        comp = {f"srrag - {m}": stats.paired_difference(boot, self.correct["srrag"], self.correct[m])
                for m in COMPARED if m in self.correct and "srrag" in self.correct}
        self.results["comparisons"] = comp
        self.results["source_selection_comparisons"] = {
            f"srrag - {m}": stats.paired_auroc_difference(boot, *self.decisions["srrag"], *self.decisions[m])
            for m in AUROC_COMPARED if m in self.decisions and "srrag" in self.decisions}
