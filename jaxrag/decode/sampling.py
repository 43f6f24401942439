"""Sampling controls for every decode loop: greedy, temperature, top-k and top-p, with one key per
row (`row_keys`), so a row draws the same tokens in any batch and on any device.

`sampler.decode` draws with one `SamplingParams` for its whole batch (`sample_tokens`); the
slot pool (`slots.sample_rows`) draws with each row's own temperature and top-p (`nucleus`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1.0 = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


def top_p_cutoff(descending: jax.Array, top_p: float) -> jax.Array:
    """Logits [batch, c] sorted descending -> the smallest logit of the top-p nucleus [batch, 1]:
    the smallest prefix whose mass reaches `top_p` (the first token always stays)."""
    probs = jax.nn.softmax(descending, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens above each one
    keep = jnp.sum(before < top_p, axis=-1, keepdims=True)  # >= 1: before[0] is 0
    return jnp.take_along_axis(descending, keep - 1, axis=-1)


# Bisection steps for the nucleus of a whole vocabulary: the cutoff is searched within 64 nats of
# the top logit (a token further down has less than e^-64 of its mass), to 64 / 2^40 nats.
NUCLEUS_RANGE, NUCLEUS_STEPS = 64.0, 40


def nucleus(logits: jax.Array, top_p: float) -> jax.Array:
    """logits [batch, vocab] with every token outside the top-p nucleus at -inf. The cutoff is
    the largest logit t whose tokens at or above it hold top_p of the mass, found by bisection
    (mass(t) falls as t rises): O(vocab) per step on every backend, where sorting the vocabulary
    costs seconds per decode step on a CPU (XLA-CPU sorts with a comparator call per comparison)."""
    probs = jax.nn.softmax(logits, axis=-1)
    top = jnp.max(logits, axis=-1, keepdims=True)

    def step(_, bounds):
        lo, hi = bounds  # mass(lo) >= top_p > mass(hi)
        mid = (lo + hi) / 2
        enough = jnp.sum(jnp.where(logits >= mid, probs, 0.0), axis=-1, keepdims=True) >= top_p
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    lo, _ = jax.lax.fori_loop(0, NUCLEUS_STEPS, step, (top - NUCLEUS_RANGE, top + 1.0))
    return jnp.where(logits < lo, -jnp.inf, logits)


def candidates(logits: jax.Array, sampling: SamplingParams) -> tuple[jax.Array, jax.Array | None]:
    """What a sampled draw chooses among: (candidate logits [batch, c], their token ids [batch, c],
    or None when the candidates are the whole vocabulary), tokens outside at -inf. Top-k keeps
    the k highest logits, then top-p the smallest prefix of what is left whose mass reaches p
    (transformers' TopK then TopP warpers)."""
    logits = logits / sampling.temperature
    if sampling.top_k > 0:
        values, ids = jax.lax.top_k(logits, min(sampling.top_k, logits.shape[-1]))
        if sampling.top_p < 1.0:
            values = jnp.where(values < top_p_cutoff(values, sampling.top_p), -jnp.inf, values)
        return values, ids
    return (nucleus(logits, sampling.top_p) if sampling.top_p < 1.0 else logits), None


def sample_tokens(logits: jax.Array, keys: jax.Array, sampling: SamplingParams) -> jax.Array:
    """logits [batch, vocab] -> token ids [batch]: greedy at temperature 0, else a draw among
    `candidates`, row i's with its own key keys[i] (so a row draws the same token in any batch)."""
    if sampling.temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    values, ids = candidates(logits, sampling)
    choice = jax.vmap(jax.random.categorical)(keys, values)
    if ids is not None:
        choice = jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]
    return choice.astype(jnp.int32)


def row_keys(rng: jax.Array, row_ids) -> jax.Array:
    """One key per row, [batch]: `rng` folded with each row's id, so that a row's draws depend on
    the id its caller gives it (its question's), never on the batch or device it runs in."""
    return jax.vmap(jax.random.fold_in, (None, 0))(rng, jnp.asarray(row_ids, jnp.uint32))
