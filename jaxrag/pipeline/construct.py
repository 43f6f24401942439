"""Stage `construct`: Algorithm 1 on the training mixture -> `W/construct/` (record shards, then
`stats.json`, which marks it done). The algorithm is `jaxrag.data.construct`; this stage hands it
the base model, the training questions and the index's retriever."""

from __future__ import annotations

from pathlib import Path

from ml_collections import ConfigDict

from jaxrag.data.construct import construct, construct_done
from jaxrag.pipeline.workdir import dataset_items, load, retriever


def construct_stage(cfg: ConfigDict, workdir: Path) -> Path:
    r = retriever(cfg, workdir)
    return construct(load(cfg, workdir / "base", inference=True), dataset_items(cfg, workdir, cfg.data.train, "train"),
                     r.retrieve_texts, r.encoder, cfg.construct, workdir / "construct", rng_seed=int(cfg.seed),
                     max_length=int(cfg.model.max_length))


def done(workdir: Path) -> bool:
    return construct_done(workdir / "construct")
