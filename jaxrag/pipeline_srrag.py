"""The paper's stages after `index`: construct -> stage1 -> stage2 -> datastore -> baselines.

Each is `(config, workdir) -> artifact` and reads only earlier stages' artifacts:

    construct/     Algorithm 1 records (shards + stats.json)            `jaxrag.data.construct`
    stage1/model   SR-RAG stage 1 (Eq. 1-4) from the base model
    stage2/model   SR-RAG stage 2 (Eq. 5-6, DPO), reference = stage 1
    datastore/     policy datastore of the final model (§3.4)
    baselines/     Selective RAG (sources {none, wiki}; stage 1, then stage 2's data, steps, lr and
                   schedule on its own stage-1 loss), the w/o-kv-label and w/o-DPO models (the
                   latter: stage 2 with the stage-1 loss) and their datastores
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
from ml_collections import ConfigDict

from jaxrag import lanes
from jaxrag.data.schema import QAExample, read_examples
from jaxrag.errors import JaxragError
from jaxrag.models.tokens import NONE, SELF, WIKI
from jaxrag.train.stages import FINAL


def is_embedded(cfg: ConfigDict) -> bool:
    """The embedded default trains its model from scratch on the generated world."""
    return not cfg.model.path


def dataset_items(cfg: ConfigDict, workdir: Path, names, split: str) -> list[tuple[str, QAExample]]:
    """(dataset, example) pairs: the world's splits, or the paper's data via `data.loaders`
    (`--config.data.paths.NAME=/path`, or by hub name when online). Real training datasets: the
    `train` / `validation` splits are Table 5's counts drawn from the public train split."""
    items = []
    for name in names:
        if is_embedded(cfg):
            examples = read_examples(workdir / "world" / "datasets" / name / f"{split}.jsonl")
        else:
            from jaxrag.data.check import dataset_examples
            from jaxrag.data.mixture import mixture_split

            examples = dataset_examples(cfg, name)  # at the paper's split (TriviaQA: validation)
            if name in cfg.data.train:
                train, val = mixture_split(examples, int(cfg.data.train_sizes[name]),
                                           int(cfg.data.validation_sizes[name]), int(cfg.seed), name)
                examples = {"train": train, "validation": val}[split]
        items += [(name, ex) for ex in examples]
    return items


def eval_items(cfg: ConfigDict, workdir: Path) -> tuple[list, list]:
    """(validation, test) items: validation = the training mixture's validation split (Table 5),
    never a test question; test = the evaluation sets whole."""
    return (dataset_items(cfg, workdir, cfg.data.train, "validation"),
            dataset_items(cfg, workdir, cfg.data.eval, "test"))


def load(cfg: ConfigDict, path: Path, inference: bool = False):
    """A saved model at the config's dtypes; `inference=True`: LoRA merged and layers unstacked
    once, for the stages that only generate and score (`models.model.for_inference`)."""
    from jaxrag.models.lora import weights_dtype
    from jaxrag.models.model import load_model

    return load_model(path, dtype=cfg.model.dtype, param_dtype=weights_dtype(cfg), inference=inference)


def retriever(cfg: ConfigDict, workdir: Path):
    from jaxrag.retrieval.retriever import Retriever

    return Retriever.load(workdir / "index", cfg.retrieval.encoder)


# -- construct ------------------------------------------------------------------------------------

def construct_stage(cfg: ConfigDict, workdir: Path) -> Path:
    from jaxrag.data.construct import construct

    r = retriever(cfg, workdir)
    return construct(load(cfg, workdir / "base", inference=True), dataset_items(cfg, workdir, cfg.data.train, "train"),
                     r.retrieve_texts, r.encoder, cfg.construct, workdir / "construct", rng_seed=int(cfg.seed),
                     max_length=int(cfg.model.max_length))


def construct_records(workdir: Path) -> list[dict]:
    return [json.loads(line) for path in sorted((workdir / "construct").glob("shard-*.jsonl"))
            for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


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


# -- training ---------------------------------------------------------------------------------

def stage1_stage(cfg: ConfigDict, workdir: Path) -> Path:
    from jaxrag.train.stages import train_stage1

    train_stage1(load(cfg, workdir / "base"), construct_records(workdir), cfg, workdir / "stage1")
    return workdir / "stage1"


def stage2_stage(cfg: ConfigDict, workdir: Path) -> Path:
    from jaxrag.train.stages import train_stage2

    ref = load(cfg, workdir / "stage1" / FINAL)
    train_stage2(load(cfg, workdir / "stage1" / FINAL), ref, construct_records(workdir), cfg, workdir / "stage2")
    return workdir / "stage2"


# -- policy datastore ---------------------------------------------------------------------------

def preferred_sources(model, records: list[dict], cfg: ConfigDict) -> tuple[np.ndarray, list[str]]:
    """The policy datastore's keys and values (§3.4): the fine-tuned model reads each training
    question (hidden state of `datastore_layer` at `<EOQ>` = key), verbalizes its own knowledge
    (the Self path, greedy) and is given the question's retrieved passages; the value is the
    source under which it finds the gold answer more likely (ties go to Wiki, as Algorithm 1)."""
    from jaxrag.decode.routing import route
    from jaxrag.decode.scoring import score
    from jaxrag.models.tokens import source_token
    from jaxrag.policies import always
    from jaxrag.prompts import answer_ids, answer_prefix_ids, knowledge_ids, prompt_ids

    tok, rc = model.tokenizer, route_config(cfg)
    questions = [r["question"] for r in records]
    retrieved = [[c["text"] for c in r["contexts"] if c["source"] == WIKI][: int(cfg.retrieval.n_passages)]
                 for r in records]
    keys, verbal = [], []
    batch = int(cfg.inference.batch_size)
    for start in range(0, len(records), batch):
        lanes.check()
        seen = []

        def forced(inputs, seen=seen):
            seen.append(inputs.hidden)
            return always(SELF)(inputs)

        routed = route(model, questions[start:start + batch], forced, lambda qs: [[""]] * len(qs), rc)
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


def build_policy_datastore(cfg: ConfigDict, model_dir: Path, records: list[dict], out: Path) -> Path:
    from jaxrag.retrieval.datastore import build_datastore

    model = load(cfg, model_dir, inference=True)
    layers = model.decoder.cfg.num_layers
    if not 1 <= int(cfg.model.datastore_layer) <= layers:
        raise JaxragError(f"model.datastore_layer={cfg.model.datastore_layer}: {model_dir} has {layers} layers; "
                          f"choose 1-{layers}")
    keys, values = preferred_sources(model, records, cfg)
    build_datastore(out, keys, values, [r["id"] for r in records], [r["question"] for r in records],
                    model=str(model_dir), sources=tuple(model.sources), overwrite=True)
    return out


def datastore_stage(cfg: ConfigDict, workdir: Path) -> Path:
    return build_policy_datastore(cfg, workdir / "stage2" / FINAL, construct_records(workdir), workdir / "datastore")


def route_config(cfg: ConfigDict):
    from jaxrag.decode.routing import RouteConfig

    return RouteConfig(hidden_layer=int(cfg.model.datastore_layer),
                       max_verbal_tokens=int(cfg.construct.verbalize_max_tokens),
                       max_knowledge_tokens=int(cfg.inference.max_knowledge_tokens),
                       max_answer_tokens=int(cfg.inference.max_answer_tokens))


# -- baselines and ablations ----------------------------------------------------------------------

def baselines_stage(cfg: ConfigDict, workdir: Path) -> Path:
    """Selective RAG (sources {wiki, none}, retrieval-vs-nothing labels): stage 1, then a second
    stage as SR-RAG gets one, with stage 2's data (its own records again), epochs, learning rate
    and schedule on its own objective, the stage-1 loss (as the paper's "w/o DPO" keeps it: it
    has no verbalization for DPO to act on), so SR-RAG − Selective RAG is not extra answer
    training. The w/o kv label model (stages 1 and 2 on no-context labels) and its datastore; the
    w/o DPO model (stage 2 run with the stage-1 loss, as the paper ablates it) and its datastore.
    Each piece resumes on its own; `done.json` is written last."""
    from jaxrag.models.model import add_special_tokens
    from jaxrag.train.stages import train_stage1, train_stage2, train_stage2_no_dpo

    out, records = workdir / "baselines", construct_records(workdir)
    base = workdir / "base"

    def selective():
        sel = relabel(records, "selective_label")
        train_stage1(add_special_tokens(load(cfg, base), (WIKI, NONE)), sel, cfg, out / "selective_stage1")
        train_stage2_no_dpo(load(cfg, out / "selective_stage1" / FINAL), sel, cfg, out / "selective")

    def with_datastore(name: str, train) -> Callable[[], None]:
        def piece():
            train()
            if not (out / f"{name}_datastore").is_dir():
                build_policy_datastore(cfg, out / name / FINAL, records, out / f"{name}_datastore")
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
    tmp = out / "done.json.tmp"
    tmp.write_text(json.dumps({"selective": "selective", "no_kv_label": "no_kv_label", "no_dpo": "no_dpo"}) + "\n")
    os.replace(tmp, out / "done.json")
    return out


def baselines_done(workdir: Path) -> bool:
    return (workdir / "baselines" / "done.json").is_file()


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
