"""Stage `export`: the final SR-RAG model (stage 2) in Hugging Face format -> `W/export/`, with
what routing needs beside the weights (`jaxrag.serve`)."""

from __future__ import annotations

import json
from pathlib import Path

from ml_collections import ConfigDict

from jaxrag.models.model import export_hf, load_model
from jaxrag.pipeline.workdir import route_config
from jaxrag.serve import write_serving_files


def export_stage(cfg: ConfigDict, workdir: Path) -> Path:
    """The final SR-RAG model (stage 2) in Hugging Face format, with what routing needs beside
    the weights (`jaxrag.serve`: policy datastore, the tau eval used (`inference.tau` under the
    paper's protocol), k, index)."""
    tau = json.loads((workdir / "results.json").read_text())["config"]["thresholds"]["srrag"]

    def serving_files(out: Path) -> None:
        write_serving_files(out, workdir / "datastore", tau=tau, k=int(cfg.inference.k), route_cfg=route_config(cfg),
                            index_dir=workdir / "index", encoder=cfg.retrieval.encoder,
                            n_passages=int(cfg.retrieval.n_passages))

    return export_hf(load_model(workdir / "stage2" / "model"), workdir / "export", extra=serving_files)
