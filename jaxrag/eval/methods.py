"""The `eval` stage: the twelve methods of docs/method.md on the evaluation sets -> `W/results.json`,
`W/report.md` and `W/plots/`, under the paper's protocol.

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
import json
import os
from pathlib import Path

import numpy as np
from ml_collections import ConfigDict

from jaxrag.errors import JaxragError
from jaxrag.eval import harness, latency, stats
from jaxrag.eval.harness import Decision, Paths
from jaxrag.eval.selectors import SeedSelectors
from jaxrag.models.tokens import SELF, WIKI
from jaxrag.pipeline_srrag import eval_items, load, retriever, route_config, training_record
from jaxrag.policies import always, router_inputs
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
# Fine-tuned models in the order they are decoded (one at a time, so a 7B run holds two models:
# this one and the untuned base the seeds' selectors read): (model dir, policy datastore dir).
MODELS = {
    "selective": ("baselines/selective/model", None),
    "srrag": ("stage2/model", "datastore"),
    "no_dpo": ("baselines/no_dpo/model", "baselines/no_dpo_datastore"),
    "no_kv_label": ("baselines/no_kv_label/model", "baselines/no_kv_label_datastore"),
}
CONSTANT = {"always_rag": True, "genread": False}
# The paper's claims: SR-RAG against each of these (paired differences of average accuracy).
COMPARED = ("selective_rag", "srrag_always_rag", "srrag_no_knn", "srrag_no_kv_label", "srrag_no_dpo",
            "ik", "seakr", "ccsk")
# Table 2's kNN claim: the same model's two paths, so both AUROCs rank the same labels. SR-RAG
# against Selective RAG is not compared: their positives differ ("retrieval beats verbalizing" vs
# "retrieval beats no knowledge"), so the difference of AUROCs would not be one quantity.
AUROC_COMPARED = ("srrag_no_knn",)
POST_HOC = {"curves": "threshold sweeps on the test split itself (post hoc; for plots only)"}
PROTOCOLS = ("paper", "validation")


class Evaluation:
    """Runs every method's decisions and collects the results.json schema."""

    def __init__(self, cfg: ConfigDict, selectors: SeedSelectors):
        self.cfg, self.selectors = cfg, selectors
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
            return harness.decide(policy, test, self.bs), policy
        make = self.score_policy(m.rule, neighbours)
        if self.protocol == "paper":
            t = self.paper_threshold(m.rule)
        else:
            t = harness.tune_threshold(harness.decide(make(0.0), val, self.bs).score, val)
        self.thresholds[m.name] = t
        d = harness.decide(make(t), test, self.bs)
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


def eval_stage(cfg: ConfigDict, workdir: Path) -> Path:
    from jaxrag.retrieval.datastore import PolicyDatastore

    val, test = eval_items(cfg, workdir)
    ev = Evaluation(cfg, SeedSelectors.fit(cfg, workdir))
    use_val = ev.protocol == "validation"
    items, bs, rc = test + (val if use_val else []), ev.bs, route_config(cfg)
    r = retriever(cfg, workdir)
    n_passages = int(cfg.retrieval.n_passages)
    real_retrieve = lambda qs: r.retrieve_texts(qs, n_passages)  # noqa: E731 - latency runs call it for real
    cached = harness.RetrievalCache(real_retrieve, harness.questions_of(items), bs)
    idx = latency.latency_indices(test, int(cfg.eval.latency_questions))
    n_test = len(test)

    def split(paths: Paths) -> tuple[Paths, Paths | None]:
        is_test = np.arange(len(paths.items)) < n_test
        return paths.take(is_test), (paths.take(~is_test) if use_val else None)

    lat_items = [test[i] for i in idx]
    # The untuned model: always-RAG and GenRead on its own prompts (constant decisions).
    untuned = harness.untuned_paths(ev.selectors.base, test, cached, rc, bs)
    for m in (m for m in METHODS if m.model == "untuned"):
        d = ev.decide(m, untuned, None, None)[0]
        ev.add(m, untuned, d)
        source = WIKI if CONSTANT[m.rule] else SELF
        ev.measured(m, latency.untuned_route_items(ev.selectors.base, lat_items, source, real_retrieve, rc, bs,
                                                   f"{m.name} latency"), untuned, d, idx)
    val_scores = {}  # model -> its routing score on the validation questions (Figure 4, matched % retrieval)
    for key, (model_dir, store) in MODELS.items():
        model = load(cfg, workdir / model_dir, inference=True)
        t_paths, v_paths = split(harness.routed_paths(model, items, cached, rc, bs, f"{key} paths"))
        nb = None if store is None else srrag_policies.datastore_neighbours(
            PolicyDatastore.load(workdir / store), int(cfg.inference.k))
        for m in (m for m in METHODS if m.model == key):
            d, policy = ev.decide(m, t_paths, v_paths, nb)
            ev.add(m, t_paths, d)
            ev.measured(m, latency.route_items(model, lat_items, policy, real_retrieve, rc, bs, f"{m.name} latency"),
                        t_paths, d, idx)
        if key in ("srrag", "selective") and val:
            inputs = router_inputs(model, harness.questions_of(val), rc.hidden_layer, bs)
            val_scores[key] = np.asarray(srrag_policies.srrag_policy(nb, 0.0)(inputs).score, np.float64)
        if key == "srrag" and val:
            ev.results["figure4"] = figure4_points(cfg, model, t_paths, ev, nb, real_retrieve, idx, val_scores["srrag"])
        del model
    if {"srrag", "selective"} <= set(val_scores) and "selective_rag" in ev.decisions:
        ev.results["selective_rag_at_srrag_retrieval"] = matched_retrieval(
            val_scores["srrag"], ev.thresholds["srrag"], val_scores["selective"], *ev.decisions["selective_rag"])
    ev.results["post_hoc"] = dict(POST_HOC)
    ev.intervals(test)
    ev.results["config"] = {**cfg.to_dict(), "thresholds": {"protocol": ev.protocol, **ev.thresholds,
                                                            **ev.selectors.fixed_thresholds()},
                            "paper_version": PAPER_VERSION, "n_validation": len(val), "n_test": n_test,
                            "n_latency": len(idx), "data_counts": data_counts(test, val, ev.selectors.train_items),
                            "latency_questions": latency_questions(test, idx, bs),
                            "training": training_record(cfg, workdir)}
    stats_file = workdir / "construct" / "stats.json"
    if stats_file.is_file():
        from jaxrag.data.construct_stats import stats_markdown

        s = json.loads(stats_file.read_text())
        ev.results["construct"] = {"table": stats_markdown(s), "datasets": s.get("datasets", {})}
    return write_results(ev.results, workdir)


def figure4_points(cfg, model, test: Paths, ev: Evaluation, neighbours, retrieve, idx, val_score) -> list[dict]:
    """Figure 4 on the latency questions of PubHealth and TriviaQA (the paper's two), or of every
    set when those are absent; thresholds from SR-RAG's score on the validation questions."""
    names = [test.items[i][0] for i in idx]
    chosen = idx[np.isin(names, ["pubhealth", "triviaqa"])] if {"pubhealth", "triviaqa"} & set(names) else idx
    return latency.figure4(model, [test.items[i] for i in chosen], val_score, neighbours, retrieve,
                           route_config(cfg), ev.bs, int(cfg.eval.latency_sweep_points))


def matched_retrieval(srrag_val: np.ndarray, srrag_t: float, selective_val: np.ndarray, test: Paths,
                      d: Decision) -> dict:
    """Selective RAG at SR-RAG's % retrieval, chosen on validation: the threshold at which
    Selective RAG retrieves for the same share of the validation questions as SR-RAG at its own
    threshold, then applied to Selective RAG's test scores."""
    share = float(np.mean(srrag_val > srrag_t))
    t = latency.figure4_threshold(selective_val, 1.0 - share)
    avg = harness.summarize(test, Decision(d.score > t, d.score, d.seconds))[1]
    return {"threshold": t, "srrag_rag_frac_validation": share,
            "rag_frac_validation": float(np.mean(selective_val > t)), "chosen_on": "validation",
            "acc": avg["acc"], "rag_frac": avg["rag_frac"]}


def latency_questions(test, idx: np.ndarray, batch_size: int) -> str:
    """Which questions every method's latency is measured on, in words (for the report)."""
    counts = data_counts([test[i] for i in idx], [], [])
    sets = ", ".join(f"{n} {c['test']}" for n, c in counts.items())
    return (f"the first questions of each test set ({sets}; {len(idx)} in all), routed in batches of "
            f"{batch_size} within a set, the same batches for every method")


def data_counts(test, val, train) -> dict[str, dict[str, int]]:
    """Questions used per dataset and split (the paper's Table 5 counts on real data)."""
    counts: dict[str, dict[str, int]] = {}
    for split, items in (("train", train), ("validation", val), ("test", test)):
        for name, _ in items:
            counts.setdefault(name, {}).setdefault(split, 0)
            counts[name][split] += 1
    return counts


def write_results(results: dict, workdir: Path) -> Path:
    from jaxrag.eval.report import write_report

    out = workdir / "results.json"
    tmp = out.with_name(".results.json.tmp")
    tmp.write_text(json.dumps(results, indent=1, default=float) + "\n")
    write_report(results, workdir)
    os.replace(tmp, out)  # last: results.json marks the stage done
    return out
