"""What routing hands a source-selection policy and what it gets back, and p_M itself.

A policy maps `PolicyInputs` (the batch's questions, p_M of each source token read at `<EOQ>`,
and the hidden state of the configured layer at `<EOQ>`) to a `PolicyDecision` (one source index
per row, plus whatever it measured, e.g. p_D, for reports). The policies are `jaxrag.policies`.

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

import jax
import jax.numpy as jnp
import numpy as np


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


def source_probabilities(logits, source_ids) -> np.ndarray:
    """p_M(<s> | q) for each source token: next-token logits at `<EOQ>` [batch, vocab] -> the
    softmax over the whole vocabulary at the source tokens' ids [batch, n_sources], float64."""
    # On the logits' device: only [batch, n_sources] log-probabilities leave it.
    logits = jnp.asarray(logits, jnp.float32)
    log_p = logits[:, jnp.asarray(source_ids, jnp.int32)] - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    return np.exp(np.asarray(log_p, np.float64))
