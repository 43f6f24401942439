"""CCSK (Lu, Lv & Chen; docs/method.md): retrieve-or-not from two signals fused by attention.

- SN (§3.2, Eq. 1-2): cosine similarity of the query to labelled historical queries; F_SN = share
  of the top-K = 5 that needed retrieval; F_SN = 1 (retrieve) when even the best match is below
  a similarity floor (the query is new).
- RQM (§3.3, Eq. 3-4): LightGBM (31 leaves, lr 0.03, early stopping after 30 rounds) regresses a
  response-quality target Y = W^T [ROUGE-1; cos(r, R)] (Y = 0 when ROUGE-1 = 0) from the
  closed-book response's length L, vocabulary richness E = unique/L, embedding phi(r) and
  cos(r, q); F_RQM = 1 - Y.
- Fusion (§3.4, Eq. 5-7): I = MultiHead(q, r, r) with 8 heads; P = ReLU(W_c[q; r; I; F] + b_c);
  g_a = sigmoid(W_a P), g_w = softmax(W_w P), g = g_a*g_w / sum; trusted iff max(g) > tau_conf:
  then retrieve iff g.F > tau_pred, else retrieve iff the F of argmax(g_w) > tau_single.

Scaled to what runs here: phi is the project's sentence encoder (MiniLM, 384-d, instead of
BERT-base's 768-d; the fusion's hidden width follows d, as 768 does in the paper); the response
is the model's greedy closed-book answer; L counts the LLM's tokens. The paper leaves open the
similarity floor, W (only "CS weighs more") and how the fusion is trained: we use a 0.5 floor,
W = (0.3, 0.7), ROUGE-1 recall (so a response that merely mentions the answer scores 1, as the
paper describes), and train the fusion with binary cross-entropy of g.F against the labels on
cross-fitted module outputs (leave-one-out SN votes, out-of-fold RQM), so it never learns to trust
a module's predictions on that module's own training rows. q and r are single pooled vectors
(the paper's 2306 = 3 x 768 + 2 fusion inputs), so Eq. 5's softmax runs over one key.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Sequence
from functools import partial
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import lightgbm as lgb
import numpy as np
import optax
from sklearn.model_selection import KFold

from jaxrag.decode.policy import Policy, PolicyDecision, PolicyInputs
from jaxrag.errors import JaxragError
from jaxrag.models.model import Model
from jaxrag.policies.ik import (
    closed_book_generations,
    default_stop_ids,
    retrieve_sources,
)

TOP_K = 5
MIN_SIMILARITY = 0.5
QUALITY_WEIGHTS = (0.3, 0.7)  # W over (ROUGE-1, cos(r, R))
RQM_PARAMS = {"objective": "regression", "num_leaves": 31, "learning_rate": 0.03, "num_boost_round": 1000,
              "verbose": -1}
RQM_EARLY_STOPPING = 30
HEADS = 8
TAU_PRED, TAU_CONF, TAU_SINGLE = 0.4, 0.3, 0.3  # the paper's grid-search optimum (§4.6)


class Encoder(Protocol):
    def encode(self, texts: Sequence[str]) -> np.ndarray: ...  # [n, d]; `TextEncoder` fits


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


# ---------------------------------------------------------------------------------------------
# Inputs: the query, the closed-book response, and the RQM's features (Eq. 3)
# ---------------------------------------------------------------------------------------------

class CCSKInputs(NamedTuple):
    query_emb: np.ndarray  # [n, d] unit phi(q)
    response_emb: np.ndarray  # [n, d] unit phi(r)
    rqm_features: np.ndarray  # [n, 3 + d]: L, E, phi(r), cos(r, q)
    responses: list[str]


def rqm_features(response_tokens: Sequence[Sequence[int]], response_emb: np.ndarray,
                 query_emb: np.ndarray) -> np.ndarray:
    """Eq. 3: [L, E = unique/L, phi(r), C(r, q)] per row (E = 0 for an empty response)."""
    length = np.array([len(t) for t in response_tokens], np.float32)
    richness = np.array([len(set(t)) / len(t) if len(t) else 0.0 for t in response_tokens], np.float32)
    cos = np.sum(_unit(response_emb) * _unit(query_emb), axis=1)
    return np.column_stack([length, richness, response_emb, cos]).astype(np.float32)


def ccsk_inputs(model: Model, encoder: Encoder, questions: Sequence[str], *, max_new_tokens: int = 64,
                max_rows: int = 128) -> CCSKInputs:
    """Greedy closed-book response per question, its embedding and the RQM features."""
    stops = set(default_stop_ids(model))
    gens = closed_book_generations(model, questions, max_new_tokens, max_rows=max_rows)
    tokens = [[t for t in g[0] if t not in stops] for g in gens]
    responses = [model.tokenizer.decode(t, skip_special_tokens=True).strip() for t in tokens]
    q_emb, r_emb = _unit(encoder.encode(list(questions))), _unit(encoder.encode(responses))
    return CCSKInputs(q_emb, r_emb, rqm_features(tokens, r_emb, q_emb), responses)


# ---------------------------------------------------------------------------------------------
# SN: query-similarity vote (Eq. 1-2)
# ---------------------------------------------------------------------------------------------

def knn_vote(query_emb: np.ndarray, bank_emb: np.ndarray, bank_labels: np.ndarray, *, k: int = TOP_K,
             min_similarity: float = MIN_SIMILARITY, exclude_self: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """F_SN = mean label of the k most cosine-similar bank queries; 1 when the best similarity is
    below `min_similarity`. `exclude_self`: query i is bank row i (leave-one-out on training rows).
    Returns (F_SN [n], max similarity [n])."""
    sims = _unit(query_emb) @ _unit(bank_emb).T
    if exclude_self:
        np.fill_diagonal(sims, -np.inf)
    k = min(k, sims.shape[1] - int(exclude_self))
    if k < 1:
        raise JaxragError("knn_vote: the query bank is empty")
    top = np.argsort(-sims, axis=1, kind="stable")[:, :k]
    max_sim = np.take_along_axis(sims, top[:, :1], axis=1)[:, 0]
    vote = np.asarray(bank_labels, np.float64)[top].mean(axis=1)
    return np.where(max_sim < min_similarity, 1.0, vote), max_sim


# ---------------------------------------------------------------------------------------------
# RQM: response-quality regression (Eq. 4)
# ---------------------------------------------------------------------------------------------

def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def rouge1_recall(response: str, reference: str) -> float:
    """Share of the reference's unigrams (with multiplicity) that the response contains."""
    ref, got = Counter(_words(reference)), Counter(_words(response))
    total = sum(ref.values())
    return sum(min(c, got[w]) for w, c in ref.items()) / total if total else 0.0


def response_quality(responses: Sequence[str], best_answers: Sequence[str], response_emb: np.ndarray,
                     answer_emb: np.ndarray, weights: tuple[float, float] = QUALITY_WEIGHTS) -> np.ndarray:
    """Y_RQM = W^T [R-1; CS(r, R)], and 0 when the response shares no word with the answer."""
    r1 = np.array([rouge1_recall(r, a) for r, a in zip(responses, best_answers)])
    cs = np.clip(np.sum(_unit(response_emb) * _unit(answer_emb), axis=1), 0.0, 1.0)
    return np.where(r1 == 0, 0.0, weights[0] * r1 + weights[1] * cs)


def fit_rqm(features: np.ndarray, target: np.ndarray, *, valid_fraction: float = 0.2, seed: int = 0,
            params: dict | None = None) -> lgb.Booster:
    """LightGBM regressor, early-stopped on a random `valid_fraction` of the rows (its
    `predict` then uses the best iteration)."""
    params = {**RQM_PARAMS, "seed": seed, **(params or {})}
    rounds = params.pop("num_boost_round")
    order = np.random.default_rng(seed).permutation(len(features))
    n_valid = round(len(features) * valid_fraction)
    if n_valid < 2 or len(features) - n_valid < 2:  # too few rows to hold any out
        return lgb.train(params, lgb.Dataset(features, target), rounds)
    fit, valid = order[n_valid:], order[:n_valid]
    train = lgb.Dataset(features[fit], target[fit])
    return lgb.train(params, train, rounds, valid_sets=[lgb.Dataset(features[valid], target[valid], reference=train)],
                     callbacks=[lgb.early_stopping(RQM_EARLY_STOPPING, verbose=False)])


def rqm_need(rqm: lgb.Booster, features: np.ndarray) -> np.ndarray:
    """F_RQM = 1 - Y_RQM (quality clipped to [0, 1]): high = the response is poor, retrieve."""
    return 1.0 - np.clip(rqm.predict(features), 0.0, 1.0)


def out_of_fold_need(features: np.ndarray, target: np.ndarray, *, folds: int = 5, seed: int = 0,
                     params: dict | None = None) -> np.ndarray:
    """F_RQM for training rows from models that never saw them (inputs for fitting the fusion)."""
    need = np.empty(len(features))
    for fit, held in KFold(min(folds, len(features)), shuffle=True, random_state=seed).split(features):
        need[held] = rqm_need(fit_rqm(features[fit], target[fit], seed=seed, params=params), features[held])
    return need


# ---------------------------------------------------------------------------------------------
# Attention-based dynamic fusion (Eq. 5-7)
# ---------------------------------------------------------------------------------------------

def init_fusion(d: int, *, hidden: int | None = None, seed: int = 0) -> dict:
    """W_Q, W_K, W_V [d, d] (heads side by side), W_c [3d + 2, hidden], b_c, W_a, W_w [hidden, 2]."""
    hidden = d if hidden is None else hidden
    rng = np.random.default_rng(seed)

    def dense(n_in, n_out):
        return jnp.asarray(rng.normal(size=(n_in, n_out)) / np.sqrt(n_in), jnp.float32)

    return {"wq": dense(d, d), "wk": dense(d, d), "wv": dense(d, d), "wc": dense(3 * d + 2, hidden),
            "bc": jnp.zeros(hidden, jnp.float32), "wa": dense(hidden, 2), "ww": dense(hidden, 2)}


def multi_head_attention(params: dict, q: jax.Array, kv: jax.Array, heads: int) -> jax.Array:
    """Eq. 5: concat_h softmax((W_Q^h q)(W_K^h kv)^T / sqrt(d/H)) (W_V^h kv).
    q [B, d], kv [B, T, d] -> [B, d]."""
    b, _, d = kv.shape
    if d % heads:
        raise JaxragError(f"CCSK fusion: embedding size {d} is not divisible by {heads} heads")
    split = lambda x: x.reshape(*x.shape[:-1], heads, d // heads)
    qh, kh, vh = split(q @ params["wq"]), split(kv @ params["wk"]), split(kv @ params["wv"])
    attn = jax.nn.softmax(jnp.einsum("bhe,bthe->bht", qh, kh) / np.sqrt(d // heads), axis=-1)
    return jnp.einsum("bht,bthe->bhe", attn, vh).reshape(b, d)


def fusion_gates(params: dict, q, r, f, heads: int = HEADS, dropout: float = 0.0, key=None):
    """Eq. 6: q, r [B, d], F [B, 2] (F_SN, F_RQM) -> (g_a, g_w, g), each [B, 2]."""
    inter = multi_head_attention(params, q, r[:, None, :], heads)
    p = jax.nn.relu(jnp.concatenate([q, r, inter, f], axis=-1) @ params["wc"] + params["bc"])
    if dropout > 0.0:
        p = jnp.where(jax.random.bernoulli(key, 1.0 - dropout, p.shape), p / (1.0 - dropout), 0.0)
    g_a, g_w = jax.nn.sigmoid(p @ params["wa"]), jax.nn.softmax(p @ params["ww"], axis=-1)
    g = g_a * g_w
    return g_a, g_w, g / jnp.sum(g, axis=-1, keepdims=True)


_fusion_gates_jit = jax.jit(fusion_gates, static_argnames=("heads", "dropout"))


def _fusion_loss(params, data, rows, key, heads: int, dropout: float):
    """Binary cross-entropy of the fused prediction g.F against the retrieve labels."""
    q, r, f, y = (x[rows] for x in data)
    _, _, g = fusion_gates(params, q, r, f, heads, dropout, key)
    pred = jnp.clip(jnp.sum(g * f, axis=-1), 1e-6, 1 - 1e-6)
    return -jnp.mean(y * jnp.log(pred) + (1 - y) * jnp.log(1 - pred))


@partial(jax.jit, static_argnames=("heads", "dropout", "lr"))
def _fusion_step(params, opt_state, data, rows, key, heads: int, dropout: float, lr: float):
    grads = jax.grad(_fusion_loss)(params, data, rows, key, heads, dropout)
    updates, opt_state = optax.adam(lr).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def fit_fusion(q: np.ndarray, r: np.ndarray, f: np.ndarray, needs_retrieval: np.ndarray, *, heads: int = HEADS,
               epochs: int = 30, batch_size: int = 64, lr: float = 1e-3, dropout: float = 0.1,
               seed: int = 0) -> dict:
    """Adam on the binary cross-entropy of g.F against the labels (batch 64 and dropout 0.1 as
    in §4.3). q, r [N, d] unit embeddings; F [N, 2] (F_SN, F_RQM); labels [N] (1 = retrieve)."""
    data = tuple(jnp.asarray(x, jnp.float32) for x in (q, r, f, needs_retrieval))
    params = init_fusion(data[0].shape[1], seed=seed)
    opt_state = optax.adam(lr).init(params)
    n, batch = len(data[3]), min(batch_size, len(data[3]))
    rng, key = np.random.default_rng(seed), jax.random.key(seed)
    for epoch in range(epochs):
        order = rng.permutation(n)
        for i, start in enumerate(range(0, n - batch + 1, batch)):  # full batches: one compiled shape
            params, opt_state = _fusion_step(params, opt_state, data, jnp.asarray(order[start:start + batch]),
                                             jax.random.fold_in(key, epoch * n + i), heads, dropout, lr)
    return params


def ccsk_decide(f: np.ndarray, g: np.ndarray, g_w: np.ndarray, tau_pred: float = TAU_PRED,
                tau_conf: float = TAU_CONF, tau_single: float = TAU_SINGLE) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 7 as §3.4 explains it: if the fused result is trusted (max g > tau_conf) retrieve iff
    g.F > tau_pred; otherwise take the module with the larger g_w and retrieve iff its F >
    tau_single. Returns (retrieve [B] bool, the quantity thresholded [B])."""
    f, g, g_w = (np.asarray(x, np.float64) for x in (f, g, g_w))
    fused = np.sum(g * f, axis=1)
    single = f[np.arange(len(f)), np.argmax(g_w, axis=1)]
    trusted = g.max(axis=1) > tau_conf
    return np.where(trusted, fused > tau_pred, single > tau_single), np.where(trusted, fused, single)


# ---------------------------------------------------------------------------------------------
# Fitting and the policy
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class CCSK:
    """A fitted CCSK: the labelled query bank (SN), the RQM and the fusion weights."""

    bank_emb: np.ndarray  # [N, d] unit embeddings of the training queries
    bank_labels: np.ndarray  # [N] 1 = retrieval needed
    rqm: lgb.Booster
    fusion: dict
    k: int = TOP_K
    min_similarity: float = MIN_SIMILARITY
    heads: int = HEADS
    max_new_tokens: int = 64


class CCSKSignals(NamedTuple):
    f: np.ndarray  # [n, 2] (F_SN, F_RQM)
    g_a: np.ndarray  # [n, 2] confidence weights
    g_w: np.ndarray  # [n, 2] distribution weights
    g: np.ndarray  # [n, 2] normalised g_a * g_w
    max_similarity: np.ndarray  # [n] best SN match


def fit_ccsk_inputs(inputs: CCSKInputs, needs_retrieval: np.ndarray, quality: np.ndarray, *, k: int = TOP_K,
                    min_similarity: float = MIN_SIMILARITY, heads: int = HEADS, folds: int = 5, epochs: int = 30,
                    max_new_tokens: int = 64, seed: int = 0, rqm_params: dict | None = None) -> CCSK:
    """Fits the RQM on `quality` (Y_RQM) and the fusion on `needs_retrieval` (1 = retrieve)."""
    labels = np.asarray(needs_retrieval, np.float64)
    f_sn, _ = knn_vote(inputs.query_emb, inputs.query_emb, labels, k=k, min_similarity=min_similarity,
                       exclude_self=True)
    f_rqm = out_of_fold_need(inputs.rqm_features, quality, folds=folds, seed=seed, params=rqm_params)
    fusion = fit_fusion(inputs.query_emb, inputs.response_emb, np.column_stack([f_sn, f_rqm]), labels,
                        heads=heads, epochs=epochs, seed=seed)
    rqm = fit_rqm(inputs.rqm_features, quality, seed=seed, params=rqm_params)
    return CCSK(inputs.query_emb, labels, rqm, fusion, k, min_similarity, heads, max_new_tokens)


def fit_ccsk(model: Model, encoder: Encoder, questions: Sequence[str], needs_retrieval: np.ndarray,
             best_answers: Sequence[str], *, max_new_tokens: int = 64,
             quality_weights: tuple[float, float] = QUALITY_WEIGHTS, **kw) -> CCSK:
    """Training questions, their retrieve labels (1 = retrieval needed / helps) and one best
    answer each (for the RQM target) -> fitted CCSK. `kw` goes to `fit_ccsk_inputs`."""
    inputs = ccsk_inputs(model, encoder, questions, max_new_tokens=max_new_tokens)
    quality = response_quality(inputs.responses, best_answers, inputs.response_emb,
                               encoder.encode(list(best_answers)), quality_weights)
    return fit_ccsk_inputs(inputs, needs_retrieval, quality, max_new_tokens=max_new_tokens, **kw)


def ccsk_signals_from_inputs(ccsk: CCSK, inputs: CCSKInputs) -> CCSKSignals:
    f_sn, max_sim = knn_vote(inputs.query_emb, ccsk.bank_emb, ccsk.bank_labels, k=ccsk.k,
                             min_similarity=ccsk.min_similarity)
    f = np.column_stack([f_sn, rqm_need(ccsk.rqm, inputs.rqm_features)])
    g_a, g_w, g = (np.asarray(x, np.float64) for x in _fusion_gates_jit(
        ccsk.fusion, jnp.asarray(inputs.query_emb), jnp.asarray(inputs.response_emb), jnp.asarray(f, jnp.float32),
        heads=ccsk.heads))
    return CCSKSignals(f, g_a, g_w, g, max_sim)


def ccsk_signals(model: Model, encoder: Encoder, ccsk: CCSK, questions: Sequence[str]) -> CCSKSignals:
    """Both modules' outputs and the fusion weights for new questions (to sweep tau's on)."""
    return ccsk_signals_from_inputs(ccsk, ccsk_inputs(model, encoder, questions, max_new_tokens=ccsk.max_new_tokens))


def ccsk_policy(model: Model, encoder: Encoder, ccsk: CCSK, tau_pred: float = TAU_PRED, tau_conf: float = TAU_CONF,
                tau_single: float = TAU_SINGLE) -> Policy:
    """Eq. 7 on each batch; `score` = g.F for trusted rows, the chosen module's F otherwise."""

    def policy(inputs: PolicyInputs) -> PolicyDecision:
        s = ccsk_signals(model, encoder, ccsk, inputs.questions)
        retrieve, score = ccsk_decide(s.f, s.g, s.g_w, tau_pred, tau_conf, tau_single)
        return PolicyDecision(retrieve_sources(retrieve, inputs.sources), score=score)

    return policy
