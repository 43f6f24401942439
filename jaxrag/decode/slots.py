"""A slot pool for continuous batching: one KV cache whose rows are independent requests.

`sampler.DecodeState` keeps one cache column shared by every row, which suits a batch that starts
together. A server's rows start and finish at different steps, so the pool keeps, per row, its own
next free cache column (`write`) and position, in the same per-layer cache layout
(`models.kv_cache.LayerCache`, [slots, kv_heads, length, head_dim]: each row's cache is a
batch-1 cache, [kv_heads, length, head_dim], stacked):

    admit_rows(decoder, pool, rows, ...)    question prefills, each on a fresh batch-1 state
                                            (`sampler.extend`), become rows `rows`
    prefill_rows(decoder, pool, rows, ...)  appends a left-padded chunk to each of rows `rows`
                                            (source token, knowledge, tail)
    steps(decoder, pool, live, ...)         decode steps until a row ends (or a step count): each
                                            picks every live row's next token and appends it, one
                                            forward pass over every slot, the cache read once

A row is a batch-1 `DecodeState` (leading axis = slot), so a step is `sampler._extend` mapped
over the slots and a row's tokens land in the same columns, at the same positions, as in a
batch of its own. `admit_rows` and `prefill_rows` map it over the rows they are given, so that
requests changing phase together share one call; their `rows` [R] may be padded with indices past
the pool (such a row reads a real one and is never written). Every call takes the pool donated
(updated in place; use the one returned).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrag.decode.sampler import (NO_TOKEN, DecodeState, _extend, cache_shardings, init_state, nucleus, placement,
                                   zeros_on)
from jaxrag.errors import JaxragError
from jaxrag.models.decoder import Decoder, init_cache
from jaxrag.models.kv_cache import KVCache, LayerCache
from jaxrag.sharding import batch_sharding, data_parallel_size


class SlotPool(NamedTuple):
    cache: KVCache  # one LayerCache per layer: [slots, kv_heads, length, head_dim]
    key_mask: jax.Array  # [slots, length] bool: columns holding each row's real tokens
    next_pos: jax.Array  # [slots] int32: position id of each row's next token
    write: jax.Array  # [slots] int32: each row's next free cache column
    logits: jax.Array  # [slots, vocab] float32: next-token logits after each row's last token


def _zero_pool(decoder: Decoder, slots: int, length: int) -> SlotPool:
    cfg = decoder.cfg
    row = init_cache(cfg, 1, length)  # each slot's cache is a batch-1 cache, stacked
    cache = tuple(LayerCache(*(jnp.zeros((slots, *x.shape), x.dtype) for x in c)) for c in row)
    return SlotPool(cache, jnp.zeros((slots, length), bool),
                    jnp.zeros((slots,), jnp.int32), jnp.zeros((slots,), jnp.int32),
                    jnp.zeros((slots, cfg.padded_vocab_size), jnp.float32))


def init_pool(decoder: Decoder, slots: int, length: int) -> SlotPool:
    """A zeroed pool placed as the decoder is (`sampler.placement`): slots over the mesh's batch
    axes (`slots` a multiple of their size), KV heads over `tensor`; created on the devices."""
    mesh = placement(decoder)
    if mesh is None:
        return _zero_pool(decoder, slots, length)
    if slots % data_parallel_size(mesh):
        raise JaxragError(f"{slots} slots: must be a multiple of the model's data axis ({data_parallel_size(mesh)} "
                          "devices), each of which holds its share of the slots")
    shapes = jax.eval_shape(lambda: _zero_pool(decoder, slots, length))
    rows = batch_sharding(mesh)
    return zeros_on(shapes, SlotPool(cache_shardings(mesh, shapes.cache), rows, rows, rows, rows))


def _rows(pool: SlotPool) -> DecodeState:
    """The pool as batch-1 states stacked on a leading slot axis (free reshapes; the caches are
    batch-1 caches stacked already)."""
    return DecodeState(pool.cache, pool.key_mask[:, None], pool.next_pos[:, None], pool.write, pool.logits[:, None])


def _pool(rows: DecodeState) -> SlotPool:
    return SlotPool(rows.cache, rows.key_mask[:, 0], rows.next_pos[:, 0], rows.slot, rows.logits[:, 0])


def _gather(pool: SlotPool, rows) -> DecodeState:
    """Pool rows `rows` [R] as stacked batch-1 states (an index past the pool reads the last row)."""
    return jax.tree.map(lambda x: jnp.take(x, rows, axis=0, mode="clip"), _rows(pool))


def _scatter(pool: SlotPool, rows, part: DecodeState) -> SlotPool:
    """`part`'s stacked batch-1 states written to pool rows `rows`; indices past the pool dropped."""
    return _pool(jax.tree.map(lambda whole, x: whole.at[rows].set(x, mode="drop"), _rows(pool), part))


@partial(nnx.jit, static_argnames=("length", "hidden_layer"), donate_argnums=1)
def admit_rows(decoder: Decoder, pool: SlotPool, rows, ids, mask, length: int, hidden_layer: int):
    """Question prefills: row i of the left-padded ids/mask [R, t] is extended onto a fresh batch-1
    state of `length` cache columns (what `route` runs for that question alone) and becomes pool
    row rows[i], its columns from 0 (the pool's longer rows keep the rest masked). Returns (pool,
    each row's next-token logits [R, vocab], `hidden_layer`'s state at its last token [R, hidden])."""
    fresh = init_state(decoder, 1, length)
    new, hidden = jax.vmap(lambda i, m: _extend(decoder, fresh, i, m, hidden_layer))(ids[:, None], mask[:, None])
    width = pool.key_mask.shape[1]
    pad = lambda x, axis: jnp.pad(x, [(0, width - length if a == axis else 0) for a in range(x.ndim)])
    new = new._replace(cache=tuple(LayerCache(pad(c.k, 2), pad(c.v, 2)) for c in new.cache),
                       key_mask=pad(new.key_mask, 2))
    return _scatter(pool, rows, new), new.logits[:, 0], hidden[:, 0]


@partial(nnx.jit, donate_argnums=1)
def prefill_rows(decoder: Decoder, pool: SlotPool, rows, ids, mask) -> SlotPool:
    """Appends row i of the left-padded chunks ids/mask [R, t] to pool row rows[i], as
    `sampler.extend` appends it to that row alone (one forward pass over the R rows)."""
    new = jax.vmap(lambda st, i, m: _extend(decoder, st, i, m)[0])(_gather(pool, rows), ids[:, None], mask[:, None])
    return _scatter(pool, rows, new)


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
