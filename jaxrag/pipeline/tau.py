"""Choosing a model's uniform thresholds on validation data, once, as the paper fixes its
model-specific tau (§4.1): never per run, never on a test set.

    python -m jaxrag.eval.tau W [W ...] [--json OUT]

For each workdir W whose stages up to the baselines are finished (its config is the one they were
built with, `W/config.json`; before the pipeline wrote that file, the one in `W/results.json`), so
that the thresholds are chosen before the first eval (`python -m jaxrag.train ...
--config.pipeline.stop_after=baselines`), decodes the training mixture's validation split
(`eval_items`' validation part, never a test question) along both knowledge paths of the SR-RAG
model and of Selective RAG, and prints, on a grid of thresholds, the validation accuracy and %
retrieval (averages over datasets, as Table 1) of each thresholded rule: SR-RAG (p_M x p_D >
tau), w/o kNN (p_M > tau) and Selective RAG (p(<Wiki>) > selective_tau). Several workdirs (world seeds of one config) are averaged, and the
best grid point of each rule (ties: the larger threshold, i.e. less retrieval) is the constant to
write into the config (`inference.tau`, `inference.selective_tau`).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
from ml_collections import ConfigDict

from jaxrag.errors import JaxragError
from jaxrag.eval import harness
from jaxrag.eval.harness import Decision, summarize
from jaxrag.pipeline.eval import MODELS
from jaxrag.pipeline.run import CONFIG_FILE, stage_done
from jaxrag.pipeline.workdir import eval_items, load, retriever, route_config
from jaxrag.policies import srrag as srrag_policies
from jaxrag.retrieval.datastore import PolicyDatastore

READS = ("stage2", "datastore", "baselines")  # the SR-RAG model, its datastore, Selective RAG's model
GRID = tuple(round(t, 2) for t in np.arange(0.05, 1.0, 0.05))
RULES = {  # rule: (model whose paths it routes, uses the policy datastore)
    "srrag": ("srrag", True),
    "srrag_no_knn": ("srrag", False),
    "selective_rag": ("selective", False),
}


def validation_scores(workdir: Path) -> dict[str, tuple]:
    """rule -> (validation Paths, the rule's score per question) for one finished workdir."""
    cfg = workdir_config(workdir)
    val, _ = eval_items(cfg, workdir)
    if not val:
        raise JaxragError(f"{workdir}: the training mixture has no validation questions")
    bs, rc, r = int(cfg.inference.batch_size), route_config(cfg), retriever(cfg, workdir)
    n = int(cfg.retrieval.n_passages)
    cache = harness.RetrievalCache(lambda qs: r.retrieve_texts(qs, n), harness.questions_of(val), bs)
    out, paths = {}, {}
    for rule, (key, knn) in RULES.items():
        model_dir, store = MODELS[key]
        if key not in paths:
            model = load(cfg, workdir / model_dir, inference=True)
            paths[key] = harness.routed_paths(model, val, cache, rc, bs, f"{key} validation")
        nb = srrag_policies.datastore_neighbours(PolicyDatastore.load(workdir / store), int(cfg.inference.k)) \
            if knn else None
        out[rule] = (paths[key], harness.decide(srrag_policies.srrag_policy(nb, 0.0), paths[key], bs).score)
    return out


def workdir_config(workdir: Path) -> ConfigDict:
    """The config W's models were built with, once the stages this tool reads are finished."""
    config, results = workdir / CONFIG_FILE, workdir / "results.json"
    if config.is_file():
        cfg = ConfigDict(json.loads(config.read_text(encoding="utf-8")))
    elif results.is_file():
        cfg = ConfigDict(json.loads(results.read_text(encoding="utf-8"))["config"])
    else:
        raise JaxragError(f"{workdir}: neither {CONFIG_FILE} nor results.json (not a pipeline workdir?)")
    for name in READS:
        if not stage_done(name, workdir):
            raise JaxragError(f"{workdir}: stage {name} is not finished; run `python -m jaxrag.train --config ... "
                              f"--workdir {workdir} --config.pipeline.stop_after=baselines` first")
    return cfg


def curves(per_workdir: list[dict[str, tuple]]) -> dict[str, list[dict]]:
    """rule -> [{threshold, acc, rag_frac}] on GRID, averaged over workdirs."""
    out = {}
    for rule in RULES:
        points = []
        for t in GRID:
            avgs = [summarize(paths, Decision(score > t, score))[1] for paths, score in (w[rule] for w in per_workdir)]
            points.append({"threshold": t, "acc": float(np.mean([a["acc"] for a in avgs])),
                           "rag_frac": float(np.mean([a["rag_frac"] for a in avgs]))})
        out[rule] = points
    return out


def best(points: list[dict]) -> dict:
    top = max(p["acc"] for p in points)
    return max((p for p in points if p["acc"] >= top - 1e-12), key=lambda p: p["threshold"])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m jaxrag.eval.tau", description=__doc__.split("\n")[0])
    parser.add_argument("workdirs", nargs="+", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    per = [validation_scores(w) for w in args.workdirs]
    c = curves(per)
    result = {"workdirs": [str(w) for w in args.workdirs], "validation_questions": [len(w["srrag"][0].items) for w in per],
              "curves": c, "best": {rule: best(points) for rule, points in c.items()}}
    print(f"validation accuracy / % retrieval, averaged over {len(per)} workdir(s):")
    print("tau   " + "  ".join(f"{rule:>20s}" for rule in RULES))
    for i, t in enumerate(GRID):
        print(f"{t:.2f}  " + "  ".join(f"{c[r][i]['acc']:>13.3f} / {c[r][i]['rag_frac']:>4.0%}" for r in RULES))
    for rule, p in result["best"].items():
        print(f"best {rule}: {p['threshold']:.2f} (validation acc {p['acc']:.3f} at {p['rag_frac']:.0%} retrieval)")
    if args.json:
        tmp = args.json.with_name(f".{args.json.name}.tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, args.json)
    return result

