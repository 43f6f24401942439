"""BERT-family retriever encoders in Flax NNX (all-MiniLM-L6-v2, DPR question/context encoders).

One module, `BertEncoder`, reproduces transformers' `BertModel`; the pooling a checkpoint asks for
is read from its directory: sentence-transformers' `modules.json` + `1_Pooling/config.json`
(mean pooling + `Normalize` for all-MiniLM-L6-v2), CLS (+ optional `encode_proj`) for DPR, CLS or
the tanh pooler for a plain BERT. Loading and batched encoding live in `encoder_io`.

Token type ids are always 0: DPR encodes (title, text) pairs with zero segments, and
sentence-transformers feeds single texts. Torch is never imported.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrag.errors import JaxragError

DEFAULT_ENCODER_NAME = "sentence-transformers/all-MiniLM-L6-v2"
POOLING_MODES = ("mean", "cls", "pooler", "max")
_ACTIVATIONS = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
}


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Static BERT architecture (hashable, so jitted functions can close over it)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    with_pooler: bool = False  # tanh(dense(CLS)), BertModel's pooler
    projection_dim: int = 0  # DPR `encode_proj` on the CLS vector when > 0

    @classmethod
    def from_hf(cls, hf: dict, *, with_pooler: bool = False) -> BertConfig:
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise JaxragError(f"only absolute position embeddings are supported, got {hf['position_embedding_type']!r}")
        if hf.get("hidden_act", "gelu") not in _ACTIVATIONS:
            raise JaxragError(f"unsupported hidden_act {hf['hidden_act']!r}; supported: {sorted(_ACTIVATIONS)}")
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"], intermediate_size=hf["intermediate_size"],
            max_position=hf.get("max_position_embeddings", 512), type_vocab_size=hf.get("type_vocab_size", 2),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-12), hidden_act=hf.get("hidden_act", "gelu"),
            with_pooler=with_pooler, projection_dim=hf.get("projection_dim", 0) or 0,
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def output_dim(self) -> int:
        return self.projection_dim or self.hidden_size


def _param(rngs: nnx.Rngs, shape, axes, init=nnx.initializers.normal(0.02)):
    # Logical axis names are metadata only; `jaxrag.sharding` places them by rules.
    return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=axes, eager_sharding=False)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, rngs: nnx.Rngs):
        self.scale = _param(rngs, (dim,), ("norm",), nnx.initializers.ones)
        self.bias = _param(rngs, (dim,), ("norm",), nnx.initializers.zeros)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...] + self.bias[...]
        return y.astype(x.dtype)


class Dense(nnx.Module):
    def __init__(self, d_in: int, d_out: int, axes: tuple[str, str], rngs: nnx.Rngs):
        self.kernel = _param(rngs, (d_in, d_out), axes)
        self.bias = _param(rngs, (d_out,), axes[1:], nnx.initializers.zeros)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.kernel[...].astype(x.dtype) + self.bias[...].astype(x.dtype)


class Attention(nnx.Module):
    """Bidirectional multi-head self-attention + residual + LayerNorm (BertAttention)."""

    def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
        e, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.wq = _param(rngs, (e, n, h), ("embed", "q_heads", "head_dim"))
        self.wk = _param(rngs, (e, n, h), ("embed", "q_heads", "head_dim"))
        self.wv = _param(rngs, (e, n, h), ("embed", "q_heads", "head_dim"))
        zeros = nnx.initializers.zeros
        self.bq = _param(rngs, (n, h), ("q_heads", "head_dim"), zeros)
        self.bk = _param(rngs, (n, h), ("q_heads", "head_dim"), zeros)
        self.bv = _param(rngs, (n, h), ("q_heads", "head_dim"), zeros)
        self.wo = _param(rngs, (n, h, e), ("q_heads", "head_dim", "embed"))
        self.bo = _param(rngs, (e,), ("embed",), zeros)
        self.norm = LayerNorm(e, cfg.layer_norm_eps, rngs)

    def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
        """x [b, t, e]; bias [b, 1, 1, t] additive key mask -> [b, t, e]."""
        dt = x.dtype
        q, k, v = (jnp.einsum("bte,enh->btnh", x, w[...].astype(dt)) + b[...].astype(dt)
                   for w, b in ((self.wq, self.bq), (self.wk, self.bk), (self.wv, self.bv)))
        scores = jnp.einsum("bqnh,bknh->bnqk", q, k).astype(jnp.float32) * q.shape[-1] ** -0.5
        probs = jax.nn.softmax(scores + bias, axis=-1).astype(dt)
        ctx = jnp.einsum("bnqk,bknh->bqnh", probs, v)
        out = jnp.einsum("btnh,nhe->bte", ctx, self.wo[...].astype(dt)) + self.bo[...].astype(dt)
        return self.norm(x + out)


class Layer(nnx.Module):
    def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
        self.attention = Attention(cfg, rngs)
        self.intermediate = Dense(cfg.hidden_size, cfg.intermediate_size, ("embed", "mlp"), rngs)
        self.output = Dense(cfg.intermediate_size, cfg.hidden_size, ("mlp", "embed"), rngs)
        self.output_norm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, rngs)
        self.act = cfg.hidden_act

    def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
        h = self.attention(x, bias)
        return self.output_norm(h + self.output(_ACTIVATIONS[self.act](self.intermediate(h))))


class BertEncoder(nnx.Module):
    """transformers' BertModel (+ pooler / DPR projection), as a Flax NNX module."""

    def __init__(self, cfg: BertConfig, rngs: nnx.Rngs, dtype="float32"):
        e = cfg.hidden_size
        self.word_embeddings = _param(rngs, (cfg.vocab_size, e), ("vocab", "embed"))
        self.position_embeddings = _param(rngs, (cfg.max_position, e), (None, "embed"))
        self.token_type_embeddings = _param(rngs, (cfg.type_vocab_size, e), (None, "embed"))
        self.embed_norm = LayerNorm(e, cfg.layer_norm_eps, rngs)
        self.layers = nnx.List([Layer(cfg, rngs) for _ in range(cfg.num_layers)])
        self.pooler = Dense(e, e, ("embed", "embed_out"), rngs) if cfg.with_pooler else None
        self.projection = Dense(e, cfg.projection_dim, ("embed", "embed_out"), rngs) if cfg.projection_dim else None
        self.cfg = cfg
        self.dtype = dtype

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """input_ids, attention_mask [b, t] -> last hidden states [b, t, e]."""
        dt = jnp.dtype(self.dtype)
        t = input_ids.shape[1]
        x = (jnp.take(self.word_embeddings[...], input_ids, axis=0)
             + self.position_embeddings[...][:t][None] + self.token_type_embeddings[...][0])
        x = self.embed_norm(x).astype(dt)
        bias = jnp.where(attention_mask[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)
        for layer in self.layers:
            x = layer(x, bias)
        return x


def pool(model: BertEncoder, hidden: jax.Array, mask: jax.Array, mode: str, normalize: bool) -> jax.Array:
    """hidden [b, t, e], mask [b, t] -> sentence embeddings [b, output_dim] float32."""
    hidden = hidden.astype(jnp.float32)
    m = mask[..., None].astype(jnp.float32)
    if mode == "mean":
        out = (hidden * m).sum(1) / jnp.maximum(m.sum(1), 1e-9)  # sentence-transformers' clamp
    elif mode == "max":
        out = jnp.where(m > 0, hidden, -1e9).max(1)
    else:  # cls / pooler
        out = hidden[:, 0]
        if mode == "pooler":
            out = jnp.tanh(model.pooler(out))
    if model.projection is not None:
        out = model.projection(out)
    if normalize:
        out = out / jnp.maximum(jnp.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
    return out
