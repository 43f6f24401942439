"""The slot pool (`jaxrag.decode.slots`): rows that join, decode and leave at different steps get
the tokens `sampler.generate` gives each prompt alone, a freed slot serves a new prompt, and rows
prefilled in one call read what each prefill alone reads."""

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
    """Free slots take the next prompts in one `admit_rows` call, padded with a row index past the
    pool; each prompt's tokens are those `generate` gives it alone."""
    dec = for_inference(tiny_hf("qwen2")[2]).decoder
    alone = [sampler.generate(dec, [p], n)[0] for p, n in zip(PROMPTS, NEW)]
    pool = slots.init_pool(dec, SLOTS, LENGTH)
    got = {i: [] for i in range(len(PROMPTS))}
    rows: list[int | None] = [None] * SLOTS
    waiting = list(range(len(PROMPTS)))
    calls = 0
    while waiting or any(r is not None for r in rows):
        free = [s for s in range(SLOTS) if rows[s] is None][:len(waiting)]
        if free:
            joining = [waiting.pop(0) for _ in free]
            ids, mask = sampler.left_pad([PROMPTS[i] for i in joining], PLEN, 4)
            index = np.array(free + [SLOTS] * (4 - len(free)), np.int32)  # padding rows: never written
            pool, _, _ = slots.admit_rows(dec, pool, jnp.asarray(index), jnp.asarray(ids), jnp.asarray(mask),
                                          length=PLEN + 16, hidden_layer=1)
            for s, i in zip(free, joining):
                rows[s] = i
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
    assert calls > 1 and [got[i] for i in range(len(PROMPTS))] == alone


def test_admitted_rows_read_what_a_prefill_alone_reads(tiny_hf):
    """`admit_rows`' logits and hidden states equal `extend`'s on each prompt alone."""
    dec = for_inference(tiny_hf("qwen2")[2]).decoder
    pool = slots.init_pool(dec, SLOTS, LENGTH)
    ids, mask = sampler.left_pad(PROMPTS[:2], PLEN, 2)
    pool, logits, hidden = slots.admit_rows(dec, pool, jnp.asarray([2, 0], jnp.int32), jnp.asarray(ids),
                                            jnp.asarray(mask), length=PLEN + 16, hidden_layer=1)
    for i, prompt in enumerate(PROMPTS[:2]):
        one, m = sampler.left_pad([prompt], PLEN, 1)
        state, h = sampler.extend(dec, sampler.init_state(dec, 1, PLEN + 16), jnp.asarray(one), jnp.asarray(m),
                                  hidden_layer=1)
        np.testing.assert_allclose(np.asarray(logits[i]), np.asarray(state.logits[0]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(hidden[i]), np.asarray(h[0]), rtol=1e-6, atol=1e-6)
    assert np.asarray(pool.write).tolist() == [PLEN, 0, PLEN]
    assert np.asarray(pool.next_pos).tolist() == [len(PROMPTS[1]), 0, len(PROMPTS[0])]


def test_a_row_prefill_appends_where_that_row_left_off(tiny_hf):
    """`prefill_rows` extends each of its rows (their positions and columns), as `extend` does
    alone, and leaves the other rows as they were."""
    dec = for_inference(tiny_hf("qwen2")[2]).decoder
    prompt, chunk = PROMPTS[0], [30, 31, 32]
    whole = sampler.generate(dec, [prompt + chunk], 6)[0]
    pool = slots.init_pool(dec, SLOTS, LENGTH)
    ids, mask = sampler.left_pad([prompt], PLEN, 1)
    pool, _, _ = slots.admit_rows(dec, pool, jnp.asarray([1], jnp.int32), jnp.asarray(ids), jnp.asarray(mask),
                                  length=PLEN + 16, hidden_layer=1)
    ids, mask = sampler.left_pad([chunk], 8, 2)
    pool = slots.prefill_rows(dec, pool, jnp.asarray([1, SLOTS], jnp.int32), jnp.asarray(ids), jnp.asarray(mask))
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
