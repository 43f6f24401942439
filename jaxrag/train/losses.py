"""Training objectives: the plain LM loss and SR-RAG's stage-1 and stage-2 losses (paper §3.3).

Every loss returns `LossTerms` of *sums* over the batch and the count they are averaged over, so
a gradient-accumulated step divides the summed micro-batch terms by the global count and equals
the full-batch step exactly. The reported loss is `total / count`.

Sequence log-probabilities are sums of token log-probabilities, as in the equations:
log p(c | q) = sum_t log p(c_t | q, c_<t). Stage losses average these per-example sums over the
real examples of the batch (padding rows have `valid = 0`); the LM loss averages over tokens.
Masks are on *target* positions: `mask[b, t] = 1` scores `ids[b, t]` given `ids[b, :t]`.

Batch keys (see `jaxrag.train.batches`): ids [b, t] int, mask [b, t] bool (real tokens) or int
(segment ids of packed documents, 0 = padding),
src / verb / ans [b, t] float (segment targets), valid [b] float; stage 2 adds rej_ids,
rej_mask, rej_verb (the rejected verbalization's sequence), ref_chosen / ref_rejected [b]
(reference log-probs) and dpo [b] (1 = a Self example).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

Forward = Callable[[jax.Array, jax.Array], jax.Array]  # (ids [b, t], mask [b, t]) -> logits [b, t, v]


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


def sequence_logprob(token_lp: jax.Array, mask: jax.Array) -> jax.Array:
    """[b, t] token log-probs, [b, t] target mask -> [b] log p(masked segment | its prefix)."""
    return jnp.sum(token_lp * mask.astype(token_lp.dtype), axis=-1)


def lm_loss(logits: jax.Array, ids: jax.Array, loss_mask: jax.Array) -> LossTerms:
    """Next-token cross-entropy for pretraining the tiny base model:

        L_LM = -(1 / N) sum_{b,t} m_{b,t} log p(x_{b,t} | x_{b,<t}),   N = sum_{b,t} m_{b,t}

    logits [b, t, v], ids [b, t], loss_mask [b, t] (position 0 is never a target)."""
    mask = loss_mask.astype(jnp.float32).at[:, 0].set(0.0)
    nll = -jnp.sum(token_logprobs(logits, ids) * mask)
    return LossTerms(nll, jnp.sum(mask), {"lm": nll})


def stage1_loss(logits: jax.Array, batch: dict) -> LossTerms:
    """SR-RAG stage 1 (Eq. 1-4), one sequence `q <EOQ><s> c <EOK> Answer: a` per example:

        L_src  = -log p_M(<s> | q)                                     (1)
        L_verb = -log p_M(c_i+ | q)   if s = Self,   0 if s = Wiki     (2)
        L_ans  = -log p_M(a | q, c_s+)  (c_i+ for Self, c_e+ [+ extra passages] for Wiki)  (3)
        L_stage1 = L_src + L_verb + L_ans, averaged over examples       (4)

    The featurizer zeroes `verb` on Wiki examples, so L_verb is exactly 0 for them.
    logits [b, t, v]; batch: ids, src, verb, ans [b, t], valid [b]."""
    lp = token_logprobs(logits, batch["ids"])
    valid = batch["valid"].astype(jnp.float32)
    parts = {name: -jnp.sum(valid * sequence_logprob(lp, batch[name])) for name in ("src", "verb", "ans")}
    return LossTerms(parts["src"] + parts["verb"] + parts["ans"], jnp.sum(valid), parts)


def dpo_loss(policy_chosen: jax.Array, policy_rejected: jax.Array, ref_chosen: jax.Array,
             ref_rejected: jax.Array, beta: float) -> jax.Array:
    """DPO on a verbalization pair (Eq. 6), per example ([b] sequence log-probs -> [b]):

        -log sigmoid(beta log(p_M(c_i+|q) / p_ref(c_i+|q)) - beta log(p_M(c_i-|q) / p_ref(c_i-|q)))"""
    margin = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    return -jax.nn.log_sigmoid(beta * margin)


def stage2_loss(logits_chosen: jax.Array, logits_rejected: jax.Array, batch: dict, beta: float) -> LossTerms:
    """SR-RAG stage 2 (Eq. 5-6): L_src + L_verb^DPO + L_ans, averaged over examples.

    L_src and L_ans are Eq. 1 and 3 on the chosen sequence (c_i+ for Self, c_e+ for Wiki);
    L_verb^DPO is `dpo_loss` on (c_i+, c_i-) for Self examples and 0 for Wiki examples, with the
    reference log-probs precomputed once by the frozen stage-1 model.
    logits_* [b, t, v]; batch: ids, rej_ids, src, verb, rej_verb, ans [b, t]; valid, dpo,
    ref_chosen, ref_rejected [b]."""
    lp = token_logprobs(logits_chosen, batch["ids"])
    lp_rej = token_logprobs(logits_rejected, batch["rej_ids"])
    valid = batch["valid"].astype(jnp.float32)
    verb = dpo_loss(sequence_logprob(lp, batch["verb"]), sequence_logprob(lp_rej, batch["rej_verb"]),
                    batch["ref_chosen"], batch["ref_rejected"], beta)
    parts = {"src": -jnp.sum(valid * sequence_logprob(lp, batch["src"])),
             "verb_dpo": jnp.sum(valid * batch["dpo"] * verb),
             "ans": -jnp.sum(valid * sequence_logprob(lp, batch["ans"]))}
    return LossTerms(parts["src"] + parts["verb_dpo"] + parts["ans"], jnp.sum(valid), parts)


# Objectives: how each task runs the model on its batch and scores it.

def lm_objective(forward: Forward, batch: dict) -> LossTerms:
    return lm_loss(forward(batch["ids"], batch["mask"]), batch["ids"], batch["loss_mask"])


def stage1_objective(forward: Forward, batch: dict) -> LossTerms:
    return stage1_loss(forward(batch["ids"], batch["mask"]), batch)


def stage2_objective(beta: float) -> Callable[[Forward, dict], LossTerms]:
    def objective(forward: Forward, batch: dict) -> LossTerms:
        # Chosen and rejected sequences in one forward pass of twice the batch.
        logits = forward(jnp.concatenate([batch["ids"], batch["rej_ids"]]),
                         jnp.concatenate([batch["mask"], batch["rej_mask"]]))
        b = batch["ids"].shape[0]
        return stage2_loss(logits[:b], logits[b:], batch, beta)
    return objective


def verbalization_logprobs(forward: Forward, batch: dict) -> jax.Array:
    """[2, b]: log p(c_i+ | q) and log p(c_i- | q) for the reference model (0 for Wiki rows)."""
    chosen = sequence_logprob(token_logprobs(forward(batch["ids"], batch["mask"]), batch["ids"]), batch["verb"])
    rejected = sequence_logprob(token_logprobs(forward(batch["rej_ids"], batch["rej_mask"]), batch["rej_ids"]),
                                batch["rej_verb"])
    return jnp.stack([chosen, rejected])
