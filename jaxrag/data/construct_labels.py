"""Algorithm 1's labels (paper §3.3, line 11): pure functions of one question's likelihoods
l_c = log p_M(a | q, c) over its contexts -> the preferred source, the "w/o kv. label" /
Selective RAG label, and each source's best and worst context."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from jaxrag.errors import JaxragError
from jaxrag.models.tokens import SELF, WIKI


def _log_sum_exp(values: Sequence[float]) -> float:
    if not values:
        return -math.inf
    top = max(values)
    return top if top == -math.inf else top + math.log(sum(math.exp(v - top) for v in values))


def source_logliks(sources: Sequence[str], logliks: Sequence[float]) -> dict[str, float]:
    """log sum_{c in C_s} p_M(a | q, c) per source (-inf for a source without contexts)."""
    return {s: _log_sum_exp([x for src, x in zip(sources, logliks) if src == s]) for s in (WIKI, SELF)}


def label_source(sources: Sequence[str], logliks: Sequence[float], rule: str = "sum", n: int = 5) -> str:
    """The preferred source s of one question from its contexts' log p_M(a | q, c).

    "sum" (Algorithm 1 line 11): s = argmax_s sum_{c in C_s} l_c with l_c = p_M(a | q, c), a
    *probability* (§3.3 defines l_j = p_M(a|q, c_j)), so we compare log-sum-exp of the
    log-likelihoods; summing log-likelihoods instead would reward a source for consistently
    mediocre contexts over one that answers. A source without contexts sums to 0 (log: -inf), so
    with no retrieved passage the label is Self. "majority" (§3.3's text): the source holding
    the majority of the top-n contexts; a tie falls back to "sum". Ties of "sum" go to Wiki."""
    totals = source_logliks(sources, logliks)
    by_sum = max((WIKI, SELF), key=lambda s: totals[s])  # first maximum: Wiki on ties
    if rule == "sum":
        return by_sum
    if rule != "majority":
        raise JaxragError(f"label_rule must be 'sum' or 'majority', got {rule!r}")
    top = sorted(range(len(logliks)), key=lambda i: (-logliks[i], i))[:n]
    votes = Counter(sources[i] for i in top)
    return by_sum if votes[WIKI] == votes[SELF] else max((WIKI, SELF), key=lambda s: votes[s])


def no_context_label(wiki_logliks: Sequence[float], no_context_loglik: float, n_self: int, rule: str = "sum",
                     n: int = 5) -> str:
    """Wiki vs answering with no knowledge: the label of the "w/o kv. label" ablation (Table 3:
    "use the likelihood of the LLM directly generating the answer ... instead" of verbalizations)
    and of the Selective-RAG baseline (§4.2 (2): "likelihoods ... with and without retrieval").
    The same Algorithm-1 rule as `label_source`, with each of the n_self verbalizations replaced
    by no context at all: under "sum", Wiki iff sum_e p(a|q, c_e) >= n_self * p(a|q), i.e. the
    mean retrieved passage helps at least as much as none. Returns "wiki" or "self" (the
    parametric side: SR-RAG's <Self> without verbalization labels, Selective RAG's phi)."""
    return label_source([SELF] * n_self + [WIKI] * len(wiki_logliks),
                        [no_context_loglik] * n_self + list(wiki_logliks), rule, n)


def best_worst(sources: Sequence[str], logliks: Sequence[float]) -> tuple[dict[str, int], dict[str, int]]:
    """Indices of c_s+ and c_s- (highest / lowest likelihood, first on ties) per present source."""
    best, worst = {}, {}
    for i, (src, x) in enumerate(zip(sources, logliks)):
        if src not in best or x > logliks[best[src]]:
            best[src] = i
        if src not in worst or x < logliks[worst[src]]:
            worst[src] = i
    return best, worst
