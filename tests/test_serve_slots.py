"""The slot pool (`jaxrag.decode.slots`): rows that join, change phase and leave at different steps,
with their ring columns anywhere in the cache, get the tokens `route` computes for each prompt
alone (`sampler.extend` and `sampler.decode` on a batch-1 state, phase by phase); a sampled row
draws its own tokens whatever else is in the pool; a freed slot serves a new prompt."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrag.decode import sampler, slots
from jaxrag.decode.sampler import NO_TOKEN, SamplingParams
from jaxrag.models.model import for_inference

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21], [22, 23, 24, 25]]
SOURCE, TAIL = 40, [41, 42, 43]  # a source token; `<EOK> Answer:` (its first token plays <EOK>)
SLOTS, PLEN, LENGTH, VERBAL, STEPS = 3, 8, 40, 6, 4
RING = 26  # a pool's columns: the longest row's (8 prompt, source, 8 chunk, 8 answer) and one more
ANSWERS = [8, 5, 7, 3, 6]  # answer tokens per prompt


@pytest.fixture(scope="module")
def dec(tiny_hf):
    return for_inference(tiny_hf("qwen2")[2]).decoder


def alone(dec, prompt, chunk, verbal, answer, stops=(), sampling=SamplingParams(), rng=None, row_id=0, tail=TAIL):
    """What `route` computes for one row: prompt, source token, a verbalization of up to `verbal`
    tokens (None: none) ending at `stops`, the tail, an answer of `answer` tokens. Returns
    (verbalization, answer)."""
    rng = jax.random.key(0) if rng is None else rng
    state = sampler.init_state(dec, 1, LENGTH)
    for part, width in ((prompt, PLEN), ([SOURCE], 1)):
        ids, mask = sampler.left_pad([part], width, 1)
        state, _ = sampler.extend(dec, state, jnp.asarray(ids), jnp.asarray(mask))
    said = []
    if verbal is not None:
        state, toks, n, stopped, _ = sampler.decode(dec, state, jnp.asarray([list(stops) or [NO_TOKEN]]),
                                                 jnp.asarray([verbal]), jax.random.fold_in(rng, 0),
                                                 jnp.asarray([row_id], jnp.uint32), max_new=8, sampling=sampling)
        said = np.asarray(toks)[0, : int(n[0])].tolist()
        chunk = tail[1:] if bool(stopped[0]) and said[-1] == tail[0] else tail
    ids, mask = sampler.left_pad([chunk], sampler.bucket(len(chunk)), 1)
    state, _ = sampler.extend(dec, state, jnp.asarray(ids), jnp.asarray(mask))
    _, toks, n, _, _ = sampler.decode(dec, state, jnp.asarray([[NO_TOKEN]]), jnp.asarray([answer]),
                                   jax.random.fold_in(rng, 1), jnp.asarray([row_id], jnp.uint32), max_new=8,
                                   sampling=sampling)
    return said, np.asarray(toks)[0, : int(n[0])].tolist()


class Pool:
    """A pool driven as the server drives it: admit into parking, enter, step, read tokens by kind."""

    def __init__(self, dec, stops, sampling=(0.0, 1.0), rng=None, tail=TAIL, ring=LENGTH):
        self.dec, self.stops, self.sampling, self.tail = dec, jnp.asarray(stops), sampling, jnp.asarray(tail)
        self.rng = jax.random.key(0) if rng is None else rng
        self.pool = slots.init_pool(dec, SLOTS, ring)
        self.parking = slots.init_parking(dec, SLOTS, PLEN)
        self.got, self.calls, self.steps = {}, 0, 0

    def join(self, free, jobs, chunk, verbal: bool, row_ids):
        """Prompts `jobs` (indices into PROMPTS) admitted into slots `free` and entered together."""
        ids, mask = sampler.left_pad([PROMPTS[i % len(PROMPTS)] for i in jobs], PLEN, 4)
        index = jnp.asarray(free + [SLOTS] * (4 - len(free)), jnp.int32)  # padding rows: never written
        self.parking, _, _ = slots.admit(self.dec, self.parking, index, jnp.asarray(ids), jnp.asarray(mask),
                                         length=LENGTH, hidden_layer=1)
        width = 0 if verbal else sampler.bucket(len(chunk))
        cids, cmask = sampler.left_pad([[] if verbal else chunk] * 4, width, 4)
        budget = [[VERBAL, ANSWERS[i % len(PROMPTS)]] for i in jobs] + [[1, 1]] * (4 - len(jobs))
        t, p = self.sampling
        keyed = list(row_ids) + [0] * (4 - len(jobs))
        self.pool = slots.enter(self.dec, self.pool, self.parking, index, index, jnp.full(4, SOURCE, jnp.int32),
                                jnp.asarray(cids), jnp.asarray(cmask),
                                jnp.full(4, slots.VERBAL if verbal else slots.ANSWER, jnp.int32),
                                jnp.asarray(budget, jnp.int32), jnp.full(4, t, jnp.float32),
                                jnp.full(4, p, jnp.float32), slots.stage_keys(self.rng, jnp.asarray(keyed, jnp.uint32)))
        for s, i in zip(free, jobs):
            self.got[s] = (i, [], [])

    def step(self):
        self.pool, tokens, kinds, count = slots.steps(self.dec, self.pool, jnp.zeros(SLOTS, bool), self.stops,
                                                      jnp.asarray([NO_TOKEN]), self.tail, max_steps=STEPS)
        self.calls, self.steps = self.calls + 1, self.steps + int(count)
        done = []
        for s, (i, verbal, answer) in list(self.got.items()):
            for t, k in zip(np.asarray(tokens)[s].tolist(), np.asarray(kinds)[s].tolist()):
                (verbal if k == slots.VERBAL else answer if k == slots.ANSWER else []).append(t)
            if len(answer) == ANSWERS[i % len(PROMPTS)]:
                done.append(s)
        return done, int(count)

    def drain(self) -> dict:
        """Steps until every row answered: prompt index -> (verbalization, answer)."""
        got = {}
        while self.got:
            for s in self.step()[0]:
                i, verbal, answer = self.got.pop(s)
                got[i] = (verbal, answer)
        return got


def test_rows_joining_and_leaving_answer_as_each_prompt_alone(dec):
    """Rows enter with their knowledge and answer; free slots take the next prompts while the others
    decode (every prompt three times in a ring just long enough for a row, so the head wraps
    around it and rows sit across its end); each answer is
    the prompt's alone, and a call ends as soon as a row's answer does."""
    chunk = [30, 31, 32] + TAIL
    want = [alone(dec, p, chunk, None, n)[1] for p, n in zip(PROMPTS, ANSWERS)]
    pool, answers, waiting = Pool(dec, [TAIL[0]], ring=RING), {}, list(range(3 * len(PROMPTS)))
    while waiting or pool.got:
        free = [s for s in range(SLOTS) if s not in pool.got][:len(waiting)]
        if free:
            jobs = [waiting.pop(0) for _ in free]
            pool.join(free, jobs, chunk, False, jobs)
        left = [ANSWERS[i % len(PROMPTS)] - len(a) for i, _, a in pool.got.values()]
        done, count = pool.step()
        assert count == min(STEPS, *left)
        for s in done:
            i, _, answer = pool.got.pop(s)
            answers[i] = answer
    assert pool.steps > RING and [answers[i] for i in range(len(answers))] == want * 3


def test_a_verbalization_changes_phase_on_the_device(dec):
    """`<Self>` rows verbalize, are fed the tail (without <EOK> when they wrote it) and answer in
    the same step loop: one verbalization ends on its stop token, the others on their budget."""
    free = list(range(SLOTS))
    first, _ = alone(dec, PROMPTS[0], None, VERBAL, ANSWERS[0])
    stop = first[2]  # greedy's third verbal token: the first prompt stops there, on its <EOK>
    tail = [stop, *TAIL[1:]]
    want = [alone(dec, PROMPTS[i], None, VERBAL, ANSWERS[i], stops=[stop], tail=tail) for i in free]
    assert len(want[0][0]) == 3 and any(len(w[0]) == VERBAL for w in want[1:])
    pool = Pool(dec, [stop], tail=tail)
    pool.join(free, free, None, True, free)
    got = pool.drain()
    assert [got[i] for i in free] == want


def test_a_sampled_row_draws_its_own_tokens_whatever_shares_the_pool(dec):
    """Each row's draws use its own keys (`stage_keys`, its row id): alone with `route`'s keys,
    or beside other rows in any slot, it samples the same verbalization and answer."""
    rng, sampling = jax.random.key(7), SamplingParams(temperature=1.0, top_p=0.9)
    want = alone(dec, PROMPTS[2], None, VERBAL, ANSWERS[2], sampling=sampling, rng=rng, row_id=11)

    def sampled(free, jobs, ids):
        pool = Pool(dec, [NO_TOKEN], (1.0, 0.9), rng)
        pool.join(free, jobs, None, True, ids)
        return pool.drain()

    assert sampled([1], [2], [11])[2] == want
    beside = sampled([2, 0, 1], [2, 0, 3], [11, 12, 13])
    assert beside[2] == want


def test_admitted_rows_read_what_a_prefill_alone_reads(dec):
    """`admit`'s logits and hidden states equal `extend`'s on each prompt alone; a parked row holds
    its prompt's columns from 0, its position and next column."""
    parking = slots.init_parking(dec, SLOTS, PLEN)
    ids, mask = sampler.left_pad(PROMPTS[:2], PLEN, 2)
    parking, logits, hidden = slots.admit(dec, parking, jnp.asarray([2, 0], jnp.int32), jnp.asarray(ids),
                                          jnp.asarray(mask), length=LENGTH, hidden_layer=1)
    for i, prompt in enumerate(PROMPTS[:2]):
        one, m = sampler.left_pad([prompt], PLEN, 1)
        state, h = sampler.extend(dec, sampler.init_state(dec, 1, LENGTH), jnp.asarray(one), jnp.asarray(m),
                                  hidden_layer=1)
        np.testing.assert_allclose(np.asarray(logits[i]), np.asarray(state.logits[0]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(hidden[i]), np.asarray(h[0]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(parking.cache[0].k[2 - 2 * i]), np.asarray(state.cache[0].k)[:, :PLEN],
                                   rtol=1e-6, atol=1e-6)
    assert np.asarray(parking.slot).tolist() == [PLEN, 0, PLEN]
    assert np.asarray(parking.next_pos)[:, 0].tolist() == [len(PROMPTS[1]), 0, len(PROMPTS[0])]
