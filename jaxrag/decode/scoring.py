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

from jaxrag.decode.sampler import (DecodeState, batch_rows, bucket, chunk_positions, extend, gather_rows, init_state,
                                   left_pad, on_mesh, placement)
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
    return _extend_logprobs(decoder, state, ids, mask, targets)


def _extend_logprobs(decoder: Decoder, state: DecodeState, ids, mask, targets) -> jax.Array:
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


class SharedScores(NamedTuple):
    totals: list[np.ndarray]  # per group: [its prefixes] log p(target | prefix)
    real_tokens: int  # tokens the groups hold (each shared prefix counted once)
    padded_tokens: int  # tokens the batches computed, padding included


def shared_prefix(rows: Sequence[Sequence[int]]) -> int:
    """The longest common token prefix of `rows`, leaving each row at least one token of its own
    (its last, which predicts the target's first)."""
    limit, k = min(map(len, rows)) - 1, 0
    while k < limit and all(r[k] == rows[0][k] for r in rows):
        k += 1
    return k


def columns(n: int) -> int:
    """Padded columns of a scoring pass: the next power of two up to 32, then the next multiple of
    32 (finer than `sampler.bucket`: a pass computes every padded column of every row)."""
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length() if n <= 32 else -(-n // 32) * 32


def class_rows(n: int, mesh=None) -> int:
    """Rows a length class of n rows runs: the next power of two up to 8, then the next multiple
    of 8 (few programs, little padding), a multiple of the mesh's data-parallel size."""
    size = 1 << (n - 1).bit_length() if n <= 8 else -(-n // 8) * 8
    return batch_rows(n, mesh, size=size)


def length_classes(lengths: Sequence[int], mesh=None) -> list[list[int]]:
    """Rows (indices into `lengths`) in at most two classes of similar length, each padded to its
    own width: the split of the sorted lengths that computes the fewest tokens (rows padded to
    `class_rows`, columns to `columns`), one class where a split saves nothing."""
    order = sorted(range(len(lengths)), key=lambda r: (lengths[r], r))

    def cost(part: list[int]) -> int:
        return class_rows(len(part), mesh) * columns(lengths[part[-1]]) if part else 0

    best = min(range(len(order)), key=lambda k: (cost(order[:k]) + cost(order[k:]), k))
    return [c for c in (order[:best], order[best:]) if c]


def score_groups(decoder: Decoder, groups: Sequence[Sequence[Sequence[int]]], targets: Sequence[Sequence[int]],
                 batch_size: int = 32) -> SharedScores:
    """log p(targets[g] | p) for every prefix p of every group g, each group's common prefix
    computed once: the groups' shared prefixes are prefilled together, and each row takes its
    group's cache (`sampler.gather_rows`), appends only what is its own and the target, and reads
    the target's log-probs from that chunk (`extend_logprobs`), rows of similar length together
    (`length_classes`: a group's rows differ, e.g. no context against a passage). A pass takes as
    many whole groups as `batch_size` rows hold, at least one per device of the decoder's mesh
    (groups in order of length)."""
    if len(groups) != len(targets):
        raise ValueError(f"score_groups: {len(groups)} groups but {len(targets)} targets")
    if any(not g or any(len(p) == 0 for p in g) for g in groups):
        raise ValueError("score_groups: every group needs a prefix, and every prefix a token")
    mesh, per_group = placement(decoder), max(map(len, groups))
    # whole groups, as many as `batch_size` rows hold, rounded up to fill every device's rows
    fit = max(1, batch_size // per_group)
    per_pass = batch_rows(fit, mesh, size=fit)
    shared = [shared_prefix(g) for g in groups]
    order = sorted(range(len(groups)), key=lambda g: (max(map(len, groups[g])) + len(targets[g]), g))
    totals = [np.zeros(len(g), np.float64) for g in groups]
    real = padded = 0
    for start in range(0, len(order), per_pass):
        part = order[start:start + per_pass]
        heads = [list(groups[g][0][:shared[g]]) for g in part]
        rows = [(i, j, [*groups[g][j][shared[g]:], *targets[g]]) for i, g in enumerate(part) for j in range(len(groups[g]))]
        n_heads = batch_rows(len(part), mesh, size=per_pass)
        head_len, width = columns(max(map(len, heads), default=1)), columns(max(len(r) for _, _, r in rows))
        state = init_state(decoder, n_heads, head_len + width)
        ids, mask = left_pad(heads, head_len, n_heads)
        state, _ = extend(decoder, state, on_mesh(ids, mesh), on_mesh(mask, mesh))
        real, padded = real + sum(map(len, heads)), padded + n_heads * head_len
        for cls in length_classes([len(r) for _, _, r in rows], mesh):
            n, cols = class_rows(len(cls), mesh), columns(max(len(rows[r][2]) for r in cls))
            # padding rows take the first head's cache and add nothing
            taken = gather_rows(decoder, state, [rows[r][0] for r in cls] + [rows[cls[0]][0]] * (n - len(cls)))
            ids, mask = left_pad([rows[r][2] for r in cls], cols, n)
            at = np.zeros((n, bucket(max(len(targets[part[rows[r][0]]]) for r in cls), 1)), np.int32)
            for k, r in enumerate(cls):  # rows are left-padded: the target ends its row
                t = len(targets[part[rows[r][0]]])
                at[k, :t] = np.arange(cols - t, cols)
            logp = np.asarray(extend_logprobs(decoder, taken, on_mesh(ids, mesh), on_mesh(mask, mesh),
                                              on_mesh(at, mesh)))
            for k, r in enumerate(cls):
                i, j, _ = rows[r]
                totals[part[i]][j] = logp[k].sum(dtype=np.float64)
            real, padded = real + sum(len(rows[r][2]) for r in cls), padded + n * cols
    return SharedScores(totals, real, padded)
