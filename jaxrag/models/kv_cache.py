"""The KV cache generation keeps per layer, and attention over it.

Each layer's keys and values are buffers of their own (`LayerCache`), so a decode step writes
its slot in place and the attention matmuls read the buffer where it lies: no copy of a layer's
cache, no slice of a stacked one, per step (`tests/test_decode_hlo.py` checks the compiled step).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class LayerCache(NamedTuple):
    """One layer's keys and values, each a buffer of its own, updated in place per step. Rows and
    KV heads have axes of their own, so a mesh splits rows over its batch axes and heads over
    `tensor` (`jaxrag.sharding.cache_sharding`); the attention matmuls batch over both. One row
    has no row axis: XLA-CPU drops an axis of size 1 from the matmuls, reads the freshly written
    buffer through another shape, and then writes it twice and copies the whole cache."""
    k: jax.Array  # [batch, kv_heads, slots, head_dim], or [kv_heads, slots, head_dim] for one row
    v: jax.Array  # as k


KVCache = tuple[LayerCache, ...]  # one per layer


def cached_attention(q, cache: LayerCache, mask) -> jax.Array:
    """q [b, t, heads, h] over a layer's cache (this chunk written) -> [b, t, heads, h]: what
    `jax.nn.dot_product_attention` computes on XLA (float32 logits and softmax, the same mask),
    as grouped-query matmuls that read the cache in place, in its own shape. The softmax is
    normalised after the value matmul, on its small output: every pass over the [.., slots]
    scores is a read of ~g/h of the cache's bytes per step."""
    b, t, n, h = q.shape
    lead = cache.k.shape[:-2]  # (b, kv), or (kv,) for one row
    kv = lead[-1]
    g, f32 = n // kv, jnp.float32
    qg = q.reshape(b, t, kv, g, h).transpose(0, 2, 3, 1, 4).reshape(*lead, g * t, h)
    logits = jnp.einsum("...qh,...sh->...qs", qg, cache.k.astype(q.dtype), preferred_element_type=f32)
    logits = logits.reshape(b, kv, g, t, -1) * f32(1.0 / math.sqrt(h))
    logits = jnp.where(mask[:, :, None], logits, f32(-0.7 * jnp.finfo(f32).max))  # mask [b, 1, t, s]
    weights = jnp.exp(logits - jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True))).astype(q.dtype)
    total = weights.astype(f32).sum(axis=-1)[..., None]  # [b, kv, g, t, 1]
    out = jnp.einsum("...qs,...sh->...qh", weights.reshape(*lead, g * t, -1), cache.v.astype(q.dtype),
                     preferred_element_type=f32)
    out = (out.reshape(b, kv, g, t, h) / total).astype(q.dtype)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)
