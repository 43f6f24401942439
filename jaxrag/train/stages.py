"""The pipeline's training entry points. Each is resumable in its workdir and returns the
trained model, which it also saves to `workdir/model` (a finished workdir just loads it).

    train_lm(model, texts, cfg, workdir)                 pretraining (cfg.pretrain)
    train_stage1(model, records, cfg, workdir)           SR-RAG stage 1 (cfg.stage1, Eq. 1-4)
    train_stage2(model, ref_model, records, cfg, workdir) SR-RAG stage 2 (cfg.stage2, Eq. 5-6)
    train_stage2_no_dpo(model, records, cfg, workdir)    Table 3's w/o DPO (cfg.stage2, stage-1 loss)

Workdir: checkpoints/ (orbax, while it trains), metrics.jsonl, tensorboard/, model/ (final,
jaxrag format); stage 2 also ref_logprobs.npy (the frozen reference's log p(c_i+|q), log p(c_i-|q)).
`records` is a construct-stage JSONL path or a list of records; `texts` a list of documents or
a function epoch -> documents. On multi-host launches call
`jaxrag.runtime.join.initialize_distributed()` first, before any other JAX call.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxrag import sharding
from jaxrag.runtime import concurrency, host_memory
from jaxrag.errors import JaxragError
from jaxrag.models.lora import Trainable, add_lora
from jaxrag.models.model import Model, load_model, save_model
from jaxrag.models.tokens import srrag_token_ids
from jaxrag.train import losses
from jaxrag.train.batches import RecordData, TextData, as_records
from jaxrag.train.trainer import CHECKPOINTS, TrainSpec, accumulation_steps, fit, forward_fn

FINAL = "model"
REF_LOGPROBS = "ref_logprobs.npy"


def _section(cfg, name: str):
    if name not in cfg:
        raise JaxragError(f"config has no '{name}' section")
    return cfg[name]


def _finish(model: Model, decoder, params: dict, workdir: Path) -> Model:
    graphdef, _ = nnx.split(decoder)
    trained = Model(nnx.merge(graphdef, params), model.tokenizer, model.hf_config, model.sources)
    save_model(trained, workdir / FINAL)
    _drop_checkpoints(workdir)
    return trained


def _drop_checkpoints(workdir: Path) -> None:
    """The trainer's checkpoints (params and optimizer state, up to `keep_checkpoints` of them:
    3 x 84 GB for a 7B full fine-tune) only resume an unfinished training; once the final model
    is saved they are removed (also when a run was killed between the two). One that cannot be
    removed (a shared filesystem's files of another user) is left with one warning line naming
    it: the model is saved, but the space is not freed."""
    path = workdir / CHECKPOINTS
    if jax.process_index() == 0 and path.exists():
        try:
            shutil.rmtree(path)
        except OSError as e:
            print(f"warning: could not remove the finished training's checkpoints {path} ({e.strerror or e}: "
                  f"{e.filename or path}); remove them by hand to free the space", file=sys.stderr, flush=True)


def _done(model: Model, workdir: Path) -> Model | None:
    final = workdir / FINAL
    if not final.is_dir():
        return None
    _drop_checkpoints(workdir)
    return load_model(final, dtype=model.config.dtype, param_dtype=model.config.param_dtype)


def train_lm(model: Model, texts, cfg, workdir, *, mesh=None) -> Model:
    """Next-token pretraining (`lm_loss`) for `cfg.pretrain.steps` steps of
    `cfg.pretrain.batch_size` packed rows of `cfg.model.max_length` tokens."""
    workdir = Path(workdir)
    if (done := _done(model, workdir)) is not None:
        return done
    section = _section(cfg, "pretrain")
    spec = TrainSpec.from_section("pretrain", section, int(section.steps), int(cfg.seed), cfg.model.get("remat", "none"))
    data = TextData(texts, model.tokenizer, int(cfg.model.max_length), int(cfg.seed))
    fingerprint = {"task": "lm", "batch_size": spec.batch_size, "steps": spec.total_steps,
                   "max_length": data.max_length, "seed": spec.seed}
    mesh = mesh or sharding.make_mesh(cfg.mesh)
    params = fit(model.decoder, data, losses.lm_objective, spec, workdir, mesh, fingerprint)
    return _finish(model, model.decoder, params, workdir)


def with_lora(model: Model, cfg) -> Model:
    """`model` with adapters when `cfg.model.lora.rank` > 0 (kept if it has them: stage 2
    continues stage 1's adapter)."""
    lora = cfg.model.get("lora")
    if not lora or not int(lora.rank):
        return model
    return add_lora(model, int(lora.rank), float(lora.alpha), list(lora.targets), int(cfg.seed))


def _trainable(model: Model, cfg) -> Trainable:
    lora = cfg.model.get("lora") or {}
    return Trainable.for_model(model, cfg.model.get("base_dtype", "auto"), float(lora.get("dropout", 0.0)))


def _stage_setup(model: Model, records, cfg, name: str, pairs: bool):
    if not model.sources:
        raise JaxragError(f"{name}: the model has no SR-RAG tokens; call add_special_tokens first")
    model = with_lora(model, cfg)
    section = _section(cfg, name)
    recs = as_records(records, model.sources)
    data = RecordData(recs, model.tokenizer, int(cfg.model.max_length),
                      float(section.get("extra_passages_lambda", 0.0)), int(cfg.seed), pairs=pairs)
    steps = int(section.epochs) * math.ceil(len(data) / int(section.batch_size))
    spec = TrainSpec.from_section(name, section, steps, int(cfg.seed), cfg.model.get("remat", "none"),
                                  srrag_token_ids(model))
    fingerprint = {"task": name, "batch_size": spec.batch_size, "steps": steps, "examples": len(data),
                   "max_length": data.max_length, "seed": spec.seed, "token_lr_scale": spec.token_lr_scale}
    if model.config.lora_rank:
        fingerprint["lora"] = [model.config.lora_rank, model.config.lora_alpha, list(model.config.lora_targets)]
    return model, data, spec, fingerprint


def train_stage1(model: Model, records, cfg, workdir, *, mesh=None) -> Model:
    """Stage 1 (`stage1_loss`): behaviour cloning of source, verbalization and answer."""
    return _train_stage1_loss(model, records, cfg, workdir, "stage1", mesh)


def train_stage2_no_dpo(model: Model, records, cfg, workdir, *, mesh=None) -> Model:
    """Table 3's "w/o DPO": "L_stage2 is ablated and L_stage1 is kept for stage 2 training" —
    stage 2's data, steps, learning rate and schedule with the stage-1 loss, from `model` (the
    stage-1 model)."""
    return _train_stage1_loss(model, records, cfg, workdir, "stage2", mesh, task="stage2_no_dpo")


def _train_stage1_loss(model: Model, records, cfg, workdir, section: str, mesh, task: str | None = None) -> Model:
    workdir = Path(workdir)
    if (done := _done(model, workdir)) is not None:
        return done
    model, data, spec, fingerprint = _stage_setup(model, records, cfg, section, pairs=False)
    fingerprint["task"] = task or section
    mesh = mesh or sharding.make_mesh(cfg.mesh)
    params = fit(model.decoder, data, losses.stage1_objective, spec, workdir, mesh, fingerprint,
                 _trainable(model, cfg))
    return _finish(model, model.decoder, params, workdir)


def train_stage2(model: Model, ref_model: Model, records, cfg, workdir, *, mesh=None) -> Model:
    """Stage 2 (`stage2_loss`): L_src + DPO on (c_i+, c_i-) for Self examples + L_ans.
    `model` and `ref_model` are both the stage-1 model; only `model` is updated."""
    workdir = Path(workdir)
    if (done := _done(model, workdir)) is not None:
        return done
    model, data, spec, fingerprint = _stage_setup(model, records, cfg, "stage2", pairs=True)
    mesh = mesh or sharding.make_mesh(cfg.mesh)
    ref_path = workdir / REF_LOGPROBS
    if ref_path.is_file():
        data.ref = np.load(ref_path)
        if data.ref.shape != (len(data), 2):
            raise JaxragError(f"{ref_path}: shape {data.ref.shape} does not match {len(data)} records; "
                              "use a fresh workdir")
    else:
        micro = spec.batch_size // accumulation_steps(spec, mesh)
        data.ref = reference_logprobs(ref_model, data, mesh, micro)
        if jax.process_index() == 0:
            _save_npy(ref_path, data.ref)
    objective = losses.stage2_objective(float(_section(cfg, "stage2").dpo_beta))
    params = fit(model.decoder, data, objective, spec, workdir, mesh, fingerprint, _trainable(model, cfg))
    return _finish(model, model.decoder, params, workdir)


def reference_logprobs(ref_model: Model, data: RecordData, mesh, batch_size: int) -> np.ndarray:
    """[n, 2] float32: the frozen reference's log p(c_i+|q), log p(c_i-|q) per record (0 for
    non-Self records), computed once in record order with the training mesh."""
    graphdef, state = nnx.split(ref_model.decoder)
    params = sharding.place(nnx.to_pure_dict(state), sharding.param_shardings(mesh, ref_model.decoder))
    fn = jax.jit(lambda p, b: losses.verbalization_logprobs(forward_fn(graphdef, p), b),
                 out_shardings=sharding.replicated(mesh))
    order = np.pad(np.arange(len(data)), (0, -len(data) % batch_size), constant_values=-1).reshape(-1, batch_size)
    rows = sharding.host_rows(mesh, batch_size)
    out = np.zeros((len(data), 2), np.float32)
    for idx in tqdm(order, desc="reference log-probs", disable=jax.process_index() != 0):
        concurrency.check()
        host_memory.bound()
        lp = np.asarray(fn(params, sharding.global_batch(data.rows(idx[rows], 0), rows, mesh, batch_size)))
        out[idx[idx >= 0]] = lp[:, idx >= 0].T
    return out


def _save_npy(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".npy")
    with os.fdopen(fd, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)
