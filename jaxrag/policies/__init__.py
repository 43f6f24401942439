"""Source-selection policies: one interface, so every method runs on the same decoding engine.

A policy maps `PolicyInputs` (the batch's questions, p_M of each source token read at `<EOQ>`,
and the hidden state of the configured layer at `<EOQ>`) to a `PolicyDecision` (one source index
per row, plus whatever it measured, e.g. p_D, for reports).

p_M(<s> | q) is defined once, here (`source_probabilities`): the probability of the source token
as the next token after `<EOQ>`, a softmax over the whole vocabulary, as the paper thresholds
"the likelihood of the retrieval token following <EOQ>" (§4.1) and as stage 1 trains it
(L_src = -log p_M(<s> | q), Eq. 1). It is not renormalised over the source tokens: probability
left on other tokens is probability the model did not give to retrieval. Routing, the eval's
router inputs, the datastore and serving all read p_M through this function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from jaxrag.errors import JaxragError


class PolicyInputs(NamedTuple):
    questions: list[str]
    sources: tuple[str, ...]  # index order of the columns below
    p_model: np.ndarray  # [batch, n_sources] p_M(<s> | q) (`source_probabilities`)
    hidden: np.ndarray  # [batch, hidden] state of the datastore layer at <EOQ>


class PolicyDecision(NamedTuple):
    source: np.ndarray  # [batch] int index into sources
    p_datastore: np.ndarray | None = None  # [batch, n_sources] p_D, when the policy uses one
    score: np.ndarray | None = None  # [batch] the quantity thresholded (for AUROC)


Policy = Callable[[PolicyInputs], PolicyDecision]


def always(source: str) -> Policy:
    """Always-RAG (`wiki`) or always-verbalize (GenRead-style, `self`)."""

    def policy(inputs: PolicyInputs) -> PolicyDecision:
        if source not in inputs.sources:
            raise JaxragError(f"unknown source {source!r}; the model's sources are {list(inputs.sources)}")
        return PolicyDecision(np.full(len(inputs.questions), inputs.sources.index(source)))

    return policy


def source_probabilities(logits, source_ids) -> np.ndarray:
    """p_M(<s> | q) for each source token: next-token logits at `<EOQ>` [batch, vocab] -> the
    softmax over the whole vocabulary at the source tokens' ids [batch, n_sources], float64."""
    import jax
    import jax.numpy as jnp

    # On the logits' device: only [batch, n_sources] log-probabilities leave it.
    logits = jnp.asarray(logits, jnp.float32)
    log_p = logits[:, jnp.asarray(source_ids, jnp.int32)] - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    return np.exp(np.asarray(log_p, np.float64))


def router_inputs(model, questions: list[str], hidden_layer: int, batch_size: int = 32) -> PolicyInputs:
    """What `route()` hands a policy, without decoding anything after `<EOQ>`: one prefill of
    `Question: q Background knowledge:<EOQ>` per batch -> p_M (`source_probabilities`) and the
    hidden state of `hidden_layer` at `<EOQ>`. For choosing thresholds on validation questions."""
    from jaxrag.decode.sampler import prefill_last
    from jaxrag.models.tokens import source_token
    from jaxrag.prompts import prompt_ids

    if not questions:
        raise JaxragError("router_inputs: no questions")
    src_ids = [model.token_id(source_token(s)) for s in model.sources]
    p_model, hidden = [], []
    for n, state, h in prefill_last(model.decoder, prompt_ids(model.tokenizer, list(questions)), hidden_layer,
                                    batch_size):
        p_model.append(source_probabilities(state.logits[:n], src_ids))
        hidden.append(np.asarray(h[:n], np.float32))
    return PolicyInputs(list(questions), tuple(model.sources), np.concatenate(p_model), np.concatenate(hidden))
