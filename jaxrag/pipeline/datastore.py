"""Stage `datastore`: the final model's policy datastore (§3.4) -> `W/datastore/`: per training
question, the hidden state at `<EOQ>` (key) and the source under which the model finds the gold
answer more likely (value). The baselines stage builds its ablations' datastores the same way."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from ml_collections import ConfigDict

from jaxrag.runtime import concurrency, multihost, shares
from jaxrag.data.schema import question_key
from jaxrag.decode.source_scores import SOURCES, source_likelihoods
from jaxrag.errors import JaxragError
from jaxrag.models.tokens import SELF, WIKI
from jaxrag.pipeline.workdir import construct_records, load, route_config
from jaxrag.retrieval.datastore import build_datastore
from jaxrag.train.stages import FINAL


def preferred_sources(model, records: list[dict], cfg: ConfigDict, spool: Path) -> tuple[np.ndarray, list[str]]:
    """The policy datastore's keys and values (§3.4): the fine-tuned model reads each training
    question (hidden state of `datastore_layer` at `<EOQ>` = key), verbalizes its own knowledge
    (the Self path, greedy) and is given the question's retrieved passages; the value is the
    source under which it finds the gold answer more likely (ties go to Wiki, as Algorithm 1),
    scored from the cache each path left (`decode.source_scores`). Batches of
    `inference.batch_size` questions, split between the processes (`shares`)."""
    rc, batch = route_config(cfg), int(cfg.inference.batch_size)

    def chunk(start: int) -> tuple[np.ndarray, list[str]]:
        concurrency.check()
        part = records[start:start + batch]
        retrieved = [[c["text"] for c in r["contexts"] if c["source"] == WIKI][: int(cfg.retrieval.n_passages)]
                     for r in part]
        keys, ll = source_likelihoods(model, [r["question"] for r in part], [r["golden_answers"][0] for r in part],
                                      retrieved, rc, rows=batch)
        own, wiki = ll[:, SOURCES.index(SELF)], ll[:, SOURCES.index(WIKI)]
        return keys, [SELF if s > w or not retrieved[i] else WIKI for i, (s, w) in enumerate(zip(own, wiki))]

    done = shares.map_shared(chunk, shares.chunk_starts(len(records), batch), spool, "datastore", "datastore")
    return np.concatenate([k for k, _ in done]), [v for _, values in done for v in values]


def entry_ids(records: list[dict]) -> list[str]:
    """The datastore's question ids: dataset and id (`question_key`), since ids repeat across
    datasets (FlashRAG's `train_0` in every file)."""
    return [question_key(r["dataset"], r["id"]) for r in records]


def build_policy_datastore(cfg: ConfigDict, model_dir: Path, records: list[dict], out: Path) -> Path:
    model = load(cfg, model_dir, inference=True)
    layers = model.decoder.cfg.num_layers
    if not 1 <= int(cfg.model.datastore_layer) <= layers:
        raise JaxragError(f"model.datastore_layer={cfg.model.datastore_layer}: {model_dir} has {layers} layers; "
                          f"choose 1-{layers}")
    spool = out.with_name(f"{out.name}.shares")
    keys, values = preferred_sources(model, records, cfg, spool)
    if multihost.is_leader():
        build_datastore(out, keys, values, entry_ids(records), [r["question"] for r in records],
                        model=str(model_dir), sources=tuple(model.sources), overwrite=True)
        shutil.rmtree(spool, ignore_errors=True)  # every process has read it (`shares.map_shared`)
    return out


def datastore_stage(cfg: ConfigDict, workdir: Path) -> Path:
    return build_policy_datastore(cfg, workdir / "stage2" / FINAL, construct_records(workdir), workdir / "datastore")
