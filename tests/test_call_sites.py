"""The pipeline's call sites of two fixed rules, exercised where the pipeline calls them, against
hand-computed values: IK's judge labels at each metric's pass mark (`pipeline.eval.fit_selectors`),
and Figure 4's thresholds from SR-RAG's validation scores, tied ones included
(`pipeline.eval.figure4_points`)."""

import types

import numpy as np
import pytest

from jaxrag.data.schema import QAExample
from jaxrag.eval import latency
from jaxrag.models.tokens import SELF, WIKI
from jaxrag.pipeline import eval as eval_stage
from jaxrag.pipeline.config import tiny_config


def test_fit_selectors_gives_ik_the_metrics_pass_mark_not_any_score(tmp_path, monkeypatch):
    """The untuned model's closed-book answers to four training questions: IK's judge says
    "knows" at F1 >= 0.5 (Wizard of Wikipedia) and at an exact match (NQ); an answer sharing one
    token with the gold (F1 1/3 > 0) does not know."""
    gold = "the red house stands on the hill"  # 5 tokens once the articles are dropped
    train = [("wow", QAExample("w1", "tell me about the house", (gold,))),
             ("wow", QAExample("w2", "describe the hill", (gold,))),
             ("nq", QAExample("n1", "capital of france?", ("Paris",))),
             ("nq", QAExample("n2", "capital of italy?", ("Rome",)))]
    answers = {"tell me about the house": "house",  # P 1, R 1/5: F1 = 2 (1/5) / (6/5) = 1/3
               "describe the hill": "red house stands on hill",  # P 1, R 1: F1 = 1
               "capital of france?": "It is Paris",  # gold contained: 1
               "capital of italy?": "Milan"}  # 0
    want = {"tell me about the house": False, "describe the hill": True, "capital of france?": True,
            "capital of italy?": False}
    base = types.SimpleNamespace(tokenizer=types.SimpleNamespace(decode=lambda q, skip_special_tokens: answers[q]))
    monkeypatch.setattr(eval_stage, "retriever", lambda cfg, workdir: types.SimpleNamespace(encoder=None))
    monkeypatch.setattr(eval_stage, "dataset_items", lambda cfg, workdir, names, split: list(train))
    monkeypatch.setattr(eval_stage, "construct_records", lambda workdir: [])
    monkeypatch.setattr(eval_stage.ik_mod, "closed_book_generations", lambda model, qs, max_new: [[q] for q in qs])
    judged = {}
    monkeypatch.setattr(eval_stage.ik_mod, "fit_ik",
                        lambda model, qs, knows, answer_tokens: judged.update(zip(qs, knows.tolist())) or "ik")
    monkeypatch.setattr(eval_stage.seakr_mod, "seakr_uncertainty", lambda *a, **kw: np.zeros(0))
    monkeypatch.setattr(eval_stage.seakr_mod, "fit_seakr_threshold", lambda u, y: 0.5)
    monkeypatch.setattr(eval_stage.ccsk_mod, "fit_ccsk", lambda *a, **kw: "ccsk")
    selectors = eval_stage.fit_selectors(tiny_config("qwen2"), tmp_path, base)
    assert selectors.ik == "ik" and judged == want and selectors.ik_constant is False


def test_figure4_points_set_thresholds_on_validation_scores_with_ties(monkeypatch):
    """Five points over SR-RAG's validation scores [0.2, 0.2, 0.2, 0.2, 0.7, 0.9] (retrieve iff
    score > t): verbalize none (t = min - 1 = -0.8); 1/4, 1/2 and 3/4 fall in the four tied 0.2s
    (lower quantiles at positions 1.25, 2.5, 3.75 of the sorted scores: index 1, 2, 3, all 0.2),
    which verbalize 4 of 6 together; all (t = max = 0.9). The test questions' own scores never set
    a threshold; only PubHealth and TriviaQA (the paper's two) are routed."""
    val = np.array([0.2, 0.9, 0.2, 0.7, 0.2, 0.2])
    items = [("popqa", QAExample("p", "p?", ("x",))), ("triviaqa", QAExample("t1", "t1?", ("x",))),
             ("pubhealth", QAExample("h", "h?", ("true",))), ("triviaqa", QAExample("t2", "t2?", ("x",)))]
    test_score = {"p?": 0.0, "t1?": 0.1, "h?": 0.5, "t2?": 0.95}
    routed_at = []

    def route_items(model, its, policy, retrieve, cfg, bs, desc, mapper):
        routed_at.append((policy, [ex.question for _, ex in its]))
        return [types.SimpleNamespace(source=WIKI if test_score[ex.question] > policy else SELF) for _, ex in its]

    monkeypatch.setattr(latency, "srrag_policy", lambda neighbours, t: t)  # the policy is its threshold
    monkeypatch.setattr(latency, "route_items", route_items)
    monkeypatch.setattr(latency, "summarize", lambda its, routed: {
        "rag_frac": float(np.mean([r.source == WIKI for r in routed])), "acc": 0.0, "latency_s": 0.0, "phases": {}})
    cfg = tiny_config("qwen2")
    cfg.eval.latency_sweep_points = 5
    test = types.SimpleNamespace(items=items)
    curve = eval_stage.figure4_points(cfg, None, test, types.SimpleNamespace(bs=4, mapper=None), None, None,
                                      np.arange(4), val)
    assert [p["threshold"] for p in curve] == pytest.approx([-0.8, 0.2, 0.2, 0.2, 0.9])
    assert [p["verbalized_frac_validation"] for p in curve] == pytest.approx([0, 4 / 6, 4 / 6, 4 / 6, 1])
    assert all(qs == ["t1?", "h?", "t2?"] for _, qs in routed_at)
    # test scores 0.1, 0.5, 0.95: t = 0.2 verbalizes the first only, t = 0.9 all but 0.95
    assert [p["verbalized_frac"] for p in curve] == pytest.approx([0, 1 / 3, 1 / 3, 1 / 3, 2 / 3])
