"""One Flax NNX decoder for Qwen2/Qwen2.5, Llama-2 (and Llama-3 RoPE) and Phi-3/3.5.

The families differ only in config: q/k/v bias (Qwen2), RoPE scaling (Llama-3, Phi-3 LongRoPE),
tied embeddings, sliding window. Phi-3's fused `qkv_proj` / `gate_up_proj` checkpoints are split
into q/k/v and gate/up at import (and fused back at export), so one layer layout serves all
families and tensor parallelism can shard heads without cutting across a fused matrix.

Every parameter carries logical axis names (`out_sharding` metadata); `jaxrag.sharding` maps them
to mesh axes by rules.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrag.models.rope import RopeConfig, apply_rope, rope_cos_sin

FAMILIES = ("qwen2", "llama", "phi3")
_MASKED_LOGIT = -1e9  # finite, so 0 * log p stays 0 in losses


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Static architecture of a decoder (hashable: jitted functions close over it)."""

    family: str
    vocab_size: int  # real vocabulary (HF `vocab_size`); logits beyond it are masked
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    qkv_bias: bool = False
    o_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    vocab_multiple: int = 128  # pad the vocab so it shards evenly over any mesh axis
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"  # master weights

    @property
    def padded_vocab_size(self) -> int:
        m = self.vocab_multiple
        return -(-self.vocab_size // m) * m


def resolve_dtype(name: str):
    """`auto` = bfloat16 on accelerators, float32 on CPU."""
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return jnp.dtype(name)


def _param(rngs: nnx.Rngs, shape, axes, dtype, init=nnx.initializers.normal(0.02)):
    # Axis names are metadata only; placement happens in `jaxrag.sharding` by rules.
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype, rngs: nnx.Rngs):
        self.scale = _param(rngs, (dim,), ("norm",), param_dtype, nnx.initializers.ones)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        # Normalise in float32 and cast back before the scale, as the reference does.
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * x32.astype(x.dtype)


class KVLayerCache(NamedTuple):
    k: jax.Array  # [batch, cache_len, kv_heads, head_dim]
    v: jax.Array


class Attention(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        e, n, kv, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pd = resolve_dtype(cfg.param_dtype)
        self.wq = _param(rngs, (e, n, h), ("embed", "q_heads", "head_dim"), pd)
        self.wk = _param(rngs, (e, kv, h), ("embed", "kv_heads", "head_dim"), pd)
        self.wv = _param(rngs, (e, kv, h), ("embed", "kv_heads", "head_dim"), pd)
        self.wo = _param(rngs, (n, h, e), ("q_heads", "head_dim", "embed"), pd)
        zeros = nnx.initializers.zeros
        if cfg.qkv_bias:
            self.bq = _param(rngs, (n, h), ("q_heads", "head_dim"), pd, zeros)
            self.bk = _param(rngs, (kv, h), ("kv_heads", "head_dim"), pd, zeros)
            self.bv = _param(rngs, (kv, h), ("kv_heads", "head_dim"), pd, zeros)
        if cfg.o_bias:
            self.bo = _param(rngs, (e,), ("embed",), pd, zeros)
        self.cfg = cfg

    def _project(self, x, w, bias_name):
        y = jnp.einsum("bte,enh->btnh", x, w[...].astype(x.dtype))
        if hasattr(self, bias_name):
            y = y + getattr(self, bias_name)[...].astype(x.dtype)
        return y

    def __call__(self, x, cos, sin, mask, cache: KVLayerCache | None, cache_index):
        """x [b, t, e]; mask [b, 1, t, s] bool -> ([b, t, e], updated cache or None)."""
        q = apply_rope(self._project(x, self.wq, "bq"), cos, sin)
        k = apply_rope(self._project(x, self.wk, "bk"), cos, sin)
        v = self._project(x, self.wv, "bv")
        if cache is not None:
            start = (0, cache_index, 0, 0)
            cache = KVLayerCache(
                jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), start),
                jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), start),
            )
            k, v = cache.k.astype(x.dtype), cache.v.astype(x.dtype)
        out = jax.nn.dot_product_attention(q, k, v, mask=mask)  # grouped-query aware
        y = jnp.einsum("btnh,nhe->bte", out, self.wo[...].astype(x.dtype))
        if self.cfg.o_bias:
            y = y + self.bo[...].astype(x.dtype)
        return y, cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        e, f, pd = cfg.hidden_size, cfg.intermediate_size, resolve_dtype(cfg.param_dtype)
        self.w_gate = _param(rngs, (e, f), ("embed", "mlp"), pd)
        self.w_up = _param(rngs, (e, f), ("embed", "mlp"), pd)
        self.w_down = _param(rngs, (f, e), ("mlp", "embed"), pd)

    def __call__(self, x):
        gate = x @ self.w_gate[...].astype(x.dtype)
        up = x @ self.w_up[...].astype(x.dtype)
        return (jax.nn.silu(gate) * up) @ self.w_down[...].astype(x.dtype)


class Block(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        pd = resolve_dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, cos, sin, mask, cache, cache_index):
        h, cache = self.attn(self.attn_norm(x), cos, sin, mask, cache, cache_index)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """[batch, seq] 0/1 -> position ids counting real tokens only (left or right padding)."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
    """[batch, seq] int (0 = padding, k = k-th packed document) -> each token's position within
    its own document, counting its real tokens only; one segment equals `positions_from_mask`."""
    same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] > 0)
    causal = jnp.tril(jnp.ones(same.shape[1:], bool))
    return jnp.maximum(jnp.sum(same & causal, axis=-1) - 1, 0)


def attention_mask_4d(key_mask, query_len: int, cache_index, sliding_window: int | None,
                      segment_ids: jax.Array | None = None):
    """key_mask [b, s] bool -> [b, 1, t, s]: causal by slot index, padding, optional window,
    and with `segment_ids` [b, t] (no cache) only keys of the query's own packed document.

    Query t sits at slot `cache_index + t` of the key axis (0 without a cache).
    """
    s = key_mask.shape[-1]
    q_slot = cache_index + jnp.arange(query_len)[:, None]
    k_slot = jnp.arange(s)[None, :]
    allowed = k_slot <= q_slot
    if sliding_window is not None:
        allowed &= q_slot - k_slot < sliding_window
    allowed = allowed[None] & key_mask[:, None, :].astype(bool)
    if segment_ids is not None:
        allowed &= segment_ids[:, :, None] == segment_ids[:, None, :]
    return allowed[:, None]


class DecoderOutput(NamedTuple):
    logits: jax.Array  # [batch, seq | k, padded_vocab] float32; padded ids masked
    hidden: jax.Array | None  # [batch, seq, hidden] output of the requested layer
    cache: list[KVLayerCache] | None


class Decoder(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        if cfg.family not in FAMILIES:
            raise ValueError(f"unknown family {cfg.family!r}; supported: {FAMILIES}")
        pd = resolve_dtype(cfg.param_dtype)
        v, e = cfg.padded_vocab_size, cfg.hidden_size
        self.embed = _param(rngs, (v, e), ("vocab", "embed"), pd)
        self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(e, cfg.rms_norm_eps, pd, rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (e, v), ("embed", "vocab"), pd)
        self.cfg = cfg

    def __call__(
        self,
        input_ids: jax.Array,  # [batch, seq] int
        positions: jax.Array,  # [batch, seq] int
        key_mask: jax.Array,  # [batch, keys] bool: keys = seq, or cache length with a cache
        *,
        cache: list[KVLayerCache] | None = None,
        cache_index: jax.Array | int = 0,
        hidden_layer: int | None = None,
        segment_ids: jax.Array | None = None,  # [batch, seq] int: packed documents (no cache)
        logit_positions: jax.Array | None = None,  # [batch, k] int
    ) -> DecoderOutput:
        """`hidden_layer` l returns transformers' `hidden_states[l]`: 0 = embeddings, l = output
        of decoder layer l (1-based), num_layers = after the final norm. With `segment_ids`, a
        token attends only within its own packed document. `logit_positions`: logits [batch, k, v]
        at those positions only. A prefill needs one column and a loss only its targets; the
        head over every position is a third of a small model's compute and [t, vocab] floats
        per row on a big one."""
        cfg, dtype = self.cfg, resolve_dtype(self.cfg.dtype)
        x = jnp.take(self.embed[...], input_ids, axis=0).astype(dtype)
        cos, sin = rope_cos_sin(cfg.rope, positions, dtype)
        mask = attention_mask_4d(key_mask, input_ids.shape[1], cache_index, cfg.sliding_window, segment_ids)
        hidden = x if hidden_layer == 0 else None
        new_cache = [] if cache is not None else None
        for i, block in enumerate(self.layers):
            x, layer_cache = block(x, cos, sin, mask, cache[i] if cache else None, cache_index)
            if cache is not None:
                new_cache.append(layer_cache)
            if hidden_layer == i + 1 and i + 1 < cfg.num_layers:
                hidden = x
        if logit_positions is not None:
            x = jnp.take_along_axis(x, logit_positions[..., None], axis=1)
        x = self.final_norm(x)
        if hidden_layer == cfg.num_layers:
            hidden = x
        head = self.embed[...].T if cfg.tie_word_embeddings else self.lm_head[...]
        logits = jnp.einsum("bte,ev->btv", x, head.astype(dtype), preferred_element_type=jnp.float32)
        real = jnp.arange(cfg.padded_vocab_size) < cfg.vocab_size
        return DecoderOutput(jnp.where(real, logits, _MASKED_LOGIT), hidden, new_cache)


def init_cache(cfg: DecoderConfig, batch: int, length: int, dtype=None) -> list[KVLayerCache]:
    """Zeroed static-shape KV cache, one entry per layer."""
    dtype = dtype or resolve_dtype(cfg.dtype)
    shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
    return [KVLayerCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)]
