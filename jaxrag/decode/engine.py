"""The generation engine: continuous batching over the slot pool of `decode.slots`, whose rows
decode together, each in a phase of its own, a finished row replaced from the queue at once.

    Device    the pool and its parking rows for SR-RAG requests (`serve.engine` drives it): the
              three programs that run on them and their shape buckets, every one compiled by
              `warm_up` before the first request
        admit     question prefills into parking rows, one call per prompt bucket and row count
        enter     parked rows into free slots with their source token and knowledge chunk, one
                  call per chunk width and row count (width 0: a `<Self>` row, which verbalizes first)
        dispatch  a call of decode steps over every slot (`STEPS_PER_CALL` at most), not waited for
    generate  `sampler.generate`'s continuations of many prompts through a pool of the same
              programs (construct's GenRead rounds)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrag.decode.routing import RouteConfig, phase_lengths
from jaxrag.decode.sampler import NO_TOKEN, SamplingParams, batch_rows, bucket, left_pad, placement, prefill_chunk
from jaxrag.decode.sampling import row_keys
from jaxrag.decode.slots import ANSWER, VERBAL, Queue, admit, enter, init_parking, init_pool, stage_keys, steps
from jaxrag.errors import JaxragError
from jaxrag.models.decoder import Decoder
from jaxrag.models.model import Model
from jaxrag.models.tokens import EOK
from jaxrag.prompts import answer_prefix_ids

# Parking rows per slot: requests admitted (their prompts prefilled) wait there for their passages
# or a free slot, so a row waiting for retrieval holds no slot of the pool.
PARKING_PER_SLOT = 2
# Decode steps per call at most: a call also ends as soon as a row's answer ends, so a waiting
# request joins within this many steps, and the host's work per call is spread over them.
STEPS_PER_CALL = 16


class Device:
    def __init__(self, model: Model, cfg: RouteConfig, slots: int, max_question_tokens: int):
        tok, self.cfg, self.dec = model.tokenizer, cfg, model.decoder
        self.eok, self.tail = model.token_id(EOK), answer_prefix_ids(tok)
        self.eos = [] if tok.eos_token_id is None else [tok.eos_token_id]
        self.vlen, self.klen, self.alen = phase_lengths(cfg, self.tail)
        self.slots, self.parking_rows = slots, PARKING_PER_SLOT * slots
        self.prompt_buckets = sorted({bucket(n) for n in range(1, max_question_tokens + 1)})
        self.chunk_buckets = sorted({min(self.klen, bucket(n)) for n in range(1, self.klen + 1)})
        # rows per prefill call: powers of two up to the slot count
        self.row_buckets = row_buckets(slots)
        self.verbal_stops = jnp.asarray([self.eok, *self.eos], jnp.int32)
        self.answer_stops = jnp.asarray(self.eos or [NO_TOKEN], jnp.int32)
        self.tail_ids = jnp.asarray(self.tail, jnp.int32)
        self.key, self.dispatches = jax.random.key(0), 0
        # The decoder bound once: nnx.jit would walk its module graph on every call.
        self._admit, self._enter, self._steps = (nnx.cached_partial(f, self.dec) for f in (admit, enter, steps))
        self.reset()

    def reset(self) -> None:
        """A fresh pool, whose ring holds the longest question's columns, and parking."""
        self.pool = init_pool(self.dec, self.slots, self.length(self.prompt_buckets[-1]))
        self.parking = init_parking(self.dec, self.parking_rows, self.prompt_buckets[-1])
        self.idle_next = np.zeros(self.slots, bool)  # rows of cancelled requests, idled by the next call

    def length(self, plen: int) -> int:
        """Cache columns of a question of `plen` (bucketed) tokens, as `route` sizes it alone."""
        return plen + 1 + self.vlen + self.klen + self.alen

    def padded(self, indices: list[int], past: int) -> np.ndarray:
        """Row indices padded to a row bucket with `past` (an index past the rows: never written)."""
        n = next(r for r in self.row_buckets if r >= len(indices))
        return np.array([*indices, *[past] * (n - len(indices))], np.int32)

    def admit(self, parked: np.ndarray, prompts: list[list[int]]):
        """T_d's prefill as `route` runs it on one row, for each prompt (one length bucket) into its
        parking row: next-token logits [rows, vocab] and the hidden state at <EOQ> [rows, hidden]."""
        plen = bucket(max(map(len, prompts)))
        ids, mask = left_pad(prompts, plen, len(parked))
        self.parking, logits, hidden = self._admit(self.parking, jnp.asarray(parked), jnp.asarray(ids),
                                                   jnp.asarray(mask), length=self.length(plen),
                                                   hidden_layer=self.cfg.hidden_layer)
        return logits, np.asarray(hidden)

    def enter(self, rows: np.ndarray, parked: np.ndarray, sources: list[int], chunks: list[list[int]], width: int,
              answer_tokens: list[int], temperature: list[float], top_p: list[float], serials: list[int]) -> None:
        """Parked rows into pool rows `rows`: each one's source token and chunk (`width` columns),
        its answer budget, sampling and keys (its serial number as its row id); per-row lists may
        be shorter than `rows` (the padding rows')."""
        n = len(rows)
        self.idle_next[rows[rows < self.slots]] = False  # a cancelled request's row, now another's
        pad = lambda values, fill: np.array([*values, *[fill] * (n - len(values))])  # noqa: E731
        ids, mask = left_pad(chunks, width, n)
        budget = np.stack([np.full(n, self.cfg.max_verbal_tokens), pad(answer_tokens, 1)], 1).astype(np.int32)
        self.pool = self._enter(self.pool, self.parking, jnp.asarray(rows), jnp.asarray(parked),
                                jnp.asarray(pad(sources, 0), jnp.int32), jnp.asarray(ids), jnp.asarray(mask),
                                jnp.full(n, VERBAL if width == 0 else ANSWER, jnp.int32), jnp.asarray(budget),
                                jnp.asarray(pad(temperature, 0.0), jnp.float32),
                                jnp.asarray(pad(top_p, 1.0), jnp.float32),
                                stage_keys(self.key, jnp.asarray(pad(serials, 0), jnp.uint32)))

    def dispatch(self):
        """A call of decode steps, dispatched and not waited for: (tokens, kinds) [slots, steps]."""
        stop, self.idle_next = self.idle_next, np.zeros(self.slots, bool)
        self.pool, tokens, kinds, _ = self._steps(self.pool, jnp.asarray(stop), self.verbal_stops, self.answer_stops,
                                                  self.tail_ids, max_steps=STEPS_PER_CALL)
        self.dispatches += 1
        return tokens, kinds

    def warm_up(self):
        """Every program compiled, on padding rows only (nothing written): per row bucket, the
        question prefill per prompt bucket and the entry per chunk width; the decode steps.
        Returns a prefill's outputs per row bucket (for what the host computes from them)."""
        filler, outs = self.tail[-1], []
        for n in self.row_buckets:
            rows, parked = np.full(n, self.slots, np.int32), np.full(n, self.parking_rows, np.int32)
            for plen in self.prompt_buckets:
                out = self.admit(parked, [[filler] * plen] * n)
            outs.append(out)
            for width in [0, *self.chunk_buckets]:
                self.enter(rows, parked, [], [[filler] * width] * n, width, [], [], [], [])
        jax.block_until_ready(self.dispatch())
        return outs


def row_buckets(slots: int, smallest: int = 1) -> list[int]:
    """Rows per prefill call: powers of two from `smallest` up to the slot count."""
    return sorted({min(1 << b, slots) for b in range(slots.bit_length() + 1) if 1 << b >= min(smallest, slots)})


# Rows per admission call in `generate` at least: prompts are admitted a pool's worth at a time,
# then a few at a time as rows end; padding a call to 8 rows keeps its programs few.
GENERATE_MIN_ROWS = 8
# Decode steps per call of `generate` at most: rows refill on the device, so a call returns only
# when its queue runs dry or after this many steps.
GENERATE_STEPS_PER_CALL = 64


def generate(decoder: Decoder, prompts, max_new_tokens: int, stop_ids=(), sampling: SamplingParams = SamplingParams(),
             rng: jax.Array | None = None, row_ids=None, slots: int = 64, stats: dict | None = None) -> list[list[int]]:
    """`sampler.generate`'s continuations (stop tokens kept) through a pool of `slots` rows: every
    step advances every running row, and a row that ends takes the next prompt inside the step
    loop (`slots.Queue`: prompts are prefilled ahead into twice the slots' parking rows, shortest
    first so that admissions share prompt buckets); the host admits more and reads tokens while
    the next call runs. A row computes what `sampler.generate` computes for its prompt alone
    (its prefill chunks, its positions) and draws with its own key (`row_keys(rng, row_ids[i])`,
    default i) folded with its step, so its tokens are those `sampler.generate` draws for it, in
    any pool. `stats`, when given, counts into its keys: "calls" and "steps" of decoding,
    "prompt_tokens" prefilled and "prefill_tokens" with their padding (bucketed lengths, padding rows)."""
    if not prompts:
        raise ValueError("generate: empty batch")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    if sampling.top_k:
        raise JaxragError("engine.generate samples from the top-p nucleus; top_k is not supported")
    n, mesh = len(prompts), placement(decoder)
    ids = np.arange(n, dtype=np.uint32) if row_ids is None else np.asarray(row_ids, np.uint32)
    if len(ids) != n:
        raise ValueError(f"generate: {len(ids)} row ids for {n} prompts")
    slots = batch_rows(slots, mesh, slots)
    size, new_cols, plen = 2 * slots, bucket(max_new_tokens), bucket(max(map(len, prompts)))
    pool, parking = init_pool(decoder, slots, plen + new_cols), init_parking(decoder, size, plen)
    keys = np.asarray(jax.random.key_data(row_keys(jax.random.key(0) if rng is None else rng, ids)))
    # The queue's entries, at index (running count) mod size, each in parking row of that index.
    queue = dict(parked=np.arange(size, dtype=np.int32), stage=np.full(size, ANSWER, np.int32),
                 budget=np.tile(np.array([[0, max_new_tokens]], np.int32), (size, 1)),
                 temperature=np.full(size, sampling.temperature, np.float32),
                 top_p=np.full(size, sampling.top_p, np.float32), keys=np.zeros((size, 2, *keys.shape[1:]), keys.dtype))
    stops, nothing = jnp.asarray(list(stop_ids) or [NO_TOKEN], jnp.int32), jnp.asarray([NO_TOKEN], jnp.int32)
    order = sorted(range(n), key=lambda i: (len(prompts[i]), i))[::-1]  # popped from the end: shortest first
    host = _Host(slots, n, set(stop_ids), max_new_tokens)
    stats = {} if stats is None else stats
    for key in ("calls", "steps", "prompt_tokens", "prefill_tokens"):
        stats.setdefault(key, 0)
    # The queue's running count carries over from call to call on the device, placed as the
    # step loop returns it (as the ring's head), so that every call runs one program.
    done_next, pending = jax.device_put(jnp.zeros((), jnp.int32), pool.state.slot.sharding), None
    while True:
        while order and host.end - host.next < size:  # prefill ahead into the parking rows consumed
            length = bucket(len(prompts[order[-1]]))
            group = []
            while (order and len(group) < min(slots, size - (host.end - host.next))
                   and bucket(len(prompts[order[-1]])) == length):
                group.append(order.pop())
            count = next(r for r in row_buckets(slots, GENERATE_MIN_ROWS) if r >= len(group))
            at = [(host.end + j) % size for j in range(len(group))]
            tokens, mask = left_pad([prompts[i] for i in group], length, count)
            into = np.array([*at, *[size] * (count - len(group))], np.int32)  # padding rows: dropped
            parking, _, _ = admit(decoder, parking, jnp.asarray(into), jnp.asarray(tokens), jnp.asarray(mask),
                                  length=length + new_cols, hidden_layer=None,
                                  chunk=prefill_chunk(count, decoder.cfg.num_heads, length + new_cols))
            queue["keys"][at] = keys[group][:, None]
            host.queued(group)
            stats["prompt_tokens"] += sum(len(prompts[i]) for i in group)
            stats["prefill_tokens"] += count * length
        if host.finished() and pending is None:
            return host.out
        # The next call is dispatched before the last one's tokens are read.
        waiting = Queue(**{k: jnp.asarray(v) for k, v in queue.items()}, next=done_next,
                        end=jnp.asarray(host.end, jnp.int32))
        pool, tokens, kinds, ran, waiting, took = steps(decoder, pool, jnp.zeros(slots, bool), nothing, stops,
                                                        nothing, max_steps=GENERATE_STEPS_PER_CALL, parking=parking,
                                                        queue=waiting)
        done_next, previous, pending = waiting.next, pending, (tokens, kinds, ran, took)
        if previous is not None:
            host.read(*previous, stats)
            if host.finished():
                return host.out


class _Host:
    """`generate`'s view of the pool, as of the last call read: which prompt each row runs, the
    queue's running counts, and each prompt's tokens."""

    def __init__(self, slots: int, n: int, stops: set, budget: int):
        self.rows: list[int | None] = [None] * slots
        self.entries: list[int] = []  # entry c's prompt
        self.next = self.end = 0  # entries entered (as read) and queued
        self.out: list[list[int]] = [[] for _ in range(n)]
        self.left, self.stops, self.budget = n, stops, budget

    def queued(self, group: list[int]) -> None:
        self.entries += group
        self.end += len(group)

    def finished(self) -> bool:
        return self.left == 0

    def read(self, tokens, kinds, count, took, stats: dict) -> None:
        """A call's tokens into their prompts, step by step: a row takes its entry before the step."""
        tokens, kinds, took, count = np.asarray(tokens), np.asarray(kinds), np.asarray(took), int(count)
        stats["calls"], stats["steps"] = stats["calls"] + 1, stats["steps"] + count
        for s in range(len(self.rows)):
            for t in np.flatnonzero((took[s, :count] >= 0) | (kinds[s, :count] == ANSWER)):
                if took[s, t] >= 0:
                    self.rows[s], self.next = self.entries[took[s, t]], max(self.next, int(took[s, t]) + 1)
                if kinds[s, t] == ANSWER:
                    got = self.out[self.rows[s]]
                    got.append(int(tokens[s, t]))
                    if len(got) >= self.budget or got[-1] in self.stops:
                        self.rows[s], self.left = None, self.left - 1
