"""A slot pool for continuous batching: one KV cache whose rows are independent requests.

`sampler.DecodeState` keeps one cache column shared by every row, which suits a batch that starts
together. A server's rows start and finish at different steps, so the pool keeps, per row, its own
next free cache column (`write`) and position, in the same per-layer cache layout
(`models.kv_cache.LayerCache`, [slots * kv_heads, length, head_dim]):

    insert(pool, state, row)              a batch-1 prefill (`sampler.extend`) becomes row `row`
    prefill_row(decoder, pool, row, ...)  appends a left-padded chunk to one row (knowledge, tail)
    steps(decoder, pool, live, ...)       decode steps until a row ends (or a step count): each
                                          picks every live row's next token and appends it, one
                                          forward pass over every slot, the cache read once

A row is a batch-1 `DecodeState` (leading axis = slot), so a step is `sampler._extend` mapped
over the slots and a row's tokens land in the same columns, at the same positions, as in a
batch of its own. Every call takes the pool donated (updated in place; use the one returned).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrag.decode.sampler import NO_TOKEN, DecodeState, _extend, nucleus
from jaxrag.models.decoder import Decoder, init_cache
from jaxrag.models.kv_cache import KVCache, LayerCache


class SlotPool(NamedTuple):
    cache: KVCache  # one LayerCache per layer: [slots * kv_heads, length, head_dim]
    key_mask: jax.Array  # [slots, length] bool: columns holding each row's real tokens
    next_pos: jax.Array  # [slots] int32: position id of each row's next token
    write: jax.Array  # [slots] int32: each row's next free cache column
    logits: jax.Array  # [slots, vocab] float32: next-token logits after each row's last token


def init_pool(decoder: Decoder, slots: int, length: int) -> SlotPool:
    cfg = decoder.cfg
    return SlotPool(init_cache(cfg, slots, length), jnp.zeros((slots, length), bool),
                    jnp.zeros((slots,), jnp.int32), jnp.zeros((slots,), jnp.int32),
                    jnp.zeros((slots, cfg.padded_vocab_size), jnp.float32))


def _rows(pool: SlotPool) -> DecodeState:
    """The pool as batch-1 states stacked on a leading slot axis (free reshapes)."""
    n, length = pool.key_mask.shape
    split = lambda buf: buf.reshape(n, buf.shape[0] // n, length, buf.shape[-1])
    cache = tuple(LayerCache(split(c.k), split(c.v)) for c in pool.cache)
    return DecodeState(cache, pool.key_mask[:, None], pool.next_pos[:, None], pool.write, pool.logits[:, None])


def _pool(rows: DecodeState) -> SlotPool:
    merge = lambda buf: buf.reshape(-1, *buf.shape[2:])
    cache = tuple(LayerCache(merge(c.k), merge(c.v)) for c in rows.cache)
    return SlotPool(cache, rows.key_mask[:, 0], rows.next_pos[:, 0], rows.slot, rows.logits[:, 0])


@partial(jax.jit, donate_argnums=0)
def insert(pool: SlotPool, state: DecodeState, row) -> SlotPool:
    """Row `row` of the pool becomes the batch-1 `state` (its cache columns from 0; the pool's
    longer rows keep the rest masked)."""
    rows, one = _rows(pool), state
    put = lambda whole, part: jax.lax.dynamic_update_index_in_dim(
        whole, jnp.zeros(whole.shape[1:], whole.dtype).at[tuple(slice(0, d) for d in part.shape)].set(part), row, 0)
    cache = tuple(LayerCache(put(p.k, s.k), put(p.v, s.v)) for p, s in zip(rows.cache, one.cache))
    return _pool(DecodeState(cache, put(rows.key_mask, one.key_mask), rows.next_pos.at[row].set(one.next_pos),
                             rows.slot.at[row].set(one.slot), rows.logits.at[row].set(one.logits)))


@partial(nnx.jit, donate_argnums=1)
def prefill_row(decoder: Decoder, pool: SlotPool, row, ids, mask) -> SlotPool:
    """Appends a left-padded chunk ids/mask [1, t] to row `row`'s cache (one forward pass)."""
    rows = _rows(pool)
    one = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, row, keepdims=False), rows)
    one, _ = _extend(decoder, one, ids, mask)
    return _pool(jax.tree.map(lambda whole, x: jax.lax.dynamic_update_index_in_dim(whole, x, row, 0), rows, one))


def sample_rows(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits [slots, vocab] -> token ids [slots]: greedy where temperature is 0, else a draw
    from the row's top-p nucleus (`sampler.nucleus`) at its temperature."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = temperature > 0

    def draw():
        scaled = logits / jnp.where(sampled, temperature, 1.0)[:, None]
        return jax.random.categorical(key, nucleus(scaled, top_p[:, None]), axis=-1).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(sampled), draw, lambda: greedy)
    return jnp.where(sampled, drawn, greedy)


@partial(nnx.jit, static_argnames=("max_steps",), donate_argnums=1)
def steps(decoder: Decoder, pool: SlotPool, live, stop_ids, budget, temperature, top_p, key, max_steps: int):
    """Decode steps over every slot in a `lax.while_loop`, until a live row ends (emits one of its
    `stop_ids` [slots, n], NO_TOKEN-padded, or reaches its `budget` [slots] of tokens) or after
    `max_steps`: each step picks each live row's next token (`sample_rows`) and appends it to the
    row's cache; other rows keep their state. A row's tokens are those of `sampler.decode` for it
    alone. Returns (pool, tokens [slots, max_steps] (NO_TOKEN where none), steps run)."""
    slots = budget.shape[0]

    def cond(carry):
        step, _, _, ended = carry
        return (step < max_steps) & ~jnp.any(ended)

    def body(carry):
        step, pool, tokens, _ = carry
        tok = sample_rows(pool.logits, jax.random.fold_in(key, step), temperature, top_p)
        rows = _rows(pool)
        new = jax.vmap(lambda st, i, m: _extend(decoder, st, i, m)[0])(
            rows, jnp.where(live, tok, 0)[:, None, None], live[:, None, None])
        # An idle row's state is kept: its column is not consumed (what was written there stays masked).
        pool = _pool(new._replace(slot=jnp.where(live, new.slot, rows.slot)))
        tokens = tokens.at[:, step].set(jnp.where(live, tok, NO_TOKEN))
        ended = live & (jnp.any(tok[:, None] == stop_ids, axis=-1) | (step + 1 >= budget))
        return step + 1, pool, tokens, ended

    init = (jnp.zeros((), jnp.int32), pool, jnp.full((slots, max_steps), NO_TOKEN, jnp.int32), jnp.zeros((slots,), bool))
    count, pool, tokens, _ = jax.lax.while_loop(cond, body, init)
    return pool, tokens, count
