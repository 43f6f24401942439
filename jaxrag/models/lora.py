"""LoRA (Hu et al., 2021) for SR-RAG: adapters on the decoder's projections, trained with the
SR-RAG tokens' embedding rows; the rest of the base frozen (and kept in `model.base_dtype`).

- `add_lora(model, rank, alpha, targets)`: the same model plus zero-initialised adapters
  (W x + alpha/rank B A x; B = 0, so logits are unchanged until training moves B).
- `Trainable`: which parameters train. With adapters: every `*_lora_a/_b` leaf and the rows of
  the SR-RAG tokens in `embed` (and in `lm_head` when untied), as [n_tokens, hidden] arrays of
  their own, so the optimizer holds moments for those alone. Without adapters: everything.
  `split` / `join` move between the full pure-dict params and (trainable, frozen).
- `merge_lora(model)`: W += alpha/rank A B per adapted weight, the plain model export writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict

from jaxrag.errors import JaxragError
from jaxrag.models.decoder import LORA_TARGETS, resolve_dtype
from jaxrag.models.params import abstract_decoder, build_decoder, host_params
from jaxrag.models.tokens import srrag_token_ids

ROWS = "token_rows"  # the trainable tree's key for the SR-RAG tokens' rows


def check_targets(targets: Sequence[str], where: str = "model.lora.targets") -> tuple[str, ...]:
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets:
        raise JaxragError(f"config {where}={list(targets)}: choose among {', '.join(LORA_TARGETS)}")
    return tuple(dict.fromkeys(targets))


def add_lora(model, rank: int, alpha: float, targets: Sequence[str], seed: int = 0):
    """`model` (a jaxrag Model) with adapters of `rank` on `targets`: base weights unchanged,
    A random (seeded), B zero. A model that already has adapters keeps them (stage 2 continues
    stage 1's)."""
    cfg = model.config
    if cfg.lora_rank:
        return model
    if rank <= 0:
        raise JaxragError(f"config model.lora.rank={rank}: must be positive to add adapters")
    lora_cfg = dataclasses.replace(cfg, lora_rank=int(rank), lora_alpha=float(alpha), lora_targets=check_targets(targets))
    abstract = nnx.to_pure_dict(abstract_decoder(lora_cfg)[1])
    base, rng = flatten_dict(nnx.to_pure_dict(nnx.state(model.decoder))), np.random.default_rng(seed)
    merged = {}
    for path, leaf in flatten_dict(abstract).items():  # abstract: nothing allocated yet
        if path[-1].endswith("_lora_a"):  # [layers, inputs..., rank], std 1/sqrt(fan-in)
            std = 1.0 / np.sqrt(np.prod(leaf.shape[1:-1]))
            merged[path] = (rng.standard_normal(leaf.shape, np.float32) * std).astype(leaf.dtype)
        elif path[-1].endswith("_lora_b"):
            merged[path] = np.zeros(leaf.shape, leaf.dtype)
        else:
            merged[path] = base[path]
    return dataclasses.replace(model, decoder=build_decoder(lora_cfg, unflatten_dict(merged)))


def merge_lora(model):
    """The plain model: every adapted W replaced by W + alpha/rank (A B); adapters dropped."""
    cfg = model.config
    if not cfg.lora_rank:
        return model
    flat, scale = flatten_dict(host_params(model.decoder)), cfg.lora_alpha / cfg.lora_rank
    for path in [p for p in flat if p[-1].endswith("_lora_a")]:
        weight = (*path[:-1], path[-1][: -len("_lora_a")])
        a, b, w = flat.pop(path), flat.pop((*weight[:-1], weight[-1] + "_lora_b")), flat[weight]
        # a [layers, in..., r], b [layers, r, out...] -> [layers, in..., out...]
        delta = np.einsum("lir,lro->lio", a.reshape(a.shape[0], -1, a.shape[-1]),
                          b.reshape(b.shape[0], b.shape[1], -1)).reshape(w.shape)
        flat[weight] = (w.astype(np.float32) + scale * delta).astype(w.dtype)
    plain = dataclasses.replace(cfg, lora_rank=0, lora_alpha=0.0, lora_targets=())
    return dataclasses.replace(model, decoder=build_decoder(plain, unflatten_dict(flat)))


@dataclasses.dataclass(frozen=True)
class Trainable:
    """What a training run updates: everything (`lora=False`), or the adapters plus the rows
    `row_ids` of embed (and lm_head) — the SR-RAG tokens — with the frozen rest in `base_dtype`."""
    lora: bool = False
    row_ids: tuple[int, ...] = ()
    base_dtype: str = "float32"
    dropout: float = 0.0  # on the adapters' input while training (`model.lora.dropout`)

    @classmethod
    def for_model(cls, model, base_dtype: str = "auto", dropout: float = 0.0) -> Trainable:
        if not model.config.lora_rank:
            return cls()
        if not 0.0 <= dropout < 1.0:
            raise JaxragError(f"config model.lora.dropout={dropout}: must be in [0, 1)")
        return cls(True, srrag_token_ids(model), jnp.dtype(resolve_dtype(base_dtype)).name, float(dropout))

    def split(self, params: dict) -> tuple[dict, dict]:
        """Full pure-dict params -> (trainable, frozen). Frozen keeps every leaf (adapters and
        the trainable rows too, overwritten by `join`), cast to `base_dtype`."""
        if not self.lora:
            return params, {}
        ids = np.asarray(self.row_ids, np.int32)
        train = unflatten_dict({p: leaf for p, leaf in flatten_dict(params).items() if _is_lora(p)})
        train[ROWS] = {"embed": params["embed"][ids].astype(np.float32)}
        if "lm_head" in params:
            train[ROWS]["lm_head"] = params["lm_head"][:, ids].astype(np.float32)
        frozen = jax.tree.map(lambda x: x.astype(self.base_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                              params)
        return train, frozen

    def shardings(self, full: dict, replicated) -> tuple[dict, dict]:
        """(trainable, frozen) shardings from the full params' (`sharding.param_shardings`):
        adapters keep theirs, the token rows (a few rows) are replicated."""
        if not self.lora:
            return full, {}
        train = unflatten_dict({p: sh for p, sh in flatten_dict(full).items() if _is_lora(p)})
        train[ROWS] = {k: replicated for k in ("embed", "lm_head") if k in full}
        return train, full

    def join(self, train: dict, frozen: dict) -> dict:
        """(trainable, frozen) -> full params; gradients flow into `train` only."""
        if not self.lora:
            return train
        flat = flatten_dict(frozen)
        flat.update(flatten_dict({k: v for k, v in train.items() if k != ROWS}))
        params = unflatten_dict(flat)
        ids = jnp.asarray(self.row_ids, jnp.int32)
        rows = train[ROWS]
        for name, at in (("embed", np.s_[ids]), ("lm_head", np.s_[:, ids])):
            if name in rows:
                table = jnp.asarray(params[name])
                params[name] = table.at[at].set(rows[name].astype(table.dtype))
        return params


def weights_dtype(cfg) -> str:
    """The dtype a pipeline loads model weights in: `model.base_dtype` under LoRA (the frozen
    base; adapters are float32 anyway), else `model.param_dtype` (master weights)."""
    lora = cfg.model.get("lora")
    if lora and int(lora.rank):
        return jnp.dtype(resolve_dtype(cfg.model.get("base_dtype", "auto"))).name
    return str(cfg.model.param_dtype)


def _is_lora(path: tuple[str, ...]) -> bool:
    return path[-1].endswith(("_lora_a", "_lora_b"))
