"""Batched likelihood scoring: log p(target | prefix) for many (prefix, target) pairs.

Data construction scores 10 contexts and no context per question (l_j = p_M(a | q, c_j)) through
`score`, each question's header and question computed once for its rows. The policy datastore
scores the gold answer from the cache its routed prefix left (`extend_logprobs`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrag.decode.sampler import DecodeState, batch_rows, chunk_positions, on_mesh, placement
from jaxrag.models.decoder import Decoder
from jaxrag.train.losses import target_logprobs


class Scores(NamedTuple):
    total: np.ndarray  # [n] float: sum of target-token log-probs
    per_token: list[np.ndarray]  # n arrays [len(target_i)]
    real_tokens: int = 0  # tokens the forward passes had to read: shared prefixes once, then each row's rest
    padded_tokens: int = 0  # what they ran, padding included (length buckets, padding rows)


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


def score_bucket(n: int) -> int:
    """Scoring's padded length for n tokens: the next multiple of a quarter of the power of two
    below n (8, 10, 12, 14, 16, 20, 24, ...; at most 128), so a row pads by under a quarter."""
    n = max(int(n), 8)
    step = min(max(1 << (n - 1).bit_length() - 3, 2), 128)
    return -(-n // step) * step


# Packed scoring rows hold at most this many tokens (or the longest row, or the model's window):
# attention over a packed row is quadratic in its length.
PACK_TOKENS = 1024


@nnx.jit
def packed_logprobs(decoder: Decoder, ids, positions, segment_ids, branch_ids, targets) -> jax.Array:
    """Packed rows ids [R, L] (`score`'s units: a shared prefix, then its rows' rests, each rest
    seeing the prefix and itself) -> log p at the columns `targets` [R, k] (0 = unused), 0
    elsewhere [R, L]; the head runs at the targets only."""
    out = decoder(ids, positions, segment_ids > 0, segment_ids=segment_ids, branch_ids=branch_ids,
                  logit_positions=jnp.maximum(targets - 1, 0))
    return target_logprobs(out.logits, ids, targets)


def pack_units(rows: list[list[int]], members: list[list[int]], prefix_len: list[int], cap: int):
    """Each group's rows as units of at most `cap` tokens: (shared prefix, [(row, its rest)])."""
    units = []
    for m in members:
        # The shared prefix ends before each row's token preceding its target: that token's
        # logits score the target's first token, so it stays in the row's rest.
        cut = min(len(os.path.commonprefix([rows[i] for i in m])), *(prefix_len[i] - 1 for i in m))
        unit, size = [], cut
        for i in m:
            rest = rows[i][cut:]
            if unit and size + len(rest) > cap:
                units.append((rows[m[0]][:cut], unit))
                unit, size = [], cut
            unit.append((i, rest))
            size += len(rest)
        units.append((rows[m[0]][:cut], unit))
    return units


def score(decoder: Decoder, prefixes: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
          batch_size: int = 16, groups: Sequence | None = None) -> Scores:
    """log p(target_i | prefix_i) for each pair. Rows of one group (`groups[i]`; default: each row
    its own) share their longest common leading tokens, which run once: a unit is that prefix
    followed by its rows' rests, each rest attending to the prefix and to itself (construct's 11
    rows of a question read its header and question once). Units are packed first-fit into rows of
    one `score_bucket` length (at most `PACK_TOKENS`, or the longest row), `batch_size` rows' worth
    of tokens per call (padded, so the calls share one program), rows split over the decoder's
    mesh (`placement`). Scores' real_tokens / padded_tokens: the tokens run / with padding."""
    if len(prefixes) != len(targets):
        raise ValueError(f"score: {len(prefixes)} prefixes but {len(targets)} targets")
    if any(len(p) == 0 for p in prefixes):
        raise ValueError("score: every prefix needs at least one token (e.g. BOS or the question)")
    n, mesh, window = len(prefixes), placement(decoder), decoder.cfg.sliding_window
    rows = [list(p) + list(t) for p, t in zip(prefixes, targets)]
    members: dict = {}
    for i, g in enumerate(range(n) if groups is None else groups):
        members.setdefault(g, []).append(i)
    longest = max(map(len, rows))
    cap = max(min(PACK_TOKENS, window or PACK_TOKENS), longest)  # a window never bites within a row
    units = pack_units(rows, list(members.values()), [len(p) for p in prefixes], cap)
    sizes = [len(p) + sum(len(r) for _, r in u) for p, u in units]
    length = score_bucket(max(sizes))
    packed: list[list[int]] = []  # first-fit decreasing: each packed row's units
    room: list[int] = []
    for u in sorted(range(len(units)), key=lambda u: (-sizes[u], u)):
        j = next((j for j, r in enumerate(room) if r >= sizes[u]), None)
        if j is None:
            packed.append([]), room.append(length)
            j = len(packed) - 1
        packed[j].append(u)
        room[j] -= sizes[u]
    per_call = batch_rows(max(1, batch_size * score_bucket(longest) // length), mesh)
    k = score_bucket(max(sum(len(targets[i]) for u in p for i, _ in units[u][1]) for p in packed))
    logp: list[np.ndarray | None] = [None] * n
    for start in range(0, len(packed), per_call):
        ids, pos, seg, branch = (np.zeros((per_call, length), np.int32) for _ in range(4))
        at = np.zeros((per_call, k), np.int32)
        where = []  # (row, packed row, first target column)
        for r, row_units in enumerate(packed[start:start + per_call]):
            col, t = 0, 0
            for s, u in enumerate(row_units, 1):
                prefix, rests = units[u]
                ids[r, col:col + len(prefix)], pos[r, col:col + len(prefix)] = prefix, np.arange(len(prefix))
                seg[r, col:col + len(prefix)] = s
                col += len(prefix)
                for b, (i, rest) in enumerate(rests, 1):
                    ids[r, col:col + len(rest)], seg[r, col:col + len(rest)] = rest, s
                    pos[r, col:col + len(rest)] = len(prefix) + np.arange(len(rest))
                    branch[r, col:col + len(rest)] = b
                    first = col + len(rest) - len(targets[i])
                    at[r, t:t + len(targets[i])] = np.arange(first, col + len(rest))
                    where.append((i, r, first))
                    col, t = col + len(rest), t + len(targets[i])
        got = np.asarray(packed_logprobs(decoder, *(on_mesh(x, mesh) for x in (ids, pos, seg, branch, at))))
        for i, r, first in where:
            logp[i] = got[r, first:first + len(targets[i])]
    calls = -(-len(packed) // per_call)
    return Scores(np.asarray([float(x.sum()) for x in logp], np.float64), logp, sum(sizes), calls * per_call * length)
