"""Positions and attention masks of padded, cached and packed batches: what the decoder's
attention, training's packed batches and scoring's prompts agree on."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
                      segment_ids: jax.Array | None = None, branch_ids: jax.Array | None = None):
    """key_mask [b, s] bool -> [b, 1, t, s]: causal by slot index, padding, optional window,
    and with `segment_ids` [b, t] (no cache) only keys of the query's own packed document; with
    `branch_ids` [b, t] too, a document is a shared prefix (branch 0) and branches (1, 2, ...)
    packed after it, and a branch's query sees the prefix and its own branch only (the slot
    distance a window counts is then at least the position distance). Each query also sees its
    own slot, so no row is empty.

    Query t sits at slot `cache_index + t` of the key axis (0 without a cache). A single query
    (a decode step) sees every key its row holds, wherever it sits: no key of a cache is ahead
    of the step writing it, and a slot pool's cache is a ring (`decode.slots`) whose older
    columns may follow the newest; a window counts the slots back around the ring.
    """
    s = key_mask.shape[-1]
    q_slot = cache_index + jnp.arange(query_len)[:, None]
    k_slot = jnp.arange(s)[None, :]
    back = (q_slot - k_slot) % s if query_len == 1 else q_slot - k_slot
    allowed = back >= 0
    if sliding_window is not None:
        allowed &= back < sliding_window
    allowed = allowed[None] & key_mask[:, None, :].astype(bool)
    if segment_ids is not None:
        allowed &= segment_ids[:, :, None] == segment_ids[:, None, :]
    if branch_ids is not None:
        allowed &= (branch_ids[:, None, :] == 0) | (branch_ids[:, :, None] == branch_ids[:, None, :])
    # Every query sees its own slot (real ones already do): a padding query would otherwise see no
    # key. On such a row cuDNN's forward equals XLA's but its backward does not (H100: |dv| 1744
    # vs 1.7), and a padding position whose next token is real does get a gradient: the decoder's
    # LM-loss gradient came out 1e17 off. Seeing itself, the row is well defined on both paths.
    allowed |= (k_slot == q_slot)[None]
    return allowed[:, None]
