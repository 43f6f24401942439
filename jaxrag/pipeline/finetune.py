"""Stages `stage1` and `stage2`: SR-RAG's two fine-tuning stages on the construct stage's records.

    stage1/model   SR-RAG stage 1 (Eq. 1-4) from the base model
    stage2/model   SR-RAG stage 2 (Eq. 5-6, DPO), reference = stage 1

`TRAINING` records how each fine-tuned model (these and the baselines') was trained, for the
eval stage's `config.training`."""

from __future__ import annotations

import json
from pathlib import Path

from ml_collections import ConfigDict

from jaxrag.pipeline.workdir import construct_records, load
from jaxrag.train.stages import FINAL, train_stage1, train_stage2


def stage1_stage(cfg: ConfigDict, workdir: Path) -> Path:
    train_stage1(load(cfg, workdir / "base"), construct_records(workdir), cfg, workdir / "stage1")
    return workdir / "stage1"


def stage2_stage(cfg: ConfigDict, workdir: Path) -> Path:
    ref = load(cfg, workdir / "stage1" / FINAL)
    train_stage2(load(cfg, workdir / "stage1" / FINAL), ref, construct_records(workdir), cfg, workdir / "stage2")
    return workdir / "stage2"


# Each fine-tuned model's training as run: (eval method, [(stage dir, config section, objective)]).
TRAINING = {
    "srrag": [("stage1", "stage1", "stage1_loss"), ("stage2", "stage2", "stage2_loss")],
    "selective_rag": [("baselines/selective_stage1", "stage1", "stage1_loss"),
                      ("baselines/selective", "stage2", "stage1_loss")],
    "srrag_no_kv_label": [("baselines/no_kv_label_stage1", "stage1", "stage1_loss"),
                          ("baselines/no_kv_label", "stage2", "stage2_loss")],
    "srrag_no_dpo": [("stage1", "stage1", "stage1_loss"), ("baselines/no_dpo", "stage2", "stage1_loss")],
}


def steps_run(stage_dir: Path, section: str) -> int | None:
    """The last optimizer step the stage logged under its config section's name (`metrics.jsonl`
    logs the final step always); None when it has no such log (not trained here, or a workdir
    whose directory holds another stage's run)."""
    log = stage_dir / "metrics.jsonl"
    if not log.is_file():
        return None
    records = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line.strip()]
    steps = [r["step"] for r in records if r.get("task") == section]
    return max(steps) if steps else None


def training_record(cfg: ConfigDict, workdir: Path) -> dict:
    """`config.training`: per fine-tuned model, its stages as run:
    `{"stages": [{"name", "objective", "epochs", "steps", "lr"}, ...]}`."""
    return {model: {"stages": [{"name": section, "objective": objective, "epochs": int(cfg[section].epochs),
                                "steps": steps_run(workdir / stage_dir, section), "lr": float(cfg[section].lr)}
                               for stage_dir, section, objective in stages]}
            for model, stages in TRAINING.items()}
