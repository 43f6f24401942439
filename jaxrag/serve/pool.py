"""The engine's device side (`serve.engine`): the slot pool and its parking rows (`decode.slots`),
the three programs that run on them, and their shape buckets, every one compiled by `warm_up`
before the first request.

    admit     question prefills into parking rows, one call per prompt bucket and row count
    enter     parked rows into free slots with their source token and knowledge chunk, one call
              per chunk width and row count (width 0: a `<Self>` row, which verbalizes first)
    dispatch  a call of decode steps over every slot (`STEPS_PER_CALL` at most), not waited for
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrag.decode.routing import RouteConfig, phase_lengths
from jaxrag.decode.sampler import NO_TOKEN, bucket, left_pad
from jaxrag.decode.slots import ANSWER, VERBAL, admit, enter, init_parking, init_pool, stage_keys, steps
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
        self.row_buckets = sorted({min(1 << b, slots) for b in range(slots.bit_length() + 1)})
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
