"""SR-RAG's source selection (paper §3.4, Eq. 7): the model's own preference p_M, calibrated by
a kNN policy datastore p_D over hidden states at `<EOQ>`."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxrag.decode.policy import Policy, PolicyDecision, PolicyInputs

# keys [batch, hidden] -> labels [batch, k] (source indices of the k nearest datastore entries)
Neighbours = Callable[[np.ndarray], np.ndarray]


def datastore_neighbours(datastore, k: int) -> Neighbours:
    """A `PolicyDatastore`'s k nearest labels as the policy's `neighbours`."""
    return lambda keys: datastore.neighbour_labels(np.asarray(keys, np.float32), k)


def policy_distribution(neighbour_labels: np.ndarray, n_sources: int) -> np.ndarray:
    """p_D(<s> | q) = share of the k nearest neighbours labelled s. [batch, k] -> [batch, n_sources]."""
    counts = np.stack([(neighbour_labels == s).sum(axis=1) for s in range(n_sources)], axis=1)
    return counts / neighbour_labels.shape[1]


def choose_source(p_model: np.ndarray, p_datastore: np.ndarray, sources: tuple[str, ...], tau: float):
    """Eq. 7. Two sources: retrieve iff p_M(<Wiki>) * p_D(<Wiki>) > tau; more: argmax of the product.
    Returns (source index [batch], the thresholded score [batch])."""
    product = p_model * p_datastore
    if len(sources) == 2 and "wiki" in sources:
        wiki = sources.index("wiki")
        score = product[:, wiki]
        return np.where(score > tau, wiki, 1 - wiki), score
    return product.argmax(axis=1), product.max(axis=1)


def srrag_policy(neighbours: Neighbours | None, tau: float) -> Policy:
    """`neighbours=None` is the paper's "w/o kNN" ablation: p_D uniform, i.e. threshold p_M alone
    (p_D = 1 for every source keeps tau on p_M's own scale)."""

    def policy(inputs: PolicyInputs) -> PolicyDecision:
        n = len(inputs.sources)
        if neighbours is None:
            p_d = np.ones_like(inputs.p_model)
        else:
            p_d = policy_distribution(np.asarray(neighbours(inputs.hidden)), n)
        source, score = choose_source(inputs.p_model, p_d, inputs.sources, tau)
        return PolicyDecision(source, p_d, score)

    return policy
