"""The generation engine (`jaxrag.decode.engine.generate`): prompts of many lengths through a pool
smaller than their number give each prompt the tokens `sampler.generate` gives it alone, greedy
and sampled (its own key), and a row that ends is replaced at once, where static batches of the
same rows decode until their longest row ends."""

import jax
import numpy as np
import pytest

from jaxrag.decode import engine, sampler
from jaxrag.decode.sampler import SamplingParams
from jaxrag.errors import JaxragError
from jaxrag.models.model import for_inference

NEW, SLOTS = 10, 4
RNG = np.random.default_rng(0)
# 11 prompts of 1 to 40 tokens: four prompt buckets, more prompts than slots.
PROMPTS = [RNG.integers(5, 200, size=n).tolist() for n in (1, 3, 9, 14, 5, 17, 2, 33, 8, 40, 6)]


@pytest.fixture(scope="module")
def dec(tiny_hf):
    return for_inference(tiny_hf("qwen2")[2]).decoder


def alone(dec, stops, sampling=SamplingParams(), rng=None):
    return [sampler.generate(dec, [p], NEW, stops, sampling, rng, row_ids=[i])[0] for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def stop(dec):
    """Tokens that end about half the greedy continuations at their first token and leave the
    others long: the first tokens of the even prompts' continuations that no odd one starts with."""
    firsts = [c[0] for c in alone(dec, [])]
    return sorted(set(firsts[::2]) - set(firsts[1::2]))


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)],
                         ids=["greedy", "sampled"])
def test_each_prompt_gets_what_it_gets_alone(dec, stop, sampling):
    rng = jax.random.key(7)
    want = alone(dec, stop, sampling, rng)
    stats = {}
    got = engine.generate(dec, PROMPTS, NEW, stop, sampling, rng, slots=SLOTS, stats=stats)
    assert got == want
    assert stats["prompt_tokens"] == sum(map(len, PROMPTS))
    assert stats["prefill_tokens"] >= stats["prompt_tokens"]


def test_the_first_call_compiles_what_every_later_call_runs(tiny_hf):
    """A model as `load_model` leaves it (host arrays) and a pool built without a mesh: the first
    call compiles the programs the later calls run, so a second call on other prompts of the same
    buckets compiles nothing. Fails where the first call's programs see uncommitted arrays: its
    outputs come back committed (the decoder's arrays too, written back by the jitted call), and
    every later call compiled its own."""
    import jaxrag
    from jaxrag.eval.harness import compile_events

    fresh = jaxrag.load_model(tiny_hf("qwen2")[1], inference=True).decoder
    engine.generate(fresh, PROMPTS, NEW, slots=SLOTS)
    other = [list(reversed(p)) for p in PROMPTS]  # other tokens, the same lengths
    before = compile_events()
    got = engine.generate(fresh, other, NEW, slots=SLOTS)
    assert compile_events() == before
    assert got == [sampler.generate(fresh, [p], NEW, row_ids=[i])[0] for i, p in enumerate(other)]


def test_a_row_that_ends_is_replaced_without_draining_the_pool(dec, stop):
    lengths = [len(c) for c in alone(dec, stop)]
    assert min(lengths) < NEW == max(lengths), lengths  # the stop ends some rows early
    stats = {}
    engine.generate(dec, PROMPTS, NEW, stop, slots=SLOTS, stats=stats)
    # Static batches of SLOTS rows (in the engine's order, shortest prompt first) each decode
    # until their longest row ends; the pool decodes until the last row ends, rows refilled.
    order = sorted(range(len(PROMPTS)), key=lambda i: (len(PROMPTS[i]), i))
    static = sum(max(lengths[i] for i in order[b:b + SLOTS]) for b in range(0, len(order), SLOTS))
    assert stats["steps"] < static, (stats, static, lengths)
    # A step advances every running row: the steps are at least the rows' tokens over the slots.
    assert stats["steps"] >= -(-sum(lengths) // SLOTS)


def test_row_ids_key_the_samples_and_bad_input_is_refused(dec):
    sampled = SamplingParams(temperature=1.0)
    a = engine.generate(dec, PROMPTS[:3], NEW, [], sampled, jax.random.key(1), row_ids=[5, 6, 7], slots=SLOTS)
    b = engine.generate(dec, PROMPTS[2::-1], NEW, [], sampled, jax.random.key(1), row_ids=[7, 6, 5], slots=SLOTS)
    assert a == b[::-1]
    with pytest.raises(ValueError, match="every prompt needs"):
        engine.generate(dec, [[1], []], NEW)
    with pytest.raises(JaxragError, match="top_k"):
        engine.generate(dec, [[1]], NEW, sampling=SamplingParams(temperature=1.0, top_k=5))
