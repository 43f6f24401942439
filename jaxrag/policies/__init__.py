"""Source-selection policies: one interface, so every method runs on the same decoding engine.

A policy maps `PolicyInputs` (the batch's questions, p_M over the source tokens read at `<EOQ>`,
and the hidden state of the configured layer at `<EOQ>`) to a `PolicyDecision` (one source index
per row, plus whatever it measured, e.g. p_D, for reports).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from jaxrag.errors import JaxragError


class PolicyInputs(NamedTuple):
    questions: list[str]
    sources: tuple[str, ...]  # index order of the columns below
    p_model: np.ndarray  # [batch, n_sources] p_M(<s> | q), renormalised over the source tokens
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
