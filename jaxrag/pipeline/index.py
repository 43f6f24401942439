"""Stage `index`: the corpus encoded into the passage index -> `W/index/` (renamed into place
when whole); on the embedded world with each evaluation set's gold-passage recall beside it."""

from __future__ import annotations

import json
from pathlib import Path

from ml_collections import ConfigDict

from jaxrag.errors import JaxragError
from jaxrag.pipeline.workdir import dataset_items, is_embedded
from jaxrag.retrieval.retriever import Retriever, build_corpus_index


def index_stage(cfg: ConfigDict, workdir: Path) -> Path:
    """Encode the corpus and build the passage index; on the embedded world also measure
    recall@n of the gold passage per evaluation set (written beside the index)."""
    corpus = workdir / "world" / "corpus.jsonl" if is_embedded(cfg) else Path(cfg.retrieval.corpus)
    if not corpus.is_file():
        raise JaxragError(f"{corpus}: corpus not found (set --config.retrieval.corpus=/path/psgs_w100.tsv)")
    building, out = workdir / "index.building", workdir / "index"
    build_corpus_index(corpus, building, encoder=cfg.retrieval.encoder,
                       passage_embeddings=cfg.retrieval.passage_embeddings or None, overwrite=True)
    if is_embedded(cfg):
        recall = gold_passage_recall(cfg, workdir, building)
        (building / "retrieval_metrics.json").write_text(json.dumps(recall, indent=1) + "\n")
        print("  gold-passage recall:", json.dumps(recall))
    building.rename(out)
    return out


def gold_passage_recall(cfg: ConfigDict, workdir: Path, index_dir: Path) -> dict[str, float]:
    """recall@k of each evaluation question's gold passage (embedded world), for k = 5 and the
    number of passages the model reads (`retrieval.n_passages`)."""
    retriever = Retriever.load(index_dir, cfg.retrieval.encoder)
    ks, recall = sorted({5, int(cfg.retrieval.n_passages)}), {}
    for name in cfg.data.eval:
        examples = [e for _, e in dataset_items(cfg, workdir, [name], "test") if e.metadata.get("gold_passage_id")]
        if examples:
            hits = retriever.search([e.question for e in examples], max(ks))
            for k in ks:
                found = [e.metadata["gold_passage_id"] in {h.passage.id for h in hs[:k]} for e, hs in zip(examples, hits)]
                recall[f"{name}@{k}"] = sum(found) / len(found)
    return recall
