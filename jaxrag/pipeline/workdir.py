"""What the stages share: the config's mode, and the workdir's datasets, models and index as
library objects at the config's settings (`W/world/datasets`, `W/<stage>/model`, `W/index`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from ml_collections import ConfigDict

from jaxrag.runtime import host_memory
from jaxrag.data.check import dataset_examples
from jaxrag.data.mixture import mixture_split
from jaxrag.data.schema import QAExample, read_examples
from jaxrag.decode.routing import RouteConfig
from jaxrag.decode.sampler import place_for_generation
from jaxrag.models.decoder import resolve_dtype
from jaxrag.models.lora import weights_dtype
from jaxrag.models.model import load_model
from jaxrag.retrieval.retriever import Retriever


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


# How the last model loaded for generation was placed (`sampler.place_for_generation`): the runner
# records it with the stage that loaded it (`W/inputs/<stage>.json`, "placement").
PLACEMENT: dict = {}


def load(cfg: ConfigDict, path: Path, inference: bool = False):
    """A saved model at the config's dtypes; `inference=True`: LoRA merged and layers unstacked
    once, weights in the compute dtype, for the stages that only generate and score
    (`models.model.for_inference`), placed on
    this process's devices as `generation` says (`sampler.place_for_generation`). The memory of
    models dropped before this call goes back to the OS first."""
    host_memory.release()
    if not inference:
        return load_model(path, dtype=cfg.model.dtype, param_dtype=weights_dtype(cfg))
    # Generation keeps its weights in the compute dtype, which every use casts them to: the same
    # numbers as float32 master weights, in half the bytes per token.
    model = load_model(path, dtype=cfg.model.dtype, param_dtype=jnp.dtype(resolve_dtype(cfg.model.dtype)).name,
                       inference=True)
    decoder, where = place_for_generation(model.decoder, int(cfg.generation.tensor))
    if where != PLACEMENT:
        print(f"  generation: process {jax.process_index()} of {where['processes']}, {where['devices_per_process']} "
              f"devices: data {where['data']} x tensor {where['tensor']}", flush=True)
        PLACEMENT.update(where)
    return dataclasses.replace(model, decoder=decoder)


def retriever(cfg: ConfigDict, workdir: Path):
    return Retriever.load(workdir / "index", cfg.retrieval.encoder)


def route_config(cfg: ConfigDict):
    return RouteConfig(hidden_layer=int(cfg.model.datastore_layer),
                       max_verbal_tokens=int(cfg.construct.verbalize_max_tokens),
                       max_knowledge_tokens=int(cfg.inference.max_knowledge_tokens),
                       max_answer_tokens=int(cfg.inference.max_answer_tokens))


def construct_records(workdir: Path) -> list[dict]:
    return [json.loads(line) for path in sorted((workdir / "construct").glob("shard-*.jsonl"))
            for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
