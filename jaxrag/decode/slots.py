"""A slot pool for continuous batching: one KV cache whose rows are independent requests, each
running SR-RAG's phases on the device.

The pool is one `sampler.DecodeState` over `slots` rows whose cache is a ring: every step writes
one column, the ring's head, for every row (a `dynamic_update_slice`, as `sampler.decode` writes
its shared column), so a step reads each cache byte once and moves nothing else. A row's columns
are those written since it entered, ending at the head; keys carry their positions (RoPE is
applied when they are written) and a single query attends to every key its row holds wherever it
sits in the ring (`models.masks.attention_mask_4d`), so a row reads what it would read alone.

    admit(decoder, parking, rows, ids, mask, ...)   question prefills, each on a fresh batch-1
                                                     state as `routing.route` runs it alone; the
                                                     prompts wait in `parking` (rows `rows`) while
                                                     the policy picks their sources and a
                                                     retrieved row's passages come
    enter(decoder, pool, parking, rows, parked, ...) each parked row's source token (and its
                                                     knowledge chunk) appended, the row placed in
                                                     the ring ending at the head, its program set
    steps(decoder, pool, stop, ...)                  decode steps over every slot until a row
                                                     ends or a step count (rows `stop` idle)
    steps(..., parking=, queue=Queue(...))           the same, an idle row taking the next prompt
                                                     parked ahead before each step, on the device
                                                     (`engine.generate`: no host between rows)

A row's program runs on the device: a `<Self>` row samples its verbalization until `<EOK>`/EOS or
its budget, is fed `<EOK> Answer:` (without `<EOK>` when it wrote one), then samples its answer;
a row that entered with its knowledge (passages, or none) samples its answer at once. Only a
retrieved row leaves the device between phases: it waits in `parking` for its passages.

Sampling is keyed per row and phase (`stage_keys`): a row draws what `route` draws for it alone
with the same key, whatever else is in the pool. Every call takes the pool donated (updated in
place; use the one returned).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jaxrag.decode.sampler import NO_TOKEN, DecodeState, _extend, init_state, placement, zeros_on
from jaxrag.decode.sampling import nucleus, row_keys
from jaxrag.errors import JaxragError
from jaxrag.models.decoder import Decoder, init_cache
from jaxrag.models.kv_cache import LayerCache
from jaxrag.sharding import batch_sharding, cache_sharding, data_parallel_size, replicated

IDLE, VERBAL, ANSWER = 0, 1, 2  # a row's stage
FORCED = 3  # the kind of a step's token that was fed, not sampled (`<EOK> Answer:`)


class SlotPool(NamedTuple):
    state: DecodeState  # [slots] rows; state.slot is the ring's head, the column the next step writes
    stage: jax.Array  # [slots] int32: IDLE, VERBAL or ANSWER
    count: jax.Array  # [slots] int32: tokens sampled in the stage
    fed: jax.Array  # [slots] int32: tokens of the tail `<EOK> Answer:` fed so far (its length: none pending)
    budget: jax.Array  # [slots, 2] int32: the row's verbalization and answer budgets
    temperature: jax.Array  # [slots] float32 (0 = greedy)
    top_p: jax.Array  # [slots] float32
    keys: jax.Array  # [slots, 2, key words] uint32: the row's verbalization and answer keys


def _stacked_rows(decoder: Decoder, rows: int, length: int) -> DecodeState:
    """`rows` zeroed batch-1 states of `length` columns, stacked on a leading axis."""
    cfg = decoder.cfg
    one = init_cache(cfg, 1, length)  # each row's cache is a batch-1 cache, stacked
    cache = tuple(LayerCache(*(jnp.zeros((rows, *x.shape), x.dtype) for x in c)) for c in one)
    return DecodeState(cache, jnp.zeros((rows, 1, length), bool), jnp.zeros((rows, 1), jnp.int32),
                       jnp.zeros((rows,), jnp.int32), jnp.zeros((rows, 1, cfg.padded_vocab_size), jnp.float32))


def _zero_pool(decoder: Decoder, slots: int, length: int) -> SlotPool:
    rows = _stacked_rows(decoder, slots, length)
    state = DecodeState(rows.cache, rows.key_mask[:, 0], rows.next_pos[:, 0], jnp.zeros((), jnp.int32),
                        rows.logits[:, 0])
    words = jax.random.key_data(jax.random.key(0)).shape
    zeros = lambda *shape, dtype=jnp.int32: jnp.zeros((slots, *shape), dtype)
    return SlotPool(state, zeros(), zeros(), zeros(), zeros(2), zeros(dtype=jnp.float32), zeros(dtype=jnp.float32),
                    zeros(2, *words, dtype=jnp.uint32))


def _placed(decoder: Decoder, slots: int, make):
    """make() built on the decoder's devices: rows over the mesh's batch axes, KV heads over `tensor`;
    on one device, committed to it, as every call's outputs are, so that the first call runs the
    program every later call runs instead of compiling one of its own."""
    mesh = placement(decoder)
    if mesh is None:
        where = getattr(jax.tree.leaves(nnx.state(decoder, nnx.Param))[0], "sharding", None)
        return jax.device_put(make(), where) if isinstance(where, SingleDeviceSharding) else make()
    if slots % data_parallel_size(mesh):
        raise JaxragError(f"{slots} slots: must be a multiple of the model's data axis ({data_parallel_size(mesh)} "
                          "devices), each of which holds its share of the slots")
    shapes = jax.eval_shape(make)
    # The 4-D leaves are the KV caches ([rows, kv_heads, columns, head_dim]); the scalar head is whole.
    def where(x):
        if x.ndim == 4:
            return cache_sharding(mesh, x.shape)
        return replicated(mesh) if x.ndim == 0 else batch_sharding(mesh)
    return zeros_on(shapes, jax.tree.map(where, shapes))


def init_pool(decoder: Decoder, slots: int, length: int) -> SlotPool:
    """A zeroed pool of `slots` rows of `length` ring columns, placed as the decoder is."""
    return _placed(decoder, slots, lambda: _zero_pool(decoder, slots, length))


def init_parking(decoder: Decoder, slots: int, width: int) -> DecodeState:
    """Where admitted prompts wait to enter the pool: `slots` batch-1 states of `width` columns
    (the longest prompt bucket), stacked, placed as the pool."""
    return _placed(decoder, slots, lambda: _stacked_rows(decoder, slots, width))


@jax.jit
def stage_keys(rng: jax.Array, row_ids) -> jax.Array:
    """[rows, 2, key words] uint32: each row's verbalization and answer keys, as `route` keys its
    phases (`rng` folded with the phase, then with the row's id: `sampling.row_keys`)."""
    return jnp.stack([jax.random.key_data(row_keys(jax.random.fold_in(rng, phase), row_ids)) for phase in (0, 1)], 1)


def _fit_columns(state: DecodeState, width: int) -> DecodeState:
    """Stacked batch-1 states cut or zero-padded to `width` columns (the cut ones hold no token)."""
    def fit(x, axis):
        x = jax.lax.slice_in_dim(x, 0, min(width, x.shape[axis]), axis=axis)
        return jnp.pad(x, [(0, width - x.shape[axis] if a == axis else 0) for a in range(x.ndim)])
    return state._replace(cache=tuple(LayerCache(fit(c.k, 2), fit(c.v, 2)) for c in state.cache),
                          key_mask=fit(state.key_mask, 2))


@partial(nnx.jit, static_argnames=("length", "hidden_layer", "chunk"), donate_argnums=1)
def admit(decoder: Decoder, parking: DecodeState, rows, ids, mask, length: int, hidden_layer: int | None,
          chunk: int | None = None):
    """Question prefills: row i of the left-padded ids/mask [R, t] is extended onto a fresh batch-1
    state of `length` cache columns (what `route` runs for that question alone) and parked in
    parking row rows[i] (an index past the parking is dropped); `chunk` columns per pass (None: the
    whole prompt in one), as `sampler.generate` prefills a long prompt. Returns (parking, each
    row's next-token logits [R, vocab], `hidden_layer`'s state at its last token [R, hidden], or
    None without a layer)."""
    fresh, width = init_state(decoder, 1, length), ids.shape[1]
    step = chunk or width

    def prefill(i, m):
        state, hidden = fresh, None
        for start in range(0, width, step):  # whole chunks, the last one maybe shorter
            state, hidden = _extend(decoder, state, i[:, start:start + step], m[:, start:start + step], hidden_layer)
        return state, hidden

    new, hidden = jax.vmap(prefill)(ids[:, None], mask[:, None])
    new = _fit_columns(new, parking.key_mask.shape[-1])
    parking = jax.tree.map(lambda whole, x: whole.at[rows].set(x, mode="drop"), parking, new)
    return parking, new.logits[:, 0], None if hidden is None else hidden[:, 0]


@partial(nnx.jit, donate_argnums=1)
def enter(decoder: Decoder, pool: SlotPool, parking: DecodeState, rows, parked, source, ids, mask, stage, budget,
          temperature, top_p, keys) -> SlotPool:
    """Parking rows `parked` [R] enter the pool as rows `rows` [R]: each one's `source` token [R] and
    then its left-padded chunk ids/mask [R, w] (w may be 0: a `<Self>` row's knowledge is its
    own) are appended as `route` appends them alone, and the row is placed in the ring with its
    last column just before the head; `source` None appends nothing (a prompt's plain
    continuation, sampled from its prompt's last logits). Its program: `stage` [R] (VERBAL or
    ANSWER), `budget` [R, 2] (verbalization, answer), `temperature`, `top_p` [R], `keys` [R, 2,
    words] (`stage_keys`).
    Indices past the pool or the parking are padding: they read a real row and are never written."""
    width = pool.state.key_mask.shape[-1]
    parked = _fit_columns(jax.tree.map(lambda x: jnp.take(x, parked, axis=0, mode="clip"), parking), width)
    extend = jax.vmap(lambda st, i, m: _extend(decoder, st, i, m)[0])
    new = parked if source is None else extend(parked, source[:, None, None], jnp.ones((source.shape[0], 1, 1), bool))
    if ids.shape[1]:
        new = extend(new, ids[:, None], mask[:, None])
    return _place(pool, new, rows, stage, budget, temperature, top_p, keys)


def _place(pool: SlotPool, new: DecodeState, rows, stage, budget, temperature, top_p, keys) -> SlotPool:
    """Stacked batch-1 states `new` (ring-wide) into pool rows `rows` [R] with their programs."""
    # Row r's column j goes to ring column (j + head - used) mod width: its last one ends at head - 1.
    shift = pool.state.slot - new.slot
    roll = jax.vmap(lambda x, s: jnp.roll(x, s, axis=-2 if x.ndim == 3 else -1))
    cache = tuple(LayerCache(roll(c.k, shift), roll(c.v, shift)) for c in new.cache)
    placed = DecodeState(cache, roll(new.key_mask[:, 0], shift), new.next_pos[:, 0], pool.state.slot,
                         new.logits[:, 0])
    put = lambda whole, x: whole.at[rows].set(x, mode="drop")  # noqa: E731
    state = jax.tree.map(put, pool.state._replace(slot=None), placed._replace(slot=None))._replace(slot=pool.state.slot)
    tail_len = jnp.iinfo(jnp.int32).max  # nothing to feed: the tail is in the chunk, or comes after <EOK>
    return SlotPool(state, put(pool.stage, stage), put(pool.count, jnp.zeros_like(stage)),
                    put(pool.fed, jnp.full_like(stage, tail_len)), put(pool.budget, budget),
                    put(pool.temperature, temperature), put(pool.top_p, top_p), put(pool.keys, keys))


class Queue(NamedTuple):
    """Prompts parked ahead (`admit`) that enter the pool on the device, in order, as rows free up
    inside `steps`: entry c (a running count) sits at index c mod Q; entries next..end-1 wait.
    Each entry: its parking row, nothing appended (as `enter` with no source), and its program."""
    parked: jax.Array  # [Q] int32
    stage: jax.Array  # [Q] int32
    budget: jax.Array  # [Q, 2] int32
    temperature: jax.Array  # [Q] float32
    top_p: jax.Array  # [Q] float32
    keys: jax.Array  # [Q, 2, key words] uint32
    next: jax.Array  # () int32: the first entry still waiting
    end: jax.Array  # () int32: one past the last entry


def _refill(pool: SlotPool, parking: DecodeState, queue: Queue):
    """Every idle row, in slot order, takes the queue's next entry while one waits. Returns (pool,
    queue, the entry each row took [slots], -1 for none)."""
    slots, size, width = pool.stage.shape[0], queue.parked.shape[0], pool.state.key_mask.shape[-1]

    def one(s, carry):
        pool, queue, took = carry

        def take(carry):
            pool, queue, took = carry
            at = queue.next % size
            row = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, queue.parked[at], 1), parking)
            pick = lambda x: jax.lax.dynamic_slice_in_dim(x, at, 1)  # noqa: E731
            pool = _place(pool, _fit_columns(row, width), s[None], pick(queue.stage), pick(queue.budget),
                          pick(queue.temperature), pick(queue.top_p), pick(queue.keys))
            return pool, queue._replace(next=queue.next + 1), took.at[s].set(queue.next)

        return jax.lax.cond((pool.stage[s] == IDLE) & (queue.next < queue.end), take, lambda c: c, carry)

    return jax.lax.fori_loop(0, slots, one, (pool, queue, jnp.full((slots,), -1, jnp.int32)))


def sample_rows(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits [slots, vocab] -> token ids [slots]: greedy where temperature is 0, else row i's draw
    with its own key keys[i] from its top-p nucleus at its temperature (`sampling.sample_tokens`)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = temperature > 0

    def draw():
        scaled = logits / jnp.where(sampled, temperature, 1.0)[:, None]
        candidates = jnp.where((top_p < 1.0)[:, None], nucleus(scaled, top_p[:, None]), scaled)
        return jax.vmap(jax.random.categorical)(keys, candidates).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(sampled), draw, lambda: greedy)
    return jnp.where(sampled, drawn, greedy)


def step(decoder: Decoder, pool: SlotPool, verbal_stops, answer_stops, tail):
    """One decode step over every slot: each running row's next token (the tail's next one while
    it is being fed, else its draw) is written at the head. `verbal_stops` [n] end a
    verbalization (`<EOK>`, EOS), `answer_stops` [m] an answer (EOS); `tail` [T] is `<EOK>
    Answer:`. Returns (pool, tokens [slots], their kinds [slots]: VERBAL, ANSWER, FORCED or IDLE
    for a row that did not run, rows whose answer ended [slots])."""
    live = pool.stage != IDLE
    feeding = pool.fed < tail.shape[0]
    stage_key = jnp.take_along_axis(pool.keys, jnp.clip(pool.stage - 1, 0, 1)[:, None, None], axis=1)[:, 0]
    keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(stage_key), pool.count)
    drawn = sample_rows(pool.state.logits, keys, pool.temperature, pool.top_p)
    tok = jnp.where(feeding, tail[jnp.clip(pool.fed, 0, tail.shape[0] - 1)], drawn)
    state, _ = _extend(decoder, pool.state, jnp.where(live, tok, 0)[:, None], live[:, None])
    state = state._replace(slot=state.slot % state.key_mask.shape[-1])  # the ring's next column
    sampled = live & ~feeding
    count = pool.count + sampled
    ends = lambda stops, phase: jnp.any(tok[:, None] == stops, -1) | (count >= pool.budget[:, phase])  # noqa: E731
    verbal_end = sampled & (pool.stage == VERBAL) & ends(verbal_stops, 0)
    answer_end = sampled & (pool.stage == ANSWER) & ends(answer_stops, 1)
    kind = jnp.where(~live, IDLE, jnp.where(feeding, FORCED, pool.stage))
    # A verbalization that ended on <EOK> is fed the tail without it.
    fed = jnp.where(verbal_end, (tok == tail[0]).astype(jnp.int32), pool.fed + (live & feeding))
    pool = pool._replace(state=state, count=jnp.where(verbal_end, 0, count), fed=fed,
                         stage=jnp.where(verbal_end, ANSWER, jnp.where(answer_end, IDLE, pool.stage)))
    return pool, jnp.where(live, tok, NO_TOKEN), kind, answer_end


@partial(nnx.jit, static_argnames=("max_steps",), donate_argnums=1)
def steps(decoder: Decoder, pool: SlotPool, stop, verbal_stops, answer_stops, tail, max_steps: int,
          parking: DecodeState | None = None, queue: Queue | None = None):
    """`step`s in a `lax.while_loop` until a row's answer ends (its slot is free to take a new
    request), no row runs, or after `max_steps`; the rows where `stop` [slots] is true (cancelled
    requests) idle from the first. Returns (pool, tokens and kinds [slots, max_steps] (NO_TOKEN
    and IDLE where a row did not run), steps run).

    With a `queue` of prompts waiting in `parking`, an idle row takes the next one before each
    step (`_refill`), and the loop ends when a row's answer ends with none left to take its place;
    it also returns (the queue, the entry each row took before each step [slots, max_steps], -1
    for none)."""
    slots = pool.stage.shape[0]
    pool = pool._replace(stage=jnp.where(stop, IDLE, pool.stage))
    none = jnp.full((slots,), -1, jnp.int32)

    def cond(carry):
        n, pool, _, _, ended, queue, _ = carry
        waiting = False if queue is None else queue.next < queue.end
        return (n < max_steps) & ~ended & (jnp.any(pool.stage != IDLE) | waiting)

    def body(carry):
        n, pool, tokens, kinds, _, queue, took = carry
        if queue is not None:
            refill = lambda c: _refill(c[0], parking, c[1])  # noqa: E731
            pool, queue, entered = jax.lax.cond(jnp.any(pool.stage == IDLE) & (queue.next < queue.end), refill,
                                                lambda c: (*c, none), (pool, queue))
            took = took.at[:, n].set(entered)
        pool, tok, kind, answered = step(decoder, pool, verbal_stops, answer_stops, tail)
        ended = jnp.any(answered) & (True if queue is None else queue.next >= queue.end)
        return n + 1, pool, tokens.at[:, n].set(tok), kinds.at[:, n].set(kind), ended, queue, took

    init = (jnp.zeros((), jnp.int32), pool, jnp.full((slots, max_steps), NO_TOKEN, jnp.int32),
            jnp.full((slots, max_steps), IDLE, jnp.int32), jnp.zeros((), bool), queue,
            None if queue is None else jnp.full((slots, max_steps), -1, jnp.int32))
    count, pool, tokens, kinds, _, queue, took = jax.lax.while_loop(cond, body, init)
    if queue is None:
        return pool, tokens, kinds, count
    return pool, tokens, kinds, count, queue, took
