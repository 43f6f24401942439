"""Stage `eval`: the twelve methods of docs/method.md on the evaluation sets -> `W/results.json`
(written last: it marks the stage done), `W/report.md` and `W/plots/`, under the paper's protocol.

The methods, their decision rules and the protocol are `jaxrag.eval.methods`; this stage loads
the workdir's models one at a time, decodes their knowledge paths (`jaxrag.eval.harness`), fits
the seeds' selectors on the training questions, and writes the results."""

from __future__ import annotations

import functools
import json
import os
import pickle
import shutil
from pathlib import Path

import jax
import numpy as np
from ml_collections import ConfigDict
from tqdm.auto import tqdm

from jaxrag.data.check import rows_left_out
from jaxrag.data.construct_stats import stats_markdown
from jaxrag.data.mixture import stratified_sample
from jaxrag.eval import harness, latency
from jaxrag.eval.harness import Decision, Paths
from jaxrag.eval.methods import CONSTANT, METHODS, PAPER_VERSION, POST_HOC, Evaluation
from jaxrag.eval.plots import write_report
from jaxrag.eval.selectors import SEAKR_FIT_QUESTIONS, SeedSelectors, knows
from jaxrag.models.tokens import SELF, WIKI
from jaxrag.pipeline import provenance
from jaxrag.pipeline.finetune import training_record
from jaxrag.pipeline.workdir import (construct_records, dataset_items, eval_items, is_embedded, load, retriever,
                                    route_config)
from jaxrag.policies import ccsk as ccsk_mod
from jaxrag.policies import ik as ik_mod
from jaxrag.policies import router_inputs
from jaxrag.policies import seakr as seakr_mod
from jaxrag.policies import srrag as srrag_policies
from jaxrag.retrieval.datastore import PolicyDatastore
from jaxrag.runtime import multihost, shares

# Fine-tuned models in the order they are decoded (one at a time, so a 7B run holds two models:
# this one and the untuned base the seeds' selectors read): (model dir, policy datastore dir).
MODELS = {
    "selective": ("baselines/selective/model", None),
    "srrag": ("stage2/model", "datastore"),
    "no_dpo": ("baselines/no_dpo/model", "baselines/no_dpo_datastore"),
    "no_kv_label": ("baselines/no_kv_label/model", "baselines/no_kv_label_datastore"),
}


def eval_stage(cfg: ConfigDict, workdir: Path) -> Path:
    """On every process: the evaluation's units (`UNITS`) are placed on the processes by their
    cost (`shares.groups`); each process runs its units, a unit's batches shared by the processes
    of its group (`shares.map_shared`, spooled under `W/eval_parts/shares`), and saves each unit's
    state (`save_part`); process 0 merges them in `UNITS` order and writes the results."""
    val, test = eval_items(cfg, workdir)
    use_val = str(cfg.eval.thresholds) == "validation"
    spool = workdir / PARTS / "shares"
    r = retriever(cfg, workdir)
    n_passages = int(cfg.retrieval.n_passages)
    real_retrieve = lambda qs: r.retrieve_texts(qs, n_passages)  # noqa: E731 - latency runs call it for real
    done = finished(workdir)
    multihost.barrier("eval/finished")  # every process has seen which units an interrupted eval finished
    every = lambda fn, chunks, name: shares.map_shared(fn, chunks, spool, name)  # noqa: E731
    cached = harness.RetrievalCache(real_retrieve, harness.questions_of(test + (val if use_val else [])),
                                    int(cfg.inference.batch_size), every)
    me, n_proc = jax.process_index(), jax.process_count()
    base = functools.cache(lambda: load(cfg, workdir / "base", inference=True))  # one untuned model per process
    selectors = functools.cache(lambda: fit_selectors(cfg, workdir, base()))
    unit = Unit(cfg, workdir, test, val, use_val, cached, real_retrieve, base)
    for key, group in zip(UNITS, shares.groups([UNIT_COST[u] for u in UNITS], n_proc)):
        if key in done or me not in group:
            continue
        print(f"  eval: process {me} of {n_proc} runs {key}" + (f" with processes {', '.join(map(str, group))}"
                                                               if len(group) > 1 else ""), flush=True)
        mapper = lambda fn, chunks, name, g=group: shares.map_shared(fn, chunks, spool, name, group=g)  # noqa: E731
        ev = Evaluation(cfg, selectors() if key == "srrag" else None, mapper)
        val_scores = unit.untuned(ev) if key == "untuned" else unit.model(key, ev)
        if me == group[0]:
            save_part(workdir, key, ev, val_scores)
    multihost.barrier("eval/units")  # every unit's part is on disk
    if not multihost.is_leader():
        return workdir / "results.json"
    return write_results(merged(cfg, workdir, test, val), workdir)


class Unit:
    """What each unit decodes and decides, on its own `Evaluation` (its mapper, its state)."""

    def __init__(self, cfg, workdir, test, val, use_val: bool, cached, real_retrieve, base):
        self.cfg, self.workdir, self.test, self.val, self.use_val = cfg, workdir, test, val, use_val
        self.items = test + (val if use_val else [])  # validation questions decoded when they tune thresholds
        self.cached, self.real_retrieve, self.base, self.rc = cached, real_retrieve, base, route_config(cfg)
        self.idx = latency.latency_indices(test, int(cfg.eval.latency_questions))
        self.lat_items = [test[i] for i in self.idx]

    def untuned(self, ev: Evaluation) -> dict:
        """The untuned model: always-RAG and GenRead on its own prompts (constant decisions)."""
        paths = harness.untuned_paths(self.base(), self.test, self.cached, self.rc, ev.bs, ev.mapper)
        for m in (m for m in METHODS if m.model == "untuned"):
            d = ev.decide(m, paths, None, None)[0]
            ev.add(m, paths, d)
            source = WIKI if CONSTANT[m.rule] else SELF
            ev.measured(m, latency.untuned_route_items(self.base(), self.lat_items, source, self.real_retrieve, self.rc,
                                                       ev.bs, f"{m.name} latency", mapper=ev.mapper), paths, d, self.idx)
        return {}

    def model(self, key: str, ev: Evaluation) -> dict:
        """A fine-tuned model of MODELS and its methods -> its routing score on the validation
        questions (Figure 4, matched % retrieval)."""
        model_dir, store = MODELS[key]
        model = load(self.cfg, self.workdir / model_dir, inference=True)
        paths = harness.routed_paths(model, self.items, self.cached, self.rc, ev.bs, f"{key} paths", ev.mapper)
        is_test = np.arange(len(paths.items)) < len(self.test)
        t_paths, v_paths = paths.take(is_test), (paths.take(~is_test) if self.use_val else None)
        nb = None if store is None else srrag_policies.datastore_neighbours(
            PolicyDatastore.load(self.workdir / store), int(self.cfg.inference.k))
        for m in (m for m in METHODS if m.model == key):
            d, policy = ev.decide(m, t_paths, v_paths, nb)
            ev.add(m, t_paths, d)
            ev.measured(m, latency.route_items(model, self.lat_items, policy, self.real_retrieve, self.rc, ev.bs,
                                               f"{m.name} latency", ev.mapper), t_paths, d, self.idx)
        val_scores = {}
        if key in ("srrag", "selective") and self.val:
            inputs = router_inputs(model, harness.questions_of(self.val), self.rc.hidden_layer, ev.bs)
            val_scores[key] = np.asarray(srrag_policies.srrag_policy(nb, 0.0)(inputs).score, np.float64)
        if key == "srrag" and self.val:
            ev.results["figure4"] = figure4_points(self.cfg, model, t_paths, ev, nb, self.real_retrieve, self.idx,
                                                   val_scores["srrag"])
        return val_scores


def merged(cfg: ConfigDict, workdir: Path, test, val) -> dict:
    """results.json's content: every unit's part in `UNITS` order, then what reads several units
    (Selective RAG at SR-RAG's % retrieval, the paired intervals) and the run's record."""
    ev, val_scores, fixed = Evaluation(cfg, None), {}, {}
    for key in UNITS:
        state = pickle.loads((workdir / PARTS / f"{key}.pkl").read_bytes())
        _merge(ev.results, state["results"])
        for name in ("thresholds", "correct", "decisions"):
            getattr(ev, name).update(state[name])
        val_scores.update(state["val_scores"])
        fixed.update(state["fixed_thresholds"])
    if {"srrag", "selective"} <= set(val_scores) and "selective_rag" in ev.decisions:
        ev.results["selective_rag_at_srrag_retrieval"] = matched_retrieval(
            val_scores["srrag"], ev.thresholds["srrag"], val_scores["selective"], *ev.decisions["selective_rag"])
    ev.results["post_hoc"] = dict(POST_HOC)
    ev.intervals(test)
    idx = latency.latency_indices(test, int(cfg.eval.latency_questions))
    train_items = dataset_items(cfg, workdir, cfg.data.train, "train")
    ev.results["config"] = {**cfg.to_dict(), "thresholds": {"protocol": ev.protocol, **ev.thresholds, **fixed},
                            "paper_version": PAPER_VERSION, "n_validation": len(val), "n_test": len(test),
                            "n_latency": len(idx), "data_counts": data_counts(test, val, train_items),
                            "data_left_out": {} if is_embedded(cfg) else rows_left_out(cfg, [*cfg.data.train,
                                                                                         *cfg.data.eval]),
                            "latency_questions": latency_questions(test, idx, ev.bs),
                            "training": training_record(cfg, workdir)}
    ev.results["code"] = code_record(workdir)
    base_metrics = workdir / "base" / "metrics.json"  # the embedded base's probe and gates
    if base_metrics.is_file():
        ev.results["base"] = json.loads(base_metrics.read_text())
    stats_file = workdir / "construct" / "stats.json"
    if stats_file.is_file():
        s = json.loads(stats_file.read_text())
        ev.results["construct"] = {"table": stats_markdown(s), "datasets": s.get("datasets", {})}
    return ev.results


def _merge(into: dict, part: dict) -> None:
    """`part`'s entries into `into`, nested dictionaries merged key by key (units add methods)."""
    for k, v in part.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def code_record(workdir: Path) -> dict:
    """results.json's `code`: the code writing the results (commit, dirty tree, versions) and, per
    stage the results read, the code that built it (`W/inputs/<stage>.json`)."""
    read = (*provenance.STAGES["eval"].upstream, "eval")
    return {**provenance.code_identity(),
            "stages": {s: c for s, c in provenance.stages_code(workdir).items() if s in read}}


# W/eval_parts/<unit>.pkl: each unit's state once it has run (the untuned model, then MODELS),
# so that an interrupted eval runs only the units it had not finished; removed once results.json
# is written. UNIT_COST: each unit's relative cost (its loops' batches and programs; the srrag unit
# also fits the seeds' selectors and decides IK, SeaKR and CCSK), which places the units.
PARTS = "eval_parts"
UNITS = ("untuned", *MODELS)
UNIT_COST = {"untuned": 3, "selective": 3, "srrag": 9, "no_dpo": 1, "no_kv_label": 1}


def save_part(workdir: Path, unit: str, ev: Evaluation, val_scores: dict) -> None:
    parts = workdir / PARTS
    parts.mkdir(exist_ok=True)
    state = {"results": ev.results, "thresholds": ev.thresholds, "correct": ev.correct, "decisions": ev.decisions,
             "val_scores": val_scores, "fixed_thresholds": {} if ev.selectors is None else ev.selectors.fixed_thresholds()}
    tmp = parts / f".{unit}.pkl.tmp"
    tmp.write_bytes(pickle.dumps(state))
    os.replace(tmp, parts / f"{unit}.pkl")


def finished(workdir: Path) -> set[str]:
    """The units an interrupted eval finished (their parts are on disk)."""
    done = {u for u in UNITS if (workdir / PARTS / f"{u}.pkl").is_file()}
    if done:
        print(f"  eval: resuming; finished before: {', '.join(u for u in UNITS if u in done)} ({PARTS}/)", flush=True)
    return done


def fit_selectors(cfg: ConfigDict, workdir: Path, base) -> SeedSelectors:
    """The seeds' selectors (IK, SeaKR, CCSK) fitted on the workdir's training questions, judging
    the untuned `base` model's knowledge (`jaxrag.eval.selectors`)."""
    b, seed = cfg.baselines, int(cfg.seed)
    progress = tqdm(total=4, desc="eval: fitting IK, SeaKR and CCSK", unit="step")
    encoder = retriever(cfg, workdir).encoder
    train_items = dataset_items(cfg, workdir, cfg.data.train, "train")
    train = stratified_sample(train_items, int(b.max_train_questions), seed)
    questions = [ex.prompt_question() for _, ex in train]
    max_new = int(cfg.inference.max_answer_tokens)
    # IK's judge label: does the untuned model answer correctly closed-book?
    answers = ik_mod.closed_book_generations(base, questions, max_new)
    judged = np.array([knows(name, base.tokenizer.decode(a[0], skip_special_tokens=True), ex)
                       for (name, ex), a in zip(train, answers)])
    progress.update()
    ik = None
    if 0 < judged.mean() < 1:
        ik = ik_mod.fit_ik(base, questions, judged, answer_tokens=int(b.ik_answer_tokens))
    else:
        print(f"  ik: the untuned model answers {judged.mean():.0%} of the training questions closed-book; "
              "one judge class, so IK always predicts it", flush=True)
    progress.update()
    # Retrieval-preferred labels of the training questions (the construct stage's kv labels).
    by_id = {(rec["dataset"], rec["id"]): rec["label"] == "wiki" for rec in construct_records(workdir)}
    labelled = [(item, by_id[(item[0], item[1].id)]) for item in train if (item[0], item[1].id) in by_id]
    fit_items = {id(it) for it in stratified_sample([it for it, _ in labelled], SEAKR_FIT_QUESTIONS, seed)}
    fit = [(it, y) for it, y in labelled if id(it) in fit_items]
    u = seakr_mod.seakr_uncertainty(base, [it[1].prompt_question() for it, _ in fit],
                                    samples=int(b.seakr_samples), max_new_tokens=max_new)
    seakr_threshold = seakr_mod.fit_seakr_threshold(u, np.array([y for _, y in fit]))
    progress.update()
    ccsk = ccsk_mod.fit_ccsk(base, encoder, [it[1].prompt_question() for it, _ in labelled],
                             np.array([y for _, y in labelled]), [it[1].golden_answers[0] for it, _ in labelled],
                             max_new_tokens=max_new)
    progress.update()
    progress.close()
    return SeedSelectors(cfg, base, encoder, train_items, train, ik, not judged.any(), seakr_threshold, ccsk)


def figure4_points(cfg, model, test: Paths, ev: Evaluation, neighbours, retrieve, idx, val_score) -> list[dict]:
    """Figure 4 on the latency questions of PubHealth and TriviaQA (the paper's two), or of every
    set when those are absent; thresholds from SR-RAG's score on the validation questions."""
    names = [test.items[i][0] for i in idx]
    chosen = idx[np.isin(names, ["pubhealth", "triviaqa"])] if {"pubhealth", "triviaqa"} & set(names) else idx
    return latency.figure4(model, [test.items[i] for i in chosen], val_score, neighbours, retrieve,
                           route_config(cfg), ev.bs, int(cfg.eval.latency_sweep_points), ev.mapper)


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
    out = workdir / "results.json"
    if not multihost.is_leader():
        return out
    tmp = out.with_name(".results.json.tmp")
    tmp.write_text(json.dumps(results, indent=1, default=float) + "\n")
    write_report(results, workdir)
    os.replace(tmp, out)  # last: results.json marks the stage done
    shutil.rmtree(workdir / PARTS, ignore_errors=True)
    return out
