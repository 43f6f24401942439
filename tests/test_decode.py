"""KV-cache generation and scoring against transformers; sampling controls."""

import jax
import numpy as np
import pytest
import torch

from jaxrag.decode.sampler import SamplingParams, bucket, generate
from jaxrag.decode.scoring import score, score_bucket
from jaxrag.models.model import for_inference

PROMPTS = [[5, 17, 33, 9, 41], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [99, 3, 120]]


def _hf_greedy(ref, prompts, n):
    length = max(map(len, prompts))
    ids = torch.tensor([[1] * (length - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts])
    out = ref.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=1)
    return out[:, length:].tolist()


@pytest.mark.parametrize("variant", ["qwen2", "llama", "phi3"])
def test_greedy_matches_transformers_generate_on_left_padded_batch(tiny_hf, variant):
    ref, _, model = tiny_hf(variant)
    assert generate(model.decoder, PROMPTS, 12) == _hf_greedy(ref, PROMPTS, 12)


@pytest.mark.parametrize("variant", ["qwen2", "phi3_window"])
def test_chunked_prefill_equals_transformers(tiny_hf, variant, monkeypatch):
    """Prompts prefilled 4 columns at a time (a row's first chunks all padding; the sliding
    window crossing chunks) give transformers' greedy tokens, as the one-pass prefill does."""
    from jaxrag.decode import sampler

    ref, _, model = tiny_hf(variant)
    whole = generate(model.decoder, PROMPTS, 12)
    monkeypatch.setattr(sampler, "PREFILL_CHUNK", 4)  # PROMPTS bucket to 16 columns: 4 chunks
    assert generate(model.decoder, PROMPTS, 12) == whole == _hf_greedy(ref, PROMPTS, 12)


def test_prefill_chunks_bound_the_attention_temporaries(tiny_hf):
    """`prefill_chunk` keeps one pass's [rows, heads, chunk, slots] float32 scores under its
    budget (halving from 512 columns, never below 128), and XLA's temporaries for a prefill pass
    shrink by the two score buffers the fewer columns leave out (memory_analysis of the compiled
    pass, against the direct formula)."""
    import jax.numpy as jnp

    from jaxrag.decode import sampler

    budget = sampler.PREFILL_SCORES_BYTES
    for rows, heads, slots in [(32, 9, 1536), (64, 28, 1536), (1, 9, 1536), (16, 14, 640), (8, 2, 4096)]:
        c = sampler.prefill_chunk(rows, heads, slots)
        assert c in (128, 256, 512)
        assert c == 128 or rows * heads * c * slots * 4 <= budget
        assert c == 512 or rows * heads * 2 * c * slots * 4 > budget
    assert (sampler.prefill_chunk(32, 9, 1536), sampler.prefill_chunk(1, 9, 1536)) == (128, 512)

    _, _, model = tiny_hf("qwen2")
    dec = for_inference(model).decoder
    rows, slots, heads = 8, 1024, dec.cfg.num_heads
    state = jax.eval_shape(lambda: sampler.init_state(dec, rows, slots))

    def temp(chunk):
        ids = jax.ShapeDtypeStruct((rows, chunk), jnp.int32)
        mask = jax.ShapeDtypeStruct((rows, chunk), bool)
        return sampler.extend.lower(dec, state, ids, mask).compile().memory_analysis().temp_size_in_bytes

    saved = temp(512) - temp(128)
    scores = 2 * rows * heads * (512 - 128) * slots * 4
    assert 0.8 * scores <= saved <= 1.3 * scores, (saved, scores)


@pytest.mark.parametrize("variant", ["qwen2", "phi3_window"])
def test_inference_layout_decodes_and_scores_like_the_stacked_model(tiny_hf, variant, monkeypatch):
    """`for_inference` (per-layer weight buffers, the layer loop) gives transformers' greedy
    tokens, chunked prefill included, and the stacked model's scores."""
    from jaxrag.decode import sampler

    ref, _, model = tiny_hf(variant)
    fast = for_inference(model)
    assert not hasattr(fast.decoder.layers, "attn")  # one Block per layer, not one stacked Block
    want = _hf_greedy(ref, PROMPTS, 12)
    assert generate(fast.decoder, PROMPTS, 12) == want
    monkeypatch.setattr(sampler, "PREFILL_CHUNK", 4)
    assert generate(fast.decoder, PROMPTS, 12) == want
    prefixes, targets = [[5, 17, 33], [7, 8, 9, 10]], [[40, 41], [2, 3, 4]]
    np.testing.assert_allclose(np.concatenate(score(fast.decoder, prefixes, targets).per_token),
                               np.concatenate(score(model.decoder, prefixes, targets).per_token), atol=1e-5)


def test_bucket_pads_to_a_power_of_two_or_a_multiple_of_128():
    assert [bucket(n) for n in (1, 5, 9, 100, 128, 129, 256, 257, 1188, 2048)] == \
        [8, 8, 16, 128, 128, 256, 256, 384, 1280, 2048]


def test_stop_tokens_per_row_end_rows_independently(tiny_hf):
    _, _, model = tiny_hf("qwen2")
    free = generate(model.decoder, PROMPTS, 12)
    stops = [[free[0][2]], [], [free[2][0]]]
    out = generate(model.decoder, PROMPTS, 12, stop_ids=stops)
    assert out[0] == free[0][: free[0].index(free[0][2]) + 1]
    assert out[1] == free[1]
    assert out[2] == free[2][:1]


def _hf_target_logprobs(ref, prefix, target) -> np.ndarray:
    """transformers' log p of each target token after the prefix, the row alone."""
    with torch.no_grad():
        logp = torch.log_softmax(ref(torch.tensor([prefix + target])).logits[0], -1).numpy()
    return np.array([logp[len(prefix) - 1 + j, tok] for j, tok in enumerate(target)])


@pytest.mark.parametrize("variant", ["qwen2", "phi3"])
def test_score_equals_transformers_token_logprobs(tiny_hf, variant):
    ref, _, model = tiny_hf(variant)
    prefixes = [[5, 17, 33], [7, 8, 9, 10, 11, 12, 13], [99]]
    targets = [[40, 41, 42, 43], [2], [60, 61]]
    got = score(model.decoder, prefixes, targets, batch_size=2)
    for i, (p, t) in enumerate(zip(prefixes, targets)):
        want = _hf_target_logprobs(ref, p, t)
        np.testing.assert_allclose(got.per_token[i], want, atol=1e-4)
        assert abs(got.total[i] - want.sum()) < 1e-4


def test_a_groups_shared_prefix_is_read_once_and_scores_as_each_row_alone(tiny_hf):
    """Construct's rows of a question share its header and question: grouped, those tokens run
    once (real_tokens counts them once), and every row's log-probs are transformers' for it."""
    ref, _, model = tiny_hf("qwen2")
    prefixes = [[5, 17, 33, 9], [5, 17, 33, 40, 41], [5, 17, 2], [8, 9], [11, 12]]
    targets = [[60, 61], [62], [63, 64, 65], [66], [67]]
    # Packed rows of 16 tokens: the first group's unit (14 tokens), then the two others in one row.
    grouped = score(model.decoder, prefixes, targets, batch_size=4, groups=[0, 0, 0, 1, 2])
    alone = score(model.decoder, prefixes, targets, batch_size=4)
    for i, (p, t) in enumerate(zip(prefixes, targets)):
        want = _hf_target_logprobs(ref, p, t)
        np.testing.assert_allclose(grouped.per_token[i], want, atol=1e-4)
        np.testing.assert_allclose(alone.per_token[i], want, atol=1e-4)
    # [5, 17] once, then 33 9 60 61 / 33 40 41 62 / 2 63 64 65; the lone rows: 8 9 66, 11 12 67.
    assert grouped.real_tokens == 2 + 12 + 3 + 3
    assert alone.real_tokens == sum(len(p) + len(t) for p, t in zip(prefixes, targets)) == 24
    assert grouped.padded_tokens >= grouped.real_tokens


def test_score_buckets_pad_a_row_by_under_a_quarter():
    assert [score_bucket(n) for n in (1, 9, 17, 65, 129, 600, 1188)] == [8, 10, 20, 80, 160, 640, 1280]
    assert max((score_bucket(n) - n) / n for n in range(8, 3000)) < 0.25


def _hf_filtered(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """transformers' TopK then TopP warpers (generate's order) -> logits with the rest at -inf."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    scores = torch.tensor(logits)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    return TopPLogitsWarper(top_p)(None, scores).numpy()


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])  # flat, a real model's spread, one token dominant
def test_the_nucleus_is_transformers_top_p(scale):
    """`nucleus` (bisection, no sort) keeps exactly the tokens transformers' TopP warper keeps,
    over a 49k vocabulary, and leaves their logits as they were."""
    from jaxrag.decode.sampling import nucleus

    logits = np.asarray(jax.random.normal(jax.random.key(0), (6, 49152))) * scale
    for top_p in (0.5, 0.9, 0.99):
        want = _hf_filtered(logits, 0, top_p)
        got = np.asarray(nucleus(jax.numpy.asarray(logits), top_p))
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
        np.testing.assert_array_equal(got[np.isfinite(got)], logits[np.isfinite(want)])


@pytest.mark.parametrize("top_k,top_p", [(0, 0.7), (4, 1.0), (4, 0.8)])
def test_sampled_tokens_follow_transformers_warped_distribution(top_k, top_p):
    """20,000 draws of `sample_tokens` (one key each) over a 12-token vocabulary: never a token
    the warpers drop, and each kept token as often as its renormalised probability."""
    from jaxrag.decode.sampling import sample_tokens

    logits = np.log(np.array([[0.3, 0.2, 0.15, 0.1, 0.08, 0.06, 0.04, 0.03, 0.02, 0.01, 0.006, 0.004]], np.float32))
    want = torch.softmax(torch.tensor(_hf_filtered(logits / 0.8, top_k, top_p)), -1).numpy()[0]
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
    keys = jax.random.split(jax.random.key(3), 20_000)
    draws = np.asarray(jax.vmap(lambda k: sample_tokens(jax.numpy.asarray(logits), k[None], params)[0])(keys))
    freq = np.bincount(draws, minlength=12) / len(draws)
    assert set(np.flatnonzero(freq)) == set(np.flatnonzero(want))
    np.testing.assert_allclose(freq, want, atol=0.012)


def test_sampling_controls(tiny_hf):
    _, _, model = tiny_hf("llama")
    greedy = generate(model.decoder, PROMPTS, 8)
    assert generate(model.decoder, PROMPTS, 8, sampling=SamplingParams(temperature=1.0, top_k=1)) == greedy
    assert generate(model.decoder, PROMPTS, 8, sampling=SamplingParams(temperature=1.0, top_p=1e-6)) == greedy
    hot = SamplingParams(temperature=5.0)
    a = generate(model.decoder, PROMPTS, 8, sampling=hot, rng=jax.random.key(1))
    assert a == generate(model.decoder, PROMPTS, 8, sampling=hot, rng=jax.random.key(1))
    assert a != generate(model.decoder, PROMPTS, 8, sampling=hot, rng=jax.random.key(2))
    allowed = set(np.argsort(-np.asarray(model.logits([PROMPTS[0]]))[0, -1])[:3].tolist())
    for seed in range(5):
        first = generate(model.decoder, [PROMPTS[0]], 1, sampling=SamplingParams(1.0, top_k=3), rng=jax.random.key(seed))
        assert first[0][0] in allowed


def test_a_sampled_row_draws_the_same_in_any_batch(tiny_hf):
    """Sampling is keyed per row (`row_ids`): a prompt draws the same tokens alone, in a batch of
    other prompts at another position, and in a batch padded to 8 rows; another id draws others."""
    _, _, model = tiny_hf("llama")
    hot, rng = SamplingParams(temperature=5.0), jax.random.key(4)
    alone = generate(model.decoder, [PROMPTS[1]], 8, sampling=hot, rng=rng, row_ids=[7])
    batch = generate(model.decoder, [PROMPTS[0], PROMPTS[2], PROMPTS[1]], 8, sampling=hot, rng=rng, row_ids=[3, 5, 7])
    padded = generate(model.decoder, [PROMPTS[1], PROMPTS[0]], 8, sampling=hot, rng=rng, rows=8, row_ids=[7, 3])
    assert batch[2] == alone[0] == padded[0] and batch[0] == padded[1]
    assert generate(model.decoder, [PROMPTS[1]], 8, sampling=hot, rng=rng, row_ids=[8])[0] != alone[0]


def test_samples_share_one_prefill_and_draw_what_their_own_rows_draw(tiny_hf, monkeypatch):
    """`generate_samples`: each prompt is prefilled once (the prefill runs on the prompts' rows,
    not prompts x samples), and a sample draws what a row of its own with its id draws
    (`generate`); the end states are transformers' hidden state at each sample's last token."""
    from jaxrag.decode import sampler

    ref, _, model = tiny_hf("llama")
    hot, rng, ids = SamplingParams(temperature=5.0), jax.random.key(5), [11, 12, 13, 21, 22, 23]
    prefill_rows = []
    extend = sampler.extend
    monkeypatch.setattr(sampler, "extend", lambda dec, st, i, m, **kw: prefill_rows.append(i.shape[0]) or
                        extend(dec, st, i, m, **kw))
    texts, ends = sampler.generate_samples(model.decoder, PROMPTS[:2], 6, samples=3, sampling=hot, rng=rng,
                                           row_ids=ids, hidden_layer=2)
    assert prefill_rows == [2] and ends.shape == (2, 3, model.config.hidden_size)
    monkeypatch.setattr(sampler, "extend", extend)
    alone = generate(model.decoder, [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3, 6, sampling=hot, rng=rng, row_ids=ids)
    assert [t for per_prompt in texts for t in per_prompt] == alone
    assert len({tuple(t) for t in texts[0]}) > 1  # the samples differ
    for i, j in [(0, 0), (0, 2), (1, 1)]:
        seq = torch.tensor([PROMPTS[i] + texts[i][j]])
        want = ref(seq, output_hidden_states=True).hidden_states[2][0, -1].detach().numpy()
        np.testing.assert_allclose(ends[i, j], want, atol=1e-4)
    # one prompt: its one-row cache (no row axis, `LayerCache`) copied to its samples' rows
    one, one_ends = sampler.generate_samples(model.decoder, PROMPTS[1:2], 6, samples=3, sampling=hot, rng=rng,
                                             row_ids=ids[3:], hidden_layer=2)
    assert one == texts[1:]
    np.testing.assert_allclose(one_ends[0], ends[1], atol=1e-5)
    with pytest.raises(ValueError, match="5 row ids for 2 prompts x 3 samples"):
        sampler.generate_samples(model.decoder, PROMPTS[:2], 6, samples=3, row_ids=ids[:5])


def test_bad_batches_are_refused(tiny_hf):
    _, _, model = tiny_hf("qwen2")
    with pytest.raises(ValueError, match="empty batch"):
        generate(model.decoder, [], 4)
    with pytest.raises(ValueError, match="at least one token"):
        generate(model.decoder, [[1, 2], []], 4)
    with pytest.raises(ValueError, match="prefixes but"):
        score(model.decoder, [[1]], [])
