"""IK, SeaKR and CCSK as routing policies: each decision equals a direct computation from its
inputs (hand-made arrays, or the tiny model run one sequence at a time)."""

import re
import zlib

import jax
import numpy as np
import pytest

from jaxrag.decode.policy import PolicyInputs
from jaxrag.decode.sampler import generate
from jaxrag.policies.ccsk import (
    ccsk_decide,
    ccsk_inputs,
    ccsk_policy,
    ccsk_signals,
    fit_ccsk,
    fit_fusion,
    fusion_gates,
    init_fusion,
    knn_vote,
    response_quality,
    rouge1_recall,
)
from jaxrag.policies.ik import (
    closed_book_generations,
    closed_book_prompts,
    fit_ik,
    ik_features,
    ik_policy,
)
from jaxrag.policies.seakr import (
    EMPTY_SCORE,
    SEAKR_SAMPLING,
    eigen_score,
    end_token_uncertainty,
    fit_seakr_threshold,
    seakr_policy,
    seakr_uncertainty,
)

QUESTIONS = [f"who wrote the novel {i}?" for i in range(6)] + [f"where is the quick brown fox {i}?" for i in range(6)]
SOURCES = ("self", "wiki")
LAYER = 1


@pytest.fixture(scope="module")
def model():
    from train_fixtures import tiny_model

    return tiny_model(seed=1)


def inputs(questions, sources=SOURCES):
    n = len(questions)
    return PolicyInputs(list(questions), sources, np.full((n, 2), 0.5), np.zeros((n, 4)))


def by_hand_state(model, ids, length=64):
    """Hidden state at the last token, one sequence at a time (right-padded to one shape, so it
    compiles once)."""
    padded, mask = np.zeros((1, length), np.int32), np.zeros((1, length), bool)
    padded[0, :len(ids)], mask[0, :len(ids)] = ids, True
    return np.asarray(model.hidden_states(padded, LAYER, mask))[0, len(ids) - 1]


def by_hand_eigen(states, alpha=1e-3):
    z = np.asarray(states, np.float64)
    d = z.shape[1]
    j = np.eye(d) - np.ones((d, d)) / d
    return np.linalg.slogdet(z @ j @ z.T + alpha * np.eye(len(z)))[1] / len(z)


# ------------------------------------------------------------------------------------- SeaKR

def test_eigen_score_is_regularised_gram_logdet():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(5, 12))
    assert eigen_score(z) == pytest.approx(by_hand_eigen(z), rel=1e-10)
    same = np.repeat(z[:1], 5, axis=0)
    assert eigen_score(same) < eigen_score(z)  # consistent samples = low uncertainty


def test_seakr_uncertainty_and_decisions(model):
    rng = jax.random.key(3)
    qs = QUESTIONS[:3]
    prompts = closed_book_prompts(model, qs)
    gens = closed_book_generations(model, qs, 6, samples=4, sampling=SEAKR_SAMPLING, rng=rng)
    assert any(len({tuple(g) for g in q_gens}) > 1 for q_gens in gens)  # samples differ
    u = end_token_uncertainty(model, prompts, gens, layer=LAYER)
    eos = model.tokenizer.eos_token_id
    for i in range(3):  # samples with no text besides the stop token are dropped
        kept = [g for g in gens[i] if model.tokenizer.decode([t for t in g if t != eos], skip_special_tokens=True).strip()]
        states = [by_hand_state(model, prompts[i] + g) for g in kept]
        assert u[i] == pytest.approx(by_hand_eigen(states), abs=1e-3)
    # the composed function samples exactly these generations, and the end-token states it reads
    # in its decode loop are those a prefill of prompt + sample reads (to float tolerance)
    np.testing.assert_allclose(seakr_uncertainty(model, qs, samples=4, max_new_tokens=6, layer=LAYER, rng=rng), u,
                               rtol=1e-5)

    threshold = float(np.sort(u)[:2].mean())  # between two scores: the decisions do not hang on a float's last bit
    for sources in (SOURCES, ("wiki", "none")):
        d = seakr_policy(model, threshold, samples=4, max_new_tokens=6, layer=LAYER, rng=rng)(inputs(qs, sources))
        np.testing.assert_allclose(d.score, u, rtol=1e-5)
        assert [sources[s] == "wiki" for s in d.source] == list(u > threshold)
    assert np.array_equal(u > fit_seakr_threshold(u, u > threshold), u > threshold)


def test_seakr_drops_empty_samples(model):
    eos = model.tokenizer.eos_token_id
    word = model.tokenizer(" Hawthorne", add_special_tokens=False)["input_ids"]
    fox = model.tokenizer(" fox", add_special_tokens=False)["input_ids"]
    prompts = closed_book_prompts(model, QUESTIONS[:2])
    gens = [[[eos], word + [eos], fox], [[eos], [eos]]]
    u = end_token_uncertainty(model, prompts, gens, layer=LAYER)
    kept = [by_hand_state(model, prompts[0] + g) for g in gens[0][1:]]
    assert u[0] == pytest.approx(by_hand_eigen(kept), abs=1e-3)
    assert u[1] == EMPTY_SCORE


# ---------------------------------------------------------------------------------------- IK

def test_ik_decision_is_thresholded_predict_proba(model):
    knows = np.arange(len(QUESTIONS)) % 2
    ik = fit_ik(model, QUESTIONS, knows, layer=LAYER)
    feats = ik_features(model, QUESTIONS, layer=LAYER)
    # features: question + its first 32 greedy tokens, hidden state at the last one
    prompts = closed_book_prompts(model, QUESTIONS)
    answers = generate(model.decoder, prompts, 32, stop_ids=[model.tokenizer.eos_token_id])
    for i in (0, 7):
        np.testing.assert_allclose(feats[i], by_hand_state(model, prompts[i] + answers[i]), atol=1e-4)

    p_know = ik.classifier.predict_proba(feats)[:, list(ik.classifier.classes_).index(1)]
    threshold = float(np.median(p_know))
    d = ik_policy(model, ik, threshold)(inputs(QUESTIONS))
    assert [SOURCES[s] for s in d.source] == ["wiki" if p < threshold else "self" for p in p_know]
    np.testing.assert_allclose(d.score, 1 - p_know, atol=1e-6)
    assert 0 < (np.asarray(d.source) == 1).sum() < len(QUESTIONS)


# -------------------------------------------------------------------------------------- CCSK

class HashEncoder:
    """Bag of hashed words, 64-d: a deterministic stand-in for the sentence encoder."""

    def encode(self, texts):
        out = np.zeros((len(texts), 64), np.float32)
        for i, t in enumerate(texts):
            for w in re.findall(r"\w+", t.lower()):
                out[i, zlib.crc32(w.encode()) % 64] += 1
        return out


def test_knn_vote_top_k_and_new_query_default():
    bank = np.array([[1, 0, 0], [0.9, 0.1, 0], [0.8, 0.3, 0], [0, 1, 0], [0.1, 1, 0]], float)
    labels = np.array([1, 0, 0, 1, 1])
    queries = np.array([[1, 0.05, 0], [0, 0, 1]], float)  # near rows 0-2; orthogonal to everything
    f, max_sim = knn_vote(queries, bank, labels, k=3, min_similarity=0.5)
    unit = bank / np.linalg.norm(bank, axis=1, keepdims=True)
    sims = unit @ (queries[0] / np.linalg.norm(queries[0]))
    assert f[0] == pytest.approx(labels[np.argsort(-sims)[:3]].mean()) and f[0] == pytest.approx(1 / 3)
    assert max_sim[1] == pytest.approx(0.0) and f[1] == 1.0  # a new query defaults to retrieval
    loo, _ = knn_vote(bank, bank, labels, k=1, min_similarity=0.0, exclude_self=True)
    np.testing.assert_array_equal(loo, [0, 1, 0, 1, 1])  # each row's nearest *other* row


def test_ccsk_decide_eq7_by_hand():
    f = np.array([[0.9, 0.1], [0.2, 0.1], [0.9, 0.1], [0.9, 0.1], [0.1, 0.9]])
    g = np.array([[0.9, 0.1], [0.5, 0.5], [0.55, 0.45], [0.45, 0.55], [0.55, 0.45]])
    g_w = np.array([[0.9, 0.1], [0.5, 0.5], [0.8, 0.2], [0.2, 0.8], [0.8, 0.2]])
    retrieve, score = ccsk_decide(f, g, g_w, tau_pred=0.4, tau_conf=0.6, tau_single=0.3)
    # row 0 trusted: g.F = 0.82 > 0.4; row 1 untrusted, SN (tie -> first) 0.2 <= 0.3;
    # row 2 untrusted, SN 0.9 > 0.3; row 3 untrusted, RQM 0.1; row 4 untrusted, SN 0.1
    np.testing.assert_array_equal(retrieve, [True, False, True, False, False])
    np.testing.assert_allclose(score, [0.82, 0.2, 0.9, 0.1, 0.1])
    assert ccsk_decide(f, g, g_w, tau_conf=0.3)[0].tolist() == list(np.sum(g * f, 1) > 0.4)  # 2 modules: max g >= .5


def test_fusion_gates_by_hand():
    rng = np.random.default_rng(0)
    q, r, f = rng.normal(size=(3, 16)), rng.normal(size=(3, 16)), rng.uniform(size=(3, 2))
    params = init_fusion(16, seed=1)
    g_a, g_w, g = map(np.asarray, fusion_gates(params, q, r, f, heads=8))
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    inter = r @ p["wv"]  # attention over a single key: softmax = 1, I(q, r) = W_V r
    hidden = np.maximum(np.concatenate([q, r, inter, f], 1) @ p["wc"] + p["bc"], 0)
    want_a = 1 / (1 + np.exp(-hidden @ p["wa"]))
    want_w = np.exp(hidden @ p["ww"]) / np.exp(hidden @ p["ww"]).sum(1, keepdims=True)
    np.testing.assert_allclose(g_a, want_a, rtol=1e-4)
    np.testing.assert_allclose(g_w, want_w, rtol=1e-4)
    np.testing.assert_allclose(g, want_a * want_w / (want_a * want_w).sum(1, keepdims=True), rtol=1e-4)


def test_fusion_learns_to_trust_the_reliable_module():
    rng = np.random.default_rng(0)
    y = np.arange(12) % 2  # 12 rows of 64-d: the CCSK test's compiled training step
    f = np.column_stack([np.where(y == 1, 0.9, 0.1), np.where(y == 1, 0.1, 0.9)])  # SN right, RQM wrong
    q, r = rng.normal(size=(12, 64)), rng.normal(size=(12, 64))
    params = fit_fusion(q, r, f, y, epochs=100, lr=3e-3)
    _, _, g = fusion_gates(params, q, r, f)
    assert np.mean(np.asarray(g)[:, 0]) > 0.9


def test_response_quality_target():
    assert rouge1_recall("It was Nathaniel Hawthorne.", "Nathaniel Hawthorne") == 1.0
    assert rouge1_recall("Hawthorne", "Nathaniel Hawthorne") == 0.5
    emb = np.eye(3)[[0, 1, 0]]
    y = response_quality(["Hawthorne", "a fox", "Nathaniel Hawthorne"], ["Nathaniel Hawthorne"] * 3,
                         emb, np.eye(3)[[0, 0, 0]], weights=(0.3, 0.7))
    np.testing.assert_allclose(y, [0.3 * 0.5 + 0.7, 0.0, 1.0])  # no shared word -> 0


def test_ccsk_policy_equals_its_modules_by_hand(model):
    enc = HashEncoder()
    labels = (np.arange(len(QUESTIONS)) < 6).astype(int)  # the novel questions need retrieval
    # 32 new tokens and 12 questions: the IK test's compiled generation shapes
    ccsk = fit_ccsk(model, enc, QUESTIONS, labels, ["Hawthorne"] * 6 + ["the forest"] * 6, max_new_tokens=32,
                    epochs=3, rqm_params={"min_child_samples": 2, "num_boost_round": 20})
    test_qs = ["zebra quantum?"] + [q.replace("fox", "dog") for q in QUESTIONS[1:]]
    x = ccsk_inputs(model, enc, test_qs, max_new_tokens=32)
    s = ccsk_signals(model, enc, ccsk, test_qs)
    for i in range(len(test_qs)):  # SN by hand: top-5 cosine vote, or 1 below the floor
        sims = ccsk.bank_emb @ x.query_emb[i]
        top = np.argsort(-sims, kind="stable")[:5]
        assert s.f[i, 0] == pytest.approx(1.0 if sims.max() < 0.5 else labels[top].mean())
    assert s.f[0, 0] == 1.0  # unseen words: a new query -> retrieve
    np.testing.assert_allclose(s.f[:, 1], 1 - np.clip(ccsk.rqm.predict(x.rqm_features), 0, 1))
    _, _, g = fusion_gates(ccsk.fusion, x.query_emb, x.response_emb, s.f.astype(np.float32))
    np.testing.assert_allclose(s.g, g, rtol=1e-5)

    for taus in [(0.4, 0.3, 0.3), (0.5, 0.99, 0.6)]:
        d = ccsk_policy(model, enc, ccsk, *taus)(inputs(test_qs))
        want, score = ccsk_decide(s.f, s.g, s.g_w, *taus)
        assert [SOURCES[k] == "wiki" for k in d.source] == want.tolist()
        np.testing.assert_allclose(d.score, score)
