"""SeaKR's self-aware retrieval trigger (Yao et al. 2024, arXiv:2406.19215): sample k = 20
closed-book generations, take the middle-layer hidden state at each generation's end token, and
measure how dispersed they are; retrieve iff the uncertainty exceeds a threshold.

Uncertainty (SeaKR's released code, after INSIDE's EigenScore): with Z [k, d] the end-token
states and J_d = I - 1/d 11^T (centres each vector over its features),

    U = (1/k) * log det(Z J_d Z^T + alpha I_k),   alpha = 1e-3.

Empty generations (nothing but the stop token) are dropped first, as SeaKR does. Sampling follows
SeaKR's release (temperature 1.0, top-k 50, top-p 0.9). Only the when-to-retrieve part of SeaKR
is used here: its re-ranking and reasoning-strategy selection have no counterpart in a single
retrieve-or-not routing decision. SeaKR reads its "EOS embedding" when the stop token is fed back
in; here that is the state at the stop token of prompt + generation (the last generated token
when a sample runs out of budget), read in the decode loop as the token is written. Its vLLM hook
takes layer 15's MLP output; we take the residual stream at L/2 (transformers' hidden_states).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jaxrag.decode.policy import Policy, PolicyDecision, PolicyInputs
from jaxrag.decode.sampler import SamplingParams
from jaxrag.models.model import Model
from jaxrag.policies.ik import (
    closed_book_samples,
    default_stop_ids,
    last_token_states,
    middle_layer,
    retrieve_sources,
)

SEAKR_SAMPLES = 20
SEAKR_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
EIGEN_ALPHA = 1e-3
# No usable sample: SeaKR's release falls back to eigen_score 0 (`uncertainty.get('eigen_score', 0)`).
EMPTY_SCORE = 0.0


def eigen_score(states: np.ndarray, alpha: float = EIGEN_ALPHA) -> float:
    """(1/k) log det(Z J_d Z^T + alpha I): Z [k, d] -> scalar; larger = more dispersed samples.
    Z J_d is Z with each row's mean removed, so the [d, d] centring matrix is never built."""
    z = np.asarray(states, np.float64)
    centred = z - z.mean(axis=1, keepdims=True)
    gram = centred @ centred.T + alpha * np.eye(len(z))
    sign, logdet = np.linalg.slogdet(gram)  # positive definite: sign is +1
    return float(logdet / len(z)) if sign > 0 else float("nan")


def _is_empty(tokenizer, generation: Sequence[int], stops: set[int]) -> bool:
    text = tokenizer.decode([t for t in generation if t not in stops], skip_special_tokens=True)
    return not text.strip()


def _kept(tokenizer, generations: Sequence[Sequence[Sequence[int]]], stops: set[int]) -> list[list[int]]:
    """Per question, the samples that say something besides the stop token."""
    return [[j for j, g in enumerate(gens) if g and not _is_empty(tokenizer, g, stops)] for gens in generations]


def _eigen_scores(keep: list[list[int]], states_of, alpha: float) -> np.ndarray:
    """Per question: the eigen score of its kept samples' states (`states_of(i, kept)` -> [k, d]),
    or EMPTY_SCORE when none is kept."""
    return np.array([eigen_score(states_of(i, js), alpha) if js else EMPTY_SCORE for i, js in enumerate(keep)])


def end_token_uncertainty(model: Model, prompts: Sequence[Sequence[int]],
                          generations: Sequence[Sequence[Sequence[int]]], *, layer: int | None = None,
                          alpha: float = EIGEN_ALPHA, stop_ids: Sequence[int] | None = None,
                          max_rows: int = 64) -> np.ndarray:
    """Per question: eigen score of given samples' end-token states at `layer` -> [n], each read
    by a prefill of prompt + sample. prompts[i] + generations[i][j] is sample j of question i
    (stop token kept). `seakr_uncertainty` reads the states its own samples end on as it decodes them."""
    layer = middle_layer(model) if layer is None else layer
    keep = _kept(model.tokenizer, generations, set(default_stop_ids(model) if stop_ids is None else stop_ids))
    sequences = [list(p) + list(gens[j]) for p, gens, js in zip(prompts, generations, keep) for j in js]
    states = last_token_states(model, sequences, layer, max_rows) if sequences else None
    starts = np.cumsum([0, *map(len, keep)])
    return _eigen_scores(keep, lambda i, js: states[starts[i]:starts[i] + len(js)], alpha)


def seakr_uncertainty(model: Model, questions: Sequence[str], *, samples: int = SEAKR_SAMPLES,
                      layer: int | None = None, max_new_tokens: int = 64,
                      sampling: SamplingParams = SEAKR_SAMPLING, alpha: float = EIGEN_ALPHA,
                      rng: jax.Array | None = None, stop_ids: Sequence[int] | None = None,
                      max_rows: int = 128) -> np.ndarray:
    """SeaKR's uncertainty U(q) for each question's closed-book prompt -> [n]: the prompt is
    prefilled once for its samples, and each sample's end-token state is read as it is decoded
    (`ik.closed_book_samples`). `max_new_tokens` 64 = the answer budget of routed decoding
    (SeaKR's 100 is for CoT steps); `stop_ids` default EOS (SeaKR also stops at a newline: pass
    its token ids for chatty models)."""
    layer = middle_layer(model) if layer is None else layer
    gens, states = closed_book_samples(model, questions, max_new_tokens, samples=samples, sampling=sampling,
                                       rng=rng, stop_ids=stop_ids, max_rows=max_rows, layer=layer)
    keep = _kept(model.tokenizer, gens, set(default_stop_ids(model) if stop_ids is None else stop_ids))
    return _eigen_scores(keep, lambda i, js: states[i, js], alpha)


def fit_seakr_threshold(uncertainty: np.ndarray, needs_retrieval: np.ndarray) -> float:
    """SeaKR is tuning-free except its threshold, "searched on a small subset of the training
    set": the cut (midpoint between neighbouring scores) that best agrees with the labels."""
    u, y = np.asarray(uncertainty, np.float64), np.asarray(needs_retrieval, bool)
    values = np.unique(u)
    cuts = np.concatenate([[values[0] - 1.0], (values[1:] + values[:-1]) / 2, [values[-1] + 1.0]])
    agreement = [np.mean((u > c) == y) for c in cuts]
    return float(cuts[int(np.argmax(agreement))])


def seakr_policy(model: Model, threshold: float, *, samples: int = SEAKR_SAMPLES, layer: int | None = None,
                 max_new_tokens: int = 64, sampling: SamplingParams = SEAKR_SAMPLING, alpha: float = EIGEN_ALPHA,
                 rng: jax.Array | None = None, stop_ids: Sequence[int] | None = None,
                 max_rows: int = 128) -> Policy:
    """Retrieve iff U(q) > threshold; `score` = U(q)."""

    def policy(inputs: PolicyInputs) -> PolicyDecision:
        u = seakr_uncertainty(model, inputs.questions, samples=samples, layer=layer, max_new_tokens=max_new_tokens,
                              sampling=sampling, alpha=alpha, rng=rng, stop_ids=stop_ids, max_rows=max_rows)
        return PolicyDecision(retrieve_sources(u > threshold, inputs.sources), score=u)

    return policy
