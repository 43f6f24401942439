"""Training objectives: the plain LM loss and SR-RAG's stage-1 and stage-2 losses (paper §3.3).

Every loss returns `LossTerms` of *sums* over the batch and the count they are averaged over, so
a gradient-accumulated step divides the summed micro-batch terms by the global count and equals
the full-batch step exactly. The reported loss is `total / count`.

Losses read token log-probabilities lp [b, t], lp[b, t] = log p(ids[b, t] | ids[b, :t]).
Sequence log-probabilities are their sums, as in the equations: log p(c | q) = sum_t log
p(c_t | q, c_<t). Stage losses average these per-example sums over the real examples of the batch
(padding rows have `valid = 0`); the LM loss averages over tokens. Masks are on *target*
positions: `mask[b, t] = 1` scores `ids[b, t]` given `ids[b, :t]`. The stage objectives have
the model's head computed at their target positions only (`targets`, see `target_logprobs`):
a Wiki example's passage is context, never a target.

Batch keys (see `jaxrag.train.batches`): ids [b, t] int, mask [b, t] bool (real tokens) or int
(segment ids of packed documents, 0 = padding),
src / verb / ans [b, t] float (segment targets), valid [b] float; stage 2 adds rej_ids,
rej_mask, rej_verb (the rejected verbalization's sequence), ref_chosen / ref_rejected [b]
(reference log-probs) and dpo [b] (1 = a Self example); targets / rej_targets [b, k] int are the
positions of every target of a row (0 = an unused slot).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

# (ids [b, t], mask [b, t], targets [b, k] or None = every position) -> token log-probs [b, t],
# 0 off the targets
Forward = Callable[[jax.Array, jax.Array, jax.Array | None], jax.Array]


class LossTerms(NamedTuple):
    total: jax.Array  # [] sum over the batch of the per-unit loss (differentiated)
    count: jax.Array  # [] units the sums are averaged over: tokens (LM) or real examples
    parts: dict[str, jax.Array]  # [] sums of each component, same units as `total`


def token_logprobs(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """logits [b, t, v], ids [b, t] -> [b, t]: out[:, i] = log p(ids[:, i] | ids[:, :i]), out[:, 0] = 0."""
    logits = logits[:, :-1].astype(jnp.float32)
    target = jnp.take_along_axis(logits, ids[:, 1:, None], axis=-1)[..., 0]
    lp = target - jax.nn.logsumexp(logits, axis=-1)
    return jnp.pad(lp, ((0, 0), (1, 0)))


def target_logprobs(logits: jax.Array, ids: jax.Array, targets: jax.Array) -> jax.Array:
    """`token_logprobs` from the logits at the target positions only: logits [b, k, v] taken at
    positions targets - 1, ids [b, t], targets [b, k] (0 = unused slot) -> [b, t], 0 off target."""
    logits = logits.astype(jnp.float32)
    target = jnp.take_along_axis(logits, jnp.take_along_axis(ids, targets, axis=1)[..., None], axis=-1)[..., 0]
    lp = jnp.where(targets > 0, target - jax.nn.logsumexp(logits, axis=-1), 0.0)
    return jnp.zeros(ids.shape, jnp.float32).at[jnp.arange(ids.shape[0])[:, None], targets].add(lp)


def sequence_logprob(token_lp: jax.Array, mask: jax.Array) -> jax.Array:
    """[b, t] token log-probs, [b, t] target mask -> [b] log p(masked segment | its prefix)."""
    return jnp.sum(token_lp * mask.astype(token_lp.dtype), axis=-1)


def lm_loss(lp: jax.Array, loss_mask: jax.Array) -> LossTerms:
    """Next-token cross-entropy for pretraining the tiny base model:

        L_LM = -(1 / N) sum_{b,t} m_{b,t} log p(x_{b,t} | x_{b,<t}),   N = sum_{b,t} m_{b,t}

    lp [b, t] token log-probs, loss_mask [b, t] (position 0 is never a target)."""
    mask = loss_mask.astype(jnp.float32).at[:, 0].set(0.0)
    nll = -jnp.sum(lp * mask)
    return LossTerms(nll, jnp.sum(mask), {"lm": nll})


def stage1_loss(lp: jax.Array, batch: dict) -> LossTerms:
    """SR-RAG stage 1 (Eq. 1-4), one sequence `q <EOQ><s> c <EOK> Answer: a` per example:

        L_src  = -log p_M(<s> | q)                                     (1)
        L_verb = -log p_M(c_i+ | q)   if s = Self,   0 if s = Wiki     (2)
        L_ans  = -log p_M(a | q, c_s+)  (c_i+ for Self, c_e+ [+ extra passages] for Wiki)  (3)
        L_stage1 = L_src + L_verb + L_ans, averaged over examples       (4)

    The featurizer zeroes `verb` on Wiki examples, so L_verb is exactly 0 for them.
    lp [b, t] token log-probs; batch: src, verb, ans [b, t], valid [b]."""
    valid = batch["valid"].astype(jnp.float32)
    parts = {name: -jnp.sum(valid * sequence_logprob(lp, batch[name])) for name in ("src", "verb", "ans")}
    return LossTerms(parts["src"] + parts["verb"] + parts["ans"], jnp.sum(valid), parts)


def dpo_loss(policy_chosen: jax.Array, policy_rejected: jax.Array, ref_chosen: jax.Array,
             ref_rejected: jax.Array, beta: float) -> jax.Array:
    """DPO on a verbalization pair (Eq. 6), per example ([b] sequence log-probs -> [b]):

        -log sigmoid(beta log(p_M(c_i+|q) / p_ref(c_i+|q)) - beta log(p_M(c_i-|q) / p_ref(c_i-|q)))"""
    margin = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    return -jax.nn.log_sigmoid(beta * margin)


def stage2_loss(lp: jax.Array, lp_rej: jax.Array, batch: dict, beta: float) -> LossTerms:
    """SR-RAG stage 2 (Eq. 5-6): L_src + L_verb^DPO + L_ans, averaged over examples.

    L_src and L_ans are Eq. 1 and 3 on the chosen sequence (c_i+ for Self, c_e+ for Wiki);
    L_verb^DPO is `dpo_loss` on (c_i+, c_i-) for Self examples and 0 for Wiki examples, with the
    reference log-probs precomputed once by the frozen stage-1 model.
    lp / lp_rej [b, t] token log-probs of the chosen / rejected sequences; batch: src, verb,
    rej_verb, ans [b, t]; valid, dpo, ref_chosen, ref_rejected [b]."""
    valid = batch["valid"].astype(jnp.float32)
    verb = dpo_loss(sequence_logprob(lp, batch["verb"]), sequence_logprob(lp_rej, batch["rej_verb"]),
                    batch["ref_chosen"], batch["ref_rejected"], beta)
    parts = {"src": -jnp.sum(valid * sequence_logprob(lp, batch["src"])),
             "verb_dpo": jnp.sum(valid * batch["dpo"] * verb),
             "ans": -jnp.sum(valid * sequence_logprob(lp, batch["ans"]))}
    return LossTerms(parts["src"] + parts["verb_dpo"] + parts["ans"], jnp.sum(valid), parts)


# Objectives: how each task runs the model on its batch and scores it.

def lm_objective(forward: Forward, batch: dict) -> LossTerms:
    return lm_loss(forward(batch["ids"], batch["mask"], None), batch["loss_mask"])


def stage1_objective(forward: Forward, batch: dict) -> LossTerms:
    return stage1_loss(forward(batch["ids"], batch["mask"], batch["targets"]), batch)


def stage2_objective(beta: float) -> Callable[[Forward, dict], LossTerms]:
    def objective(forward: Forward, batch: dict) -> LossTerms:
        # Chosen and rejected sequences in one forward pass of twice the batch.
        lp = forward(*(jnp.concatenate([batch[k], batch[f"rej_{k}"]]) for k in ("ids", "mask", "targets")))
        b = batch["ids"].shape[0]
        return stage2_loss(lp[:b], lp[b:], batch, beta)
    return objective


def verbalization_logprobs(forward: Forward, batch: dict) -> jax.Array:
    """[2, b]: log p(c_i+ | q) and log p(c_i- | q) for the reference model (0 for Wiki rows)."""
    chosen = sequence_logprob(forward(batch["ids"], batch["mask"], batch["targets"]), batch["verb"])
    rejected = sequence_logprob(forward(batch["rej_ids"], batch["rej_mask"], batch["rej_targets"]), batch["rej_verb"])
    return jnp.stack([chosen, rejected])
