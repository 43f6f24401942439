"""The `eval` stage: the twelve methods of DESIGN.md §5 on the evaluation sets -> `W/results.json`,
`W/report.md` and `W/plots/`.

Knowledge paths are decoded once per model (`harness`); every method is a decision per question:

    untuned model      no_ft_always_rag (always Wiki), no_ft_genread (always GenRead)
    Selective RAG      selective_always_rag, selective_rag (p_M(<Wiki>) > t)
    SR-RAG (stage 2)   srrag_always_rag, srrag (p_M * p_D > tau), srrag_no_knn (p_M > tau),
                       ik, seakr, ccsk (the seeds' selectors, routing the same model's paths)
    ablations          srrag_no_dpo (stage-1 model + its datastore), srrag_no_kv_label

Every threshold is chosen on the validation questions only (`harness.tune_threshold`); CCSK keeps
its paper's tau grid optimum. IK, SeaKR and CCSK read the untuned model, as their papers do (the
LLM whose knowledge they judge), and are trained on the training questions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from ml_collections import ConfigDict

from jaxrag.eval import harness
from jaxrag.eval.harness import Decision, Paths
from jaxrag.eval.metrics import score_prediction
from jaxrag.pipeline_srrag import (
    FINAL,
    construct_records,
    dataset_items,
    eval_items,
    load,
    retriever,
    route_config,
)
from jaxrag.policies import srrag as srrag_policies
from jaxrag.policies.srrag import datastore_neighbours as neighbours


class Evaluation:
    """Collects each method's test-split numbers into the results.json schema."""

    def __init__(self, n_val: int):
        self.n_val = n_val
        self.results = {"datasets": {}, "average": {}, "source_selection": {}, "curves": {}}

    def split(self, paths: Paths) -> tuple[Paths, Paths]:
        is_val = np.arange(len(paths.items)) < self.n_val
        return paths.take(is_val), paths.take(~is_val)

    def add(self, method: str, test: Paths, d: Decision, table2: bool = True) -> None:
        per, avg = harness.summarize(test, d)
        for name, stats in per.items():
            self.results["datasets"].setdefault(name, {})[method] = stats
        self.results["average"][method] = avg
        if table2:
            self.results["source_selection"][method] = harness.source_selection(test, d)
        print(f"  {method:22s} acc {avg['acc']:.3f}  rag {avg['rag_frac']:.0%}  latency {avg['latency_s']:.3f}s",
              flush=True)

    def thresholded(self, method: str, policy, paths: Paths, batch_size: int) -> float:
        """Scores on all questions, t tuned on validation, decisions on test; returns t."""
        val, test = self.split(paths)
        d_val, d_test = (harness.decide(policy, p, batch_size) for p in (val, test))
        t = harness.tune_threshold(d_val.score, val)
        self.add(method, test, Decision(d_test.score > t, d_test.score, d_test.seconds))
        self.results["curves"][method] = harness.sweep(test, d_test.score, d_test.seconds)
        return t


def eval_stage(cfg: ConfigDict, workdir: Path) -> Path:
    from jaxrag.retrieval.datastore import PolicyDatastore

    val, test = eval_items(cfg, workdir)
    items, bs, rc = val + test, int(cfg.inference.batch_size), route_config(cfg)
    r = retriever(cfg, workdir)
    n_passages = int(cfg.retrieval.n_passages)

    retrieve = harness.RetrievalCache(lambda qs: r.retrieve_texts(qs, n_passages), harness.questions_of(items), bs)

    ev, k, taus = Evaluation(len(val)), int(cfg.inference.k), {}
    base = load(cfg, workdir / "base")

    _, untuned = ev.split(harness.untuned_paths(base, items, retrieve, rc, bs))
    ev.add("no_ft_always_rag", untuned, harness.constant(untuned, True), table2=False)
    ev.add("no_ft_genread", untuned, harness.constant(untuned, False), table2=False)

    selective = harness.routed_paths(load(cfg, workdir / "baselines" / "selective" / FINAL), items, retrieve, rc, bs,
                                     "selective paths")
    selective_test = ev.split(selective)[1]
    ev.add("selective_always_rag", selective_test, harness.constant(selective_test, True), table2=False)
    taus["selective_rag"] = ev.thresholded("selective_rag", srrag_policies.srrag_policy(None, 0.0), selective, bs)

    srrag = harness.routed_paths(load(cfg, workdir / "stage2" / FINAL), items, retrieve, rc, bs, "SR-RAG paths")
    srrag_test = ev.split(srrag)[1]
    ev.add("srrag_always_rag", srrag_test, harness.constant(srrag_test, True), table2=False)
    datastore = PolicyDatastore.load(workdir / "datastore")
    taus["srrag"] = ev.thresholded("srrag", srrag_policies.srrag_policy(neighbours(datastore, k), 0.0), srrag, bs)
    taus["srrag_no_knn"] = ev.thresholded("srrag_no_knn", srrag_policies.srrag_policy(None, 0.0), srrag, bs)
    for method, model_dir, store in (
            ("srrag_no_dpo", workdir / "stage1" / FINAL, workdir / "baselines" / "no_dpo_datastore"),
            ("srrag_no_kv_label", workdir / "baselines" / "no_kv_label" / FINAL,
             workdir / "baselines" / "no_kv_label_datastore")):
        paths = harness.routed_paths(load(cfg, model_dir), items, retrieve, rc, bs, f"{method} paths")
        policy = srrag_policies.srrag_policy(neighbours(PolicyDatastore.load(store), k), 0.0)
        taus[method] = ev.thresholded(method, policy, paths, bs)

    taus.update(seed_methods(cfg, workdir, base, r.encoder, srrag, ev))
    ev.results["config"] = {**cfg.to_dict(), "thresholds": taus, "n_validation": len(val), "n_test": len(test)}
    stats = workdir / "construct" / "stats.json"
    if stats.is_file():
        from jaxrag.data.construct_stats import stats_markdown

        s = json.loads(stats.read_text())
        ev.results["construct"] = {"table": stats_markdown(s), "datasets": s.get("datasets", {})}
    return write_results(ev.results, workdir)


def seed_methods(cfg: ConfigDict, workdir: Path, base, encoder, srrag: Paths, ev: Evaluation) -> dict:
    """IK, SeaKR and CCSK, trained on the training questions, routing SR-RAG's paths."""
    from jaxrag.policies import ccsk, ik, seakr

    b, bs = cfg.baselines, int(cfg.inference.batch_size)
    train = dataset_items(cfg, workdir, cfg.data.train, "train")[: int(b.max_train_questions)]
    questions = [ex.prompt_question() for _, ex in train]
    # IK's judge label: does the untuned model answer correctly closed-book?
    answers = ik.closed_book_generations(base, questions, int(cfg.inference.max_answer_tokens))
    tok = base.tokenizer
    knows = np.array([score_prediction(name, tok.decode(a[0], skip_special_tokens=True), ex) > 0
                      for (name, ex), a in zip(train, answers)])
    taus = {}
    if 0 < knows.mean() < 1:
        clf = ik.fit_ik(base, questions, knows, answer_tokens=int(b.ik_answer_tokens))
        taus["ik"] = ev.thresholded("ik", ik.ik_policy(base, clf, 0.5), srrag, bs)
    else:  # one class: the classifier's answer is that class for every question
        print(f"  ik: the untuned model answers {knows.mean():.0%} of the training questions closed-book; "
              "one judge class, so IK always predicts it", flush=True)
        _, test = ev.split(srrag)
        ev.add("ik", test, harness.constant(test, not knows.any()))
    samples, max_new = int(b.seakr_samples), int(cfg.inference.max_answer_tokens)
    taus["seakr"] = ev.thresholded("seakr", seakr.seakr_policy(base, 0.0, samples=samples, max_new_tokens=max_new),
                                   srrag, bs)
    by_id = {(rec["dataset"], rec["id"]): rec["label"] == "wiki" for rec in construct_records(workdir)}
    labelled = [(q, by_id[(name, ex.id)], ex.golden_answers[0]) for q, (name, ex) in zip(questions, train)
                if (name, ex.id) in by_id]
    fitted = ccsk.fit_ccsk(base, encoder, [q for q, _, _ in labelled], np.array([n for _, n, _ in labelled]),
                           [a for _, _, a in labelled], max_new_tokens=max_new)
    _, test = ev.split(srrag)
    d = harness.decide(ccsk.ccsk_policy(base, encoder, fitted), test, bs)
    ev.add("ccsk", test, d)
    return taus


def write_results(results: dict, workdir: Path) -> Path:
    from jaxrag.eval.report import write_report

    out = workdir / "results.json"
    tmp = out.with_name(".results.json.tmp")
    tmp.write_text(json.dumps(results, indent=1, default=float) + "\n")
    write_report(results, workdir)
    os.replace(tmp, out)  # last: results.json marks the stage done
    return out
