"""The sharded training loop shared by pretraining, stage 1 and stage 2.

- State = {"params", "opt", "step"} as pure pytrees, placed with NamedSharding by
  `jaxrag.sharding` rules (optimizer moments follow their parameter's sharding).
- What trains: `Trainable` — every parameter, or under LoRA the adapters and the SR-RAG
  tokens' rows, with the frozen rest passed to the step as an argument (never in the optimizer
  state or the checkpoints).
- Optimiser: gradient clipping + AdamW (no decay on 1-D params) with linear warm-up and
  linear decay to zero; the SR-RAG tokens' rows (`token_ids`) step `token_lr_scale` times as
  far as the rest (new rows start far from where they must go; see `scale_token_rows`);
  f32 master weights, compute in the decoder's dtype (bf16 on
  accelerators with `dtype="auto"`).
- One jitted step with donated state. The global batch (config `batch_size`) is split into
  `accumulation_steps` micro-batches scanned in sequence, so the batch is the configured one on
  any device count; losses are sums divided by the global count, so accumulation is exact.
- Checkpoints every `checkpoint_every` steps before the last; a rerun resumes from the latest
  with the same data order (the order is a function of seed and epoch only). The last step's
  state is not checkpointed: the caller saves it as the stage's model (`stages._finish`), and a
  checkpoint of it (the trained params and their Adam moments, 3x the model's bytes in a full
  fine-tune) would be removed right after. A run killed before that model is saved resumes
  from the latest checkpoint and redoes the steps after it, to the same weights. A non-finite
  loss or gradient stops the run before it is checkpointed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrag import sharding
from jaxrag.runtime import concurrency, host_memory
from jaxrag.errors import JaxragError
from jaxrag.models.decoder import REMAT_POLICIES, Decoder, LoraDropout
from jaxrag.models.lora import ROWS, Trainable
from jaxrag.models.masks import positions_from_segments
from jaxrag.train.checkpoint import Checkpoints, abstract_like
from jaxrag.train.losses import Forward, LossTerms, target_logprobs, token_logprobs
from jaxrag.train.metrics import MetricsLogger

Objective = Callable[[Forward, dict], LossTerms]
CHECKPOINTS = "checkpoints"  # the workdir's folder of train-state checkpoints


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """One training run's hyper-parameters (a config section plus the step budget)."""
    name: str
    batch_size: int  # global, in examples (LM: rows of max_length tokens)
    lr: float
    total_steps: int
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # <= 0: no clipping
    per_device_batch_size: int = 0  # rows per data shard per micro-step; 0 = whole batch at once
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    log_every: int = 10
    seed: int = 0
    remat: str = "none"  # config `model.remat`: what the backward pass keeps per layer (REMAT_POLICIES)
    token_lr_scale: float = 1.0  # the learning rate of the `token_ids` rows, relative to `lr`
    token_ids: tuple[int, ...] = ()  # the SR-RAG tokens' ids (rows of embed, columns of lm_head)

    @classmethod
    def from_section(cls, name: str, section, total_steps: int, seed: int, remat: str = "none",
                     token_ids: tuple[int, ...] = ()) -> TrainSpec:
        if remat not in REMAT_POLICIES:
            raise JaxragError(f"config model.remat={remat!r}: choose one of {', '.join(REMAT_POLICIES)}")
        fields = {f.name for f in dataclasses.fields(cls)} - {"name", "total_steps", "seed", "remat", "token_ids"}
        spec = cls(name=name, total_steps=total_steps, seed=seed, remat=remat, token_ids=tuple(token_ids),
                   **{k: section[k] for k in fields if k in section})
        if not spec.token_lr_scale > 0:
            raise JaxragError(f"config {name}.token_lr_scale={spec.token_lr_scale}: must be positive")
        return spec


def learning_rate(spec: TrainSpec) -> optax.Schedule:
    """Linear warm-up over `warmup_ratio` of the steps, then linear decay; never 0 on a step."""
    total = spec.total_steps
    warm = int(round(spec.warmup_ratio * total))

    def schedule(step):
        up = (step + 1) / max(warm, 1) if warm else jnp.inf
        down = (total - step) / max(total - warm, 1)
        return spec.lr * jnp.clip(jnp.minimum(up, down), 0.0, 1.0)
    return schedule


def scale_token_rows(token_ids: tuple[int, ...], scale: float) -> optax.GradientTransformation:
    """Multiplies the updates of the SR-RAG tokens' rows (embed[ids], lm_head[:, ids]; under
    LoRA the whole `token_rows` tree, which holds just those rows) by `scale`. Adam moves every
    weight about lr per step whatever its gradient, so a new token's logit, which starts many
    nats from its target, is slow to move through its own rows; the rest of the network then
    bends its hidden states to the new tokens instead, and forgets what it read before."""
    ids = jnp.asarray(token_ids, jnp.int32)

    def apply(updates, params=None):
        del params
        if scale == 1.0 or not token_ids:
            return updates
        updates = dict(updates)
        if ROWS in updates:
            updates[ROWS] = jax.tree.map(lambda u: u * scale, updates[ROWS])
            return updates
        if "embed" in updates:
            updates["embed"] = updates["embed"].at[ids].multiply(scale)
        if "lm_head" in updates:
            updates["lm_head"] = updates["lm_head"].at[:, ids].multiply(scale)
        return updates
    return optax.stateless(apply)


def make_optimizer(spec: TrainSpec) -> optax.GradientTransformation:
    clip = spec.grad_clip if spec.grad_clip > 0 else math.inf
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # not norms/biases
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(learning_rate(spec), b1=0.9, b2=0.999, eps=1e-8,
                                   weight_decay=spec.weight_decay, mask=decay_mask),
                       scale_token_rows(spec.token_ids, spec.token_lr_scale))


def accumulation_steps(spec: TrainSpec, mesh) -> int:
    dp = sharding.data_parallel_size(mesh)
    micro = spec.per_device_batch_size * dp if spec.per_device_batch_size else spec.batch_size
    if spec.batch_size % dp or spec.batch_size % micro:
        raise JaxragError(f"{spec.name}: batch_size {spec.batch_size} must be a multiple of the micro-batch "
                          f"{micro} (per_device_batch_size {spec.per_device_batch_size} x {dp} data shards)")
    return spec.batch_size // micro


def forward_fn(graphdef, params, remat: str = "none", mesh=None, dropout: LoraDropout | None = None) -> Forward:
    """`mask` [b, t]: bool (real tokens) or int segment ids of packed documents (0 = padding);
    `targets` [b, k]: the positions to score (the head runs there only), or None for all.
    `remat`: what a gradient through it keeps per layer (`REMAT_POLICIES`); `mesh`: activations
    stay split over its batch axes; `dropout`: LoRA dropout (training)."""
    model = nnx.merge(graphdef, params)

    def forward(ids, mask, targets=None):
        segments = mask.astype(jnp.int32)
        at = None if targets is None else jnp.maximum(targets - 1, 0)  # the logits at t - 1 predict ids[t]
        logits = model(ids, positions_from_segments(segments), segments > 0, segment_ids=segments,
                       logit_positions=at, remat=remat, lora_dropout=dropout,
                       batch_sharding=None if mesh is None else sharding.batch_sharding(mesh)).logits
        return token_logprobs(logits, ids) if targets is None else target_logprobs(logits, ids, targets)
    return forward


def loss_and_grads(graphdef, objective: Objective, params: dict, batch: dict,
                   remat: str = "none", mesh=None, full=lambda p: p,
                   dropout: LoraDropout | None = None) -> tuple[LossTerms, dict]:
    """Loss terms (sums) and the gradient of `terms.total` w.r.t. params (`full(params)` = the
    model's whole parameter tree: `Trainable.join` with the frozen rest under LoRA)."""
    def total(p):
        terms = objective(forward_fn(graphdef, full(p), remat, mesh, dropout), batch)
        return terms.total, terms
    (_, terms), grads = jax.value_and_grad(total, has_aux=True)(params)
    return terms, grads


def accumulated_grads(graphdef, objective: Objective, params: dict, batch: dict, accum: int, mesh,
                      params_sh: dict, remat: str = "none", full=lambda p: p,
                      dropout: LoraDropout | None = None) -> tuple[LossTerms, dict]:
    """Loss terms and gradients summed over `accum` micro-batches of the global batch [B, ...]
    (micro-batch k drops out with the key folded with k)."""
    grads_of = functools.partial(loss_and_grads, graphdef, objective, remat=remat, mesh=mesh, full=full)
    # Micro-batch k = rows k::accum: each keeps an even share on every data shard (no shuffle).
    micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1), batch)

    def body(carry, k_mb):
        k, mb = k_mb
        mb = jax.lax.with_sharding_constraint(mb, sharding.batch_sharding(mesh))
        drop = None if dropout is None else dropout._replace(key=jax.random.fold_in(dropout.key, k))
        terms, grads = grads_of(params, mb, dropout=drop)
        grads = jax.lax.with_sharding_constraint(grads, params_sh)
        return jax.tree.map(lambda a, b: a + b.astype(a.dtype), carry, (terms, grads)), None

    first = jax.tree.map(lambda x: x[0], micro)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), jax.eval_shape(grads_of, params, first))
    return jax.lax.scan(body, zeros, (jnp.arange(accum), micro))[0]


def make_train_step(graphdef, objective: Objective, spec: TrainSpec, mesh, shardings: dict, accum: int,
                    trainable: Trainable = Trainable()):
    """Jitted (state, batch, frozen) -> (state, metrics); `state` is donated. `frozen` is what
    `trainable` keeps fixed (from `frozen_params`; {} when everything trains)."""
    tx, schedule = make_optimizer(spec), learning_rate(spec)

    def step(state, batch, frozen):
        params = state["params"]
        # LoRA dropout: a key per step from the seed, so a resumed run draws what it would have
        dropout = LoraDropout(trainable.dropout, jax.random.fold_in(jax.random.key(spec.seed), state["step"])) \
            if trainable.dropout > 0 else None
        terms, grads = accumulated_grads(graphdef, objective, params, batch, accum, mesh, shardings["params"],
                                         spec.remat, lambda p: trainable.join(p, frozen), dropout)
        count = jnp.maximum(terms.count, 1.0)
        grads = jax.tree.map(lambda g, p: (g / count).astype(p.dtype), grads, params)
        updates, opt = tx.update(grads, state["opt"], params)
        metrics = {"loss": terms.total / count, **{k: v / count for k, v in terms.parts.items()},
                   "grad_norm": optax.tree.norm(grads), "lr": schedule(state["step"]),
                   "tokens": jnp.sum(batch["mask"] > 0) + jnp.sum(batch.get("rej_mask", jnp.zeros((), bool))),
                   "truncated": jnp.sum(batch.get("truncated", jnp.zeros(()))),
                   "sequences": jnp.sum(batch.get("valid", jnp.zeros(())))}
        return {"params": optax.apply_updates(params, updates), "opt": opt, "step": state["step"] + 1}, metrics

    # `frozen` keeps the shardings `frozen_params` placed it with.
    return jax.jit(step, in_shardings=(shardings, sharding.batch_sharding(mesh), None),
                   out_shardings=(shardings, sharding.replicated(mesh)), donate_argnums=0)


def state_shardings(decoder: Decoder, spec: TrainSpec, mesh, trainable: Trainable = Trainable()) -> tuple[dict, dict]:
    """(abstract state, shardings) for {"params", "opt", "step"}; params = what `trainable` trains."""
    full_sh = sharding.param_shardings(mesh, decoder)
    full = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(nnx.state(decoder)))
    params = jax.eval_shape(lambda p: trainable.split(p)[0], full)
    tx, rep = make_optimizer(spec), sharding.replicated(mesh)
    params_sh, _ = trainable.shardings(full_sh, rep)
    opt = jax.eval_shape(tx.init, params)
    opt_sh = optax.tree_map_params(tx, lambda _, s: s, opt, params_sh, transform_non_params=lambda _: rep,
                                   is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    abstract = {"params": params, "opt": opt, "step": jax.ShapeDtypeStruct((), jnp.int32)}
    return abstract, {"params": params_sh, "opt": opt_sh, "step": rep}


def frozen_params(decoder: Decoder, trainable: Trainable, mesh) -> dict:
    """The fixed part of `decoder`'s params ({} when everything trains), placed by the rules,
    in `trainable.base_dtype`."""
    _, frozen_sh = trainable.shardings(sharding.param_shardings(mesh, decoder), sharding.replicated(mesh))
    return sharding.place(trainable.split(nnx.to_pure_dict(nnx.state(decoder)))[1], frozen_sh)


def fit(decoder: Decoder, data, objective: Objective, spec: TrainSpec, workdir: Path, mesh,
        fingerprint: dict, trainable: Trainable = Trainable()) -> dict:
    """Trains what `trainable` names of `decoder`'s weights (or resumes from
    workdir/checkpoints, which hold only that); returns the final full params (pure dict of
    global arrays). `data` is a RecordData / TextData."""
    workdir = Path(workdir)
    accum = accumulation_steps(spec, mesh)
    graphdef, _ = nnx.split(decoder)
    abstract, shardings = state_shardings(decoder, spec, mesh, trainable)
    frozen = frozen_params(decoder, trainable, mesh)
    ckpt = Checkpoints(workdir / CHECKPOINTS, spec.keep_checkpoints)
    start = ckpt.latest_step()
    if start is None:
        params = sharding.place(trainable.split(nnx.to_pure_dict(nnx.state(decoder)))[0], shardings["params"])
        opt = jax.jit(make_optimizer(spec).init, out_shardings=shardings["opt"])(params)
        state = {"params": params, "opt": opt, "step": sharding.place(np.int32(0), shardings["step"])}
        meta = {"epoch": 0, "batch": 0, "truncated": 0, "sequences": 0, "fingerprint": fingerprint}
    else:
        state, meta = ckpt.restore(start, abstract_like(abstract, shardings))
        if meta["fingerprint"] != fingerprint:
            raise JaxragError(f"{ckpt.directory}: checkpoints are from a different run ({meta['fingerprint']}) "
                              f"than this one ({fingerprint}); use a fresh workdir")
    step_fn = make_train_step(graphdef, objective, spec, mesh, shardings, accum, trainable)
    loop = _Loop(spec, ckpt, MetricsLogger(workdir, spec.name, spec.total_steps, start or 0), meta)
    rows = sharding.host_rows(mesh, spec.batch_size)
    step, order = start or 0, data.order(meta["epoch"], spec.batch_size)
    try:
        while step < spec.total_steps:
            concurrency.check()
            host_memory.bound()
            if meta["batch"] >= len(order):
                meta["epoch"], meta["batch"] = meta["epoch"] + 1, 0
                order = data.order(meta["epoch"], spec.batch_size)
                continue
            local = data.rows(order[meta["batch"]][rows], meta["epoch"])
            state, metrics = step_fn(state, sharding.global_batch(local, rows, mesh, spec.batch_size), frozen)
            step, meta["batch"] = step + 1, meta["batch"] + 1
            loop.dispatched(step, metrics, state, meta)
        loop.finish()
    finally:
        loop.close()
    return jax.jit(trainable.join)(state["params"], frozen)


class _Loop:
    """Host side of the loop: reads each step's metrics one step late (so the host prepares the
    next batch while the device computes), checks them, logs, and checkpoints good states."""

    def __init__(self, spec: TrainSpec, ckpt: Checkpoints, logger: MetricsLogger, meta: dict):
        self.spec, self.ckpt, self.logger, self.meta = spec, ckpt, logger, meta
        self.pending: list[tuple[int, dict]] = []
        self.window_tokens, self.window_start = 0.0, time.perf_counter()

    def dispatched(self, step: int, metrics: dict, state: dict, meta: dict) -> None:
        self.pending.append((step, metrics))
        save = step % self.spec.checkpoint_every == 0 and step < self.spec.total_steps
        while len(self.pending) > (0 if save else 1):
            self._consume(*self.pending.pop(0))
        if save:  # every step up to this one was checked: the state is good
            self.ckpt.save(step, state, dict(meta))

    def _consume(self, step: int, metrics: dict) -> None:
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        truncated, sequences, tokens = m.pop("truncated"), m.pop("sequences"), m.pop("tokens")
        if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
            self.logger.log(step, m)
            self.ckpt.wait()
            last = self.ckpt.latest_step()
            where = f"step {last} in {self.ckpt.directory}" if last is not None else "none (no step was saved)"
            raise JaxragError(f"{self.spec.name}: loss {m['loss']} / grad norm {m['grad_norm']} at step {step}: "
                              f"training stopped. The last good checkpoint is {where}; lower the learning "
                              "rate or check the data, then rerun to resume from it.")
        self.meta["truncated"] += int(truncated)  # running totals, reported at the end
        self.meta["sequences"] += int(sequences)
        self.window_tokens += tokens
        self.logger.advance()
        if step % self.spec.log_every == 0 or step == self.spec.total_steps:
            now = time.perf_counter()
            m["tokens_per_s"] = self.window_tokens / max(now - self.window_start, 1e-9)
            m["epoch"] = self.meta["epoch"]
            if self.meta["sequences"]:
                m["truncated_total"] = self.meta["truncated"]
            self.logger.log(step, m)
            self.window_tokens, self.window_start = 0.0, now

    def finish(self) -> None:
        while self.pending:
            self._consume(*self.pending.pop(0))
        if self.meta["sequences"]:
            self.logger.message(f"knowledge truncated in {self.meta['truncated']} of {self.meta['sequences']} "
                                "training sequences to fit max_length")

    def close(self) -> None:
        self.ckpt.wait()
        self.ckpt.close()
        self.logger.close()
