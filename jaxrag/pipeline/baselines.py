"""Stage `baselines`: the fine-tuned baselines and ablations -> `W/baselines/` (`done.json` last).

    selective/            Selective RAG (sources {none, wiki}; stage 1, then stage 2's data, steps,
                          lr and schedule on its own stage-1 loss)
    no_kv_label/          w/o kv label: stages 1 and 2 on no-context labels, and its datastore
    no_dpo/               w/o DPO: stage 2 run with the stage-1 loss, and its datastore
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
from ml_collections import ConfigDict

from jaxrag.runtime import multihost
from jaxrag.models.model import add_special_tokens
from jaxrag.models.tokens import NONE, WIKI
from jaxrag.pipeline import lanes
from jaxrag.pipeline.datastore import build_policy_datastore
from jaxrag.pipeline.workdir import construct_records, load
from jaxrag.train.stages import FINAL, train_stage1, train_stage2, train_stage2_no_dpo


def relabel(records: list[dict], field: str) -> list[dict]:
    """Records with `label` replaced by an alternative labelling from the construct stage:
    `no_kv_label` (the w/o kv label ablation) or `selective_label` (Selective RAG: the Self
    contexts are dropped and `none` has no knowledge)."""
    out = []
    for rec in records:
        rec = {**rec, "label": rec[field]}
        if field == "selective_label":
            wiki = [c for c in rec["contexts"] if c["source"] == WIKI]
            lls = [c["loglik"] for c in wiki]
            rec["contexts"] = wiki
            rec["best"] = {WIKI: int(np.argmax(lls))} if wiki else {}
            rec["worst"] = {WIKI: int(np.argmin(lls))} if wiki else {}
        if rec["label"] != NONE and rec["label"] not in rec["best"]:
            # Nothing to train on: a Wiki label without a retrieved passage, or a no-kv <Self>
            # label (from the no-context likelihood) of a question whose verbalizations all came
            # out empty (both counted by the construct stage: no retrieval / empty verb.).
            continue
        out.append(rec)
    return out


def baselines_stage(cfg: ConfigDict, workdir: Path) -> Path:
    """Selective RAG (sources {wiki, none}, retrieval-vs-nothing labels): stage 1, then a second
    stage as SR-RAG gets one, with stage 2's data (its own records again), epochs, learning rate
    and schedule on its own objective, the stage-1 loss (as the paper's "w/o DPO" keeps it: it
    has no verbalization for DPO to act on), so SR-RAG − Selective RAG is not extra answer
    training. The w/o kv label model (stages 1 and 2 on no-context labels) and its datastore; the
    w/o DPO model (stage 2 run with the stage-1 loss, as the paper ablates it) and its datastore.
    Each piece resumes on its own; `done.json` is written last."""
    out, records = workdir / "baselines", construct_records(workdir)
    base = workdir / "base"

    def selective():
        sel = relabel(records, "selective_label")
        train_stage1(add_special_tokens(load(cfg, base), (WIKI, NONE)), sel, cfg, out / "selective_stage1")
        train_stage2_no_dpo(load(cfg, out / "selective_stage1" / FINAL), sel, cfg, out / "selective")

    def with_datastore(name: str, train) -> Callable[[], None]:
        def piece():
            train()
            if not (out / f"{name}_datastore").is_dir():  # every process its share; process 0 writes it
                build_policy_datastore(cfg, out / name / FINAL, records, out / f"{name}_datastore")
            # the next piece's training starts together: a process arriving at a new collective
            # waits at most 30 s for the others (gloo's rendezvous)
            multihost.barrier(f"baselines:{name}")
        return piece

    def no_kv_label():
        no_kv = relabel(records, "no_kv_label")
        train_stage1(load(cfg, base), no_kv, cfg, out / "no_kv_label_stage1")
        ref = load(cfg, out / "no_kv_label_stage1" / FINAL)
        train_stage2(load(cfg, out / "no_kv_label_stage1" / FINAL), ref, no_kv, cfg, out / "no_kv_label")

    def no_dpo():
        train_stage2_no_dpo(load(cfg, workdir / "stage1" / FINAL), records, cfg, out / "no_dpo")

    # Independent of each other: side by side when pipeline.workers > 1 (longest first).
    lanes.run_graph({"no_kv_label": (with_datastore("no_kv_label", no_kv_label), ()),
                     "no_dpo": (with_datastore("no_dpo", no_dpo), ()), "selective": (selective, ())},
                    int(cfg.pipeline.workers))
    if multihost.is_leader():
        tmp = out / "done.json.tmp"
        tmp.write_text(json.dumps({"selective": "selective", "no_kv_label": "no_kv_label", "no_dpo": "no_dpo"}) + "\n")
        os.replace(tmp, out / "done.json")
    return out


def baselines_done(workdir: Path) -> bool:
    return (workdir / "baselines" / "done.json").is_file()
