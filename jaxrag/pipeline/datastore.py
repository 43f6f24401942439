"""Stage `datastore`: the final model's policy datastore (§3.4) -> `W/datastore/`: per training
question, the hidden state at `<EOQ>` (key) and the source under which the model finds the gold
answer more likely (value). The baselines stage builds its ablations' datastores the same way."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from ml_collections import ConfigDict

from jaxrag.runtime import concurrency
from jaxrag.data.schema import question_key
from jaxrag.decode.routing import route
from jaxrag.decode.scoring import score
from jaxrag.errors import JaxragError
from jaxrag.models.tokens import SELF, WIKI, source_token
from jaxrag.pipeline.workdir import construct_records, load, route_config
from jaxrag.policies import always
from jaxrag.prompts import answer_ids, answer_prefix_ids, knowledge_ids, prompt_ids
from jaxrag.retrieval.datastore import build_datastore
from jaxrag.train.stages import FINAL


def preferred_sources(model, records: list[dict], cfg: ConfigDict) -> tuple[np.ndarray, list[str]]:
    """The policy datastore's keys and values (§3.4): the fine-tuned model reads each training
    question (hidden state of `datastore_layer` at `<EOQ>` = key), verbalizes its own knowledge
    (the Self path, greedy) and is given the question's retrieved passages; the value is the
    source under which it finds the gold answer more likely (ties go to Wiki, as Algorithm 1)."""
    tok, rc = model.tokenizer, route_config(cfg)
    questions = [r["question"] for r in records]
    retrieved = [[c["text"] for c in r["contexts"] if c["source"] == WIKI][: int(cfg.retrieval.n_passages)]
                 for r in records]
    keys, verbal = [], []
    batch = int(cfg.inference.batch_size)
    for start in range(0, len(records), batch):
        concurrency.check()
        seen = []

        def forced(inputs, seen=seen):
            seen.append(inputs.hidden)
            return always(SELF)(inputs)

        routed = route(model, questions[start:start + batch], forced, lambda qs: [[""]] * len(qs), rc, rows=batch)
        keys.append(seen[0])
        verbal += [r.knowledge for r in routed]
    tail = answer_prefix_ids(tok)
    prompts = prompt_ids(tok, questions)
    prefixes, targets = [], []
    for i, rec in enumerate(records):
        answer = answer_ids(tok, [rec["golden_answers"][0]])[0]
        for source, passages in ((SELF, [verbal[i]]), (WIKI, retrieved[i])):
            know = knowledge_ids(tok, [passages])[0][: rc.max_knowledge_tokens]
            prefixes.append(prompts[i] + [model.token_id(source_token(source))] + know + tail)
            targets.append(answer)
    ll = np.asarray(score(model.decoder, prefixes, targets, batch_size=batch).total).reshape(-1, 2)
    values = [SELF if s > w or not retrieved[i] else WIKI for i, (s, w) in enumerate(ll)]
    return np.concatenate(keys), values


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
    keys, values = preferred_sources(model, records, cfg)
    build_datastore(out, keys, values, entry_ids(records), [r["question"] for r in records],
                    model=str(model_dir), sources=tuple(model.sources), overwrite=True)
    return out


def datastore_stage(cfg: ConfigDict, workdir: Path) -> Path:
    return build_policy_datastore(cfg, workdir / "stage2" / FINAL, construct_records(workdir), workdir / "datastore")
