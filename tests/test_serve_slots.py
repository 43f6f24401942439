"""The slot pool (`jaxrag.decode.slots`): rows that join, decode and leave at different steps get
the tokens `sampler.generate` gives each prompt alone, and a freed slot serves a new prompt."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrag.decode import sampler, slots
from jaxrag.decode.sampler import NO_TOKEN
from jaxrag.models.model import for_inference

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21], [22, 23, 24, 25]]
NEW = [8, 5, 7, 3, 6]  # tokens per prompt (one decode program for `generate`)
SLOTS, PLEN, LENGTH, STEPS = 3, 8, 40, 4


def test_rows_joining_and_leaving_decode_as_each_prompt_alone(tiny_hf):
    dec = for_inference(tiny_hf("qwen2")[2]).decoder
    alone = [sampler.generate(dec, [p], n)[0] for p, n in zip(PROMPTS, NEW)]
    pool = slots.init_pool(dec, SLOTS, LENGTH)
    got = {i: [] for i in range(len(PROMPTS))}
    rows: list[int | None] = [None] * SLOTS
    waiting = list(range(len(PROMPTS)))
    calls = 0
    while waiting or any(r is not None for r in rows):
        for s in range(SLOTS):  # a free slot takes the next prompt, prefilled alone (batch 1)
            if rows[s] is None and waiting:
                i = waiting.pop(0)
                state = sampler.init_state(dec, 1, PLEN + 16)
                ids, mask = sampler.left_pad([PROMPTS[i]], PLEN, 1)
                state, _ = sampler.extend(dec, state, jnp.asarray(ids), jnp.asarray(mask))
                pool, rows[s] = slots.insert(pool, state, jnp.int32(s)), i
        live = np.array([r is not None for r in rows])
        budget = np.array([NEW[r] - len(got[r]) if r is not None else 0 for r in rows], np.int32)
        pool, tokens, count = slots.steps(dec, pool, jnp.asarray(live), jnp.full((SLOTS, 1), NO_TOKEN, jnp.int32),
                                          jnp.asarray(budget), jnp.zeros(SLOTS), jnp.ones(SLOTS),
                                          jax.random.key(calls), max_steps=STEPS)
        calls += 1
        tokens = np.asarray(tokens)
        assert int(count) == min(STEPS, budget[live].min())  # a call ends when a row ends
        for s, r in enumerate(rows):
            if r is not None:
                got[r] += [int(t) for t in tokens[s] if t != NO_TOKEN]
                if len(got[r]) == NEW[r]:
                    rows[s] = None  # leaves; its slot is reused
    assert [got[i] for i in range(len(PROMPTS))] == alone


def test_a_row_prefill_appends_where_that_row_left_off(tiny_hf):
    """`prefill_row` extends one row (its positions and columns), as `extend` does alone."""
    dec = for_inference(tiny_hf("qwen2")[2]).decoder
    prompt, chunk = PROMPTS[0], [30, 31, 32]
    whole = sampler.generate(dec, [prompt + chunk], 6)[0]
    pool = slots.init_pool(dec, SLOTS, LENGTH)
    state = sampler.init_state(dec, 1, PLEN + 16)
    ids, mask = sampler.left_pad([prompt], PLEN, 1)
    pool = slots.insert(pool, sampler.extend(dec, state, jnp.asarray(ids), jnp.asarray(mask))[0], jnp.int32(1))
    ids, mask = sampler.left_pad([chunk], 8, 1)
    pool = slots.prefill_row(dec, pool, jnp.int32(1), jnp.asarray(ids), jnp.asarray(mask))
    assert np.asarray(pool.write).tolist() == [0, PLEN + 8, 0] and np.asarray(pool.next_pos).tolist() == [0, 8, 0]
    got = []
    while len(got) < len(whole):
        pool, tokens, _ = slots.steps(dec, pool, jnp.asarray([False, True, False]), jnp.full((SLOTS, 1), NO_TOKEN, jnp.int32),
                                      jnp.asarray([0, len(whole) - len(got), 0], jnp.int32), jnp.zeros(SLOTS),
                                      jnp.ones(SLOTS), jax.random.key(0), max_steps=STEPS)
        tokens = np.asarray(tokens)
        assert (tokens[[0, 2]] == NO_TOKEN).all()
        got += [int(t) for t in tokens[1] if t != NO_TOKEN]
    assert got == whole
