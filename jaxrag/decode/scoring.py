"""Batched likelihood scoring: log p(target | prefix) for many (prefix, target) pairs.

Data construction scores 10 contexts per question (l_j = p_M(a | q, c_j)), DPO needs sequence
log-probs of chosen / rejected verbalizations; both go through `score`. The policy datastore
scores the gold answer from the cache its routed prefix left (`extend_logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrag.decode.sampler import DecodeState, batch_rows, bucket, chunk_positions, left_pad, on_mesh, placement
from jaxrag.models.decoder import Decoder
from jaxrag.models.masks import positions_from_mask
from jaxrag.train.losses import target_logprobs


class Scores(NamedTuple):
    total: np.ndarray  # [n] float: sum of target-token log-probs
    per_token: list[np.ndarray]  # n arrays [len(target_i)]


@nnx.jit
def sequence_token_logprobs(decoder: Decoder, ids: jax.Array, mask: jax.Array, targets: jax.Array) -> jax.Array:
    """ids/mask [batch, seq], targets [batch, k] positions (0 = unused) -> [batch, seq]
    log p(ids[:, t] | ids[:, :t]) at the targets, 0 elsewhere; the head runs there only."""
    out = decoder(ids, positions_from_mask(mask), mask, logit_positions=jnp.maximum(targets - 1, 0))
    return target_logprobs(out.logits, ids, targets)


@nnx.jit
def extend_logprobs(decoder: Decoder, state: DecodeState, ids, mask, targets) -> jax.Array:
    """Appends a left-padded chunk ids/mask [batch, t] to every row's cache (as `sampler.extend`)
    and returns log p(ids[:, j] | all the row holds before j) at the chunk's columns `targets`
    [batch, k] (0 = unused; column 0 is never one), 0 elsewhere [batch, t]: a continuation scored
    from the cache a prefill left, the head run at the targets only."""
    positions, key_mask = chunk_positions(state, mask.astype(bool))
    out = decoder(ids, positions, key_mask, cache=state.cache, cache_index=state.slot,
                  logit_positions=jnp.maximum(targets - 1, 0))
    return target_logprobs(out.logits, ids, targets)


def score(decoder: Decoder, prefixes: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
          batch_size: int = 16) -> Scores:
    """log p(target_i | prefix_i) for each pair, in jitted batches of `batch_size` rows (the last
    one padded to it, so it runs the same program), split over the decoder's mesh (`placement`)."""
    if len(prefixes) != len(targets):
        raise ValueError(f"score: {len(prefixes)} prefixes but {len(targets)} targets")
    if any(len(p) == 0 for p in prefixes):
        raise ValueError("score: every prefix needs at least one token (e.g. BOS or the question)")
    totals, per_token, mesh = [], [], placement(decoder)
    for start in range(0, len(prefixes), batch_size):
        rows = [list(p) + list(t) for p, t in zip(prefixes[start:start + batch_size], targets[start:start + batch_size])]
        length = bucket(max(len(r) for r in rows))
        ids, mask = left_pad(rows, length, batch_rows(len(rows), mesh, size=batch_size))
        part = targets[start:start + batch_size]
        at = np.zeros((len(ids), min(length, bucket(max(map(len, part)), 1))), np.int32)
        for i, target in enumerate(part):  # rows are left-padded: a target ends its row
            at[i, :len(target)] = np.arange(length - len(target), length)
        logp = np.asarray(sequence_token_logprobs(decoder, on_mesh(ids, mesh), on_mesh(mask, mesh), on_mesh(at, mesh)))
        for i, target in enumerate(part):
            tok = logp[i, length - len(target):] if len(target) else np.zeros(0, np.float32)
            per_token.append(tok)
            totals.append(float(tok.sum()))
    return Scores(np.asarray(totals, np.float64), per_token)
