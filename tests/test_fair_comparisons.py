"""Equal training, one latency measurement, one set of AUROC labels, IK's pass marks,
validation-chosen thresholds, p_M as the paper defines it, and a reading gate that asks as the
pipeline asks: each on hand-made inputs."""

import json
import random
import types

import numpy as np
import pytest
from scipy.special import softmax

from jaxrag.data.schema import QAExample
from jaxrag.decode.phases import charge_phases
from jaxrag.decode.policy import source_probabilities
from jaxrag.errors import JaxragError
from jaxrag.eval import latency, stats
from jaxrag.eval.harness import Decision, Paths
from jaxrag.models.tokens import NONE, SELF, WIKI

# -- 1. Selective RAG's second stage; config.training as run -------------------------------------


def test_selective_rag_gets_stage_two_on_its_own_stage_one_loss(tmp_path, monkeypatch):
    from jaxrag.pipeline import baselines

    calls = []
    records = [{"id": "a", "question": "q", "label": "self", "selective_label": "wiki", "no_kv_label": "wiki",
                "contexts": [{"source": "wiki", "loglik": -1.0, "text": "p"}], "best": {"wiki": 0}}]
    monkeypatch.setattr(baselines, "construct_records", lambda w: records)
    monkeypatch.setattr(baselines, "load", lambda cfg, path: str(path))
    monkeypatch.setattr(baselines, "build_policy_datastore", lambda *a: None)
    monkeypatch.setattr(baselines, "add_special_tokens", lambda m, sources: f"{m}+{'/'.join(sources)}")
    monkeypatch.setattr(baselines, "train_stage1", lambda m, recs, cfg, out: calls.append(("stage1", m, recs, out)))
    monkeypatch.setattr(baselines, "train_stage2", lambda m, ref, recs, cfg, out: calls.append(("stage2", m, recs, out)))
    monkeypatch.setattr(baselines, "train_stage2_no_dpo",
                        lambda m, recs, cfg, out: calls.append(("stage2_no_dpo", m, recs, out)))
    cfg = types.SimpleNamespace(pipeline=types.SimpleNamespace(workers=1))
    (tmp_path / "baselines").mkdir()
    baselines.baselines_stage(cfg, tmp_path)
    out = tmp_path / "baselines"
    sel = [c for c in calls if c[3].name.startswith("selective")]
    assert [(c[0], c[3]) for c in sel] == [("stage1", out / "selective_stage1"), ("stage2_no_dpo", out / "selective")]
    assert sel[0][1] == f"{tmp_path / 'base'}+wiki/none" and sel[1][1] == str(out / "selective_stage1" / "model")
    assert sel[0][2] == sel[1][2] and sel[1][2][0]["label"] == "wiki"  # the same relabelled data both stages


def test_training_record_reports_stages_as_run(tmp_path):
    from ml_collections import ConfigDict

    from jaxrag.pipeline.finetune import training_record

    cfg = ConfigDict({"stage1": {"epochs": 3, "lr": 3e-4}, "stage2": {"epochs": 2, "lr": 1e-4}})
    for stage_dir, section, last in (("stage1", "stage1", 30), ("stage2", "stage2", 20),
                                     ("baselines/selective_stage1", "stage1", 27), ("baselines/selective", "stage2", 18),
                                     ("baselines/no_dpo", "stage1", 9)):
        (tmp_path / stage_dir).mkdir(parents=True)
        lines = [{"step": s, "task": section, "loss": 1.0} for s in (10, last)]
        (tmp_path / stage_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    got = training_record(cfg, tmp_path)
    assert set(got) == {"srrag", "selective_rag", "srrag_no_kv_label", "srrag_no_dpo"}
    assert got["selective_rag"] == {"stages": [
        {"name": "stage1", "objective": "stage1_loss", "epochs": 3, "steps": 27, "lr": 3e-4},
        {"name": "stage2", "objective": "stage1_loss", "epochs": 2, "steps": 18, "lr": 1e-4}]}
    assert got["srrag"]["stages"][1] == {"name": "stage2", "objective": "stage2_loss", "epochs": 2, "steps": 20,
                                         "lr": 1e-4}
    assert got["srrag_no_dpo"]["stages"][1]["steps"] is None  # its log is another section's run: not stage 2
    assert got["srrag_no_kv_label"]["stages"][0]["steps"] is None  # never trained here: no log, no steps


# -- 2. Latency: every method the same measurement -------------------------------------------------


def test_phases_charge_every_second_to_someone():
    # A batch with no Self row: the verbalization step (appending the source tokens) goes to T_d.
    got = charge_phases({"T_d": 1.0, "T_v": 0.5, "T_r": 2.0, "T_g": 4.0}, [WIKI, WIKI, NONE, WIKI])
    assert got[0] == pytest.approx({"T_d": 1.5 / 4, "T_r": 2.0 / 3, "T_g": 1.0})
    assert got[2] == pytest.approx({"T_d": 1.5 / 4, "T_g": 1.0})
    assert sum(sum(r.values()) for r in got) == pytest.approx(7.5)
    mixed = charge_phases({"T_d": 1.0, "T_v": 3.0, "T_r": 2.0, "T_g": 4.0}, [SELF, WIKI, SELF, WIKI])
    assert mixed[0] == pytest.approx({"T_d": 0.25, "T_v": 1.5, "T_g": 1.0})
    assert mixed[1] == pytest.approx({"T_d": 0.25, "T_r": 1.0, "T_g": 1.0})
    assert sum(sum(r.values()) for r in mixed) == pytest.approx(10.0)


class _Tok:
    eos_token_id, chat_template = 0, None

    def __call__(self, texts, **kw):
        return {"input_ids": [[len(t)] for t in texts]}

    def decode(self, ids, skip_special_tokens=False):
        return f"ans{ids[0]}"


def test_untuned_methods_are_timed_in_the_same_batches_with_an_injected_clock(monkeypatch):
    from jaxrag.decode.routing import RouteConfig

    monkeypatch.setattr(latency, "generate", lambda dec, prompts, max_new, stop_ids=(), rows=None: [[p[0]] for p in prompts])
    model = types.SimpleNamespace(tokenizer=_Tok(), decoder=None)
    items = [("popqa", QAExample(str(i), f"q{i}", ("x",))) for i in range(3)] + [("nq", QAExample("9", "q9", ("x",)))]
    assert latency.latency_batches(items, 2) == [[0, 1], [2], [3]]
    retrieved = []
    retrieve = lambda qs: retrieved.append(qs) or [[f"p {q}"] for q in qs]  # noqa: E731
    cfg = RouteConfig(hidden_layer=1, max_verbal_tokens=4, max_answer_tokens=3)
    # per batch: retrieval start/end, answer start/end
    ticks = iter([0, 3, 3, 5, 10, 11, 11, 12, 20, 22, 22, 23])
    routed = latency.untuned_route_items(model, items, WIKI, retrieve, cfg, 2, "t", clock=lambda: next(ticks))
    assert retrieved == [["q0", "q1"], ["q2"], ["q9"]]  # one batched retrieval per latency batch
    assert [r.latency for r in routed] == [{"T_r": 1.5, "T_g": 1.0}, {"T_r": 1.5, "T_g": 1.0},
                                           {"T_r": 1.0, "T_g": 1.0}, {"T_r": 2.0, "T_g": 1.0}]
    assert all(r.source == WIKI for r in routed) and routed[0].knowledge == "p q0"
    s = latency.summarize(items, routed)
    assert s["n"] == 4 and s["phases"]["T_v"] == 0 and s["latency_s"] == pytest.approx(np.mean([np.mean([2.5, 2.5, 2.0]), 3.0]))
    ticks = iter([0, 4, 4, 6] * 3)  # GenRead: the document (T_v), then the answer (T_g)
    genread = latency.untuned_route_items(model, items, SELF, retrieve, cfg, 2, "t", clock=lambda: next(ticks))
    assert genread[0].latency == {"T_v": 2.0, "T_g": 1.0} and genread[3].latency == {"T_v": 4.0, "T_g": 2.0}
    assert all(r.source == SELF for r in genread)


# -- 3. AUROC differences over one set of labels ---------------------------------------------------


def _paths(retrieval, other, sources=(SELF, WIKI)):
    n = len(retrieval)
    items = [("popqa" if i < n // 2 else "nq", QAExample(str(i), f"q{i}", ("x",))) for i in range(n)]
    correct = {WIKI: np.array(retrieval, float), sources[0]: np.array(other, float)}
    return Paths(items, sources, correct, {s: np.zeros(n) for s in sources}, {s: [""] * n for s in sources})


def test_auroc_difference_needs_one_set_of_labels():
    boot = stats.StratifiedBootstrap(["popqa"] * 4 + ["nq"] * 4, 50, 0)
    a = _paths([1, 0, 1, 0, 1, 1, 0, 0], [0, 0, 1, 1, 0, 1, 0, 1])
    score_a = Decision(np.ones(8, bool), np.array([0.9, 0.1, 0.5, 0.2, 0.8, 0.3, 0.4, 0.1]))
    score_b = Decision(np.ones(8, bool), np.array([0.2, 0.1, 0.5, 0.9, 0.8, 0.3, 0.4, 0.6]))
    same = stats.paired_auroc_difference(boot, a, score_a, a, score_b)
    # labels: retrieval > other = rows 0 and 4. popqa: a ranks row 0 above all 3 negatives (1.0),
    # b above 1 of 3 (1/3); nq: a and b rank row 4 above all 3 (1.0). Mean difference = (2/3 + 0) / 2.
    assert same["diff"] == pytest.approx(1 / 3)
    b = _paths([1, 0, 1, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0], sources=(NONE, WIKI))
    with pytest.raises(JaxragError, match="different labels"):
        stats.paired_auroc_difference(boot, a, score_a, b, score_b)


def test_srrag_and_selective_rag_aurocs_are_not_compared():
    from jaxrag.eval.methods import AUROC_COMPARED

    assert "selective_rag" not in AUROC_COMPARED and "srrag_no_knn" in AUROC_COMPARED


# -- 4. IK's judge label: a pass mark per metric ----------------------------------------------------


def test_ik_knows_only_at_its_metrics_pass_mark():
    from jaxrag.eval.selectors import knows

    wow = QAExample("w", "tell me about x", ("the red house stands on the hill",))
    assert not knows("wow", "house", wow)  # F1 = 2 * 1 * (1/6) / (1 + 1/6) = 0.29: one shared token
    assert knows("wow", "red house stands on hill", wow)  # P = 1, R = 5/6 (articles dropped)
    asqa = QAExample("a", "who?", ("A",), metadata={"short_answers": [["Paris"], ["Lyon"], ["Nice"]]})
    assert not knows("asqa", "Paris", asqa)  # STR-EM 1/3
    assert knows("asqa", "Paris and Lyon", asqa)  # 2/3
    nq = QAExample("n", "capital?", ("Paris",))
    assert knows("nq", "It is Paris", nq) and not knows("nq", "Lyon", nq)


# -- 5. Thresholds chosen on validation ------------------------------------------------------------


def test_figure4_thresholds_verbalize_the_asked_share_of_validation():
    val = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
    for frac in (0.0, 0.3, 0.5, 1.0):
        t = latency.figure4_threshold(val, frac)
        assert np.mean(val <= t) == pytest.approx(frac)  # retrieve iff score > t


def test_selective_rag_at_srrag_retrieval_is_chosen_on_validation():
    from jaxrag.pipeline.eval import matched_retrieval

    srrag_val = np.array([0.1, 0.6, 0.7, 0.9])  # tau 0.5 -> SR-RAG retrieves 3 of 4 validation questions
    selective_val = np.array([0.05, 0.2, 0.3, 0.4])  # retrieving 3 of 4 needs t in [0.05, 0.2)
    test = _paths([1, 1, 0, 0, 1, 0, 1, 0], [0, 1, 1, 0, 0, 0, 1, 1], sources=(NONE, WIKI))
    d = Decision(np.ones(8, bool), np.array([0.01, 0.3, 0.04, 0.5, 0.06, 0.1, 0.9, 0.02]))
    got = matched_retrieval(srrag_val, 0.5, selective_val, test, d)
    assert got["threshold"] == 0.05 and got["srrag_rag_frac_validation"] == 0.75
    assert got["rag_frac_validation"] == 0.75 and got["chosen_on"] == "validation"
    # test: retrieve rows 1, 3, 4, 5, 6 (score > 0.05)
    popqa = np.mean([0, 1, 1, 0])  # rows 0-3: other, retrieval, other, retrieval
    nq = np.mean([1, 0, 1, 1])  # rows 4-7: retrieval, retrieval, retrieval, other
    assert got["acc"] == pytest.approx((popqa + nq) / 2)
    assert got["rag_frac"] == pytest.approx((0.5 + 0.75) / 2)


# -- 6. p_M: the source token's probability, not renormalised ---------------------------------------


def test_p_model_is_the_source_tokens_softmax_over_the_vocabulary():
    logits = np.array([[2.0, 0.5, -1.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    got = source_probabilities(logits, [3, 1])
    want = softmax(logits, axis=-1)[:, [3, 1]]
    np.testing.assert_allclose(got, want, rtol=1e-6)  # float32 on device
    assert got[1] == pytest.approx([0.2, 0.2], rel=1e-6) and got.sum(axis=1)[0] < 1  # not renormalised
    big = np.array([[1000.0, 999.0, -np.inf]])  # stable for large logits, masked ids get 0
    np.testing.assert_allclose(source_probabilities(big, [1, 2]), [[1 / (1 + np.e), 0.0]], rtol=1e-4)  # f32 at 1e3


@pytest.fixture(scope="module")
def route_model(tmp_path_factory):
    from hf_fixtures import make_hf_model

    import jaxrag
    from jaxrag.models.model import add_special_tokens

    out = tmp_path_factory.mktemp("pm")
    make_hf_model(out, "qwen2", seed=3)
    return add_special_tokens(jaxrag.load_model(out))


def test_router_inputs_read_what_route_reads(route_model):
    from jaxrag.decode.routing import RouteConfig, route
    from jaxrag.policies import always, router_inputs

    questions = ["who wrote the book?", "where is the river", "when"]
    seen = []
    route(route_model, questions, lambda x: seen.append(x) or always(WIKI)(x), lambda qs: [["p"]] * len(qs),
          RouteConfig(hidden_layer=1, max_verbal_tokens=2, max_answer_tokens=2))
    got = router_inputs(route_model, questions, hidden_layer=1, batch_size=2)
    np.testing.assert_allclose(got.hidden, seen[0].hidden, rtol=2e-4, atol=2e-5)
    assert got.sources == seen[0].sources and got.p_model.shape == seen[0].p_model.shape
    assert (got.p_model.sum(axis=1) < 1).all()


def test_route_reads_p_model_as_source_probabilities(route_model):
    from jaxrag.decode.routing import RouteConfig, route
    from jaxrag.policies import always, router_inputs

    questions = ["who wrote the book?", "where is the river"]
    seen = []
    route(route_model, questions, lambda x: seen.append(x) or always(WIKI)(x), lambda qs: [["p"]] * len(qs),
          RouteConfig(hidden_layer=1, max_verbal_tokens=2, max_answer_tokens=2))
    np.testing.assert_allclose(router_inputs(route_model, questions, 1).p_model, seen[0].p_model, rtol=2e-4)


# -- 8. The reading gate asks as the pipeline asks -------------------------------------------------


def test_reading_gate_passages_are_formatted_as_retrieval_hands_them():
    from jaxrag.world.probe import retrieved_passages

    got = retrieved_passages(["Gold Name\ngold text.", "Other\nother text.", "Third\nthird text."], random.Random(1))
    assert sorted(got) == ["(Title: Gold Name) gold text.", "(Title: Other) other text.", "(Title: Third) third text."]
    ranks = {retrieved_passages(["G\ng", "A\na", "B\nb"], random.Random(s)).index("(Title: G) g") for s in range(40)}
    assert ranks == {0, 1, 2}  # the gold passage is not always first


def test_routed_reading_prompt_is_routes_wiki_row(route_model):
    from jaxrag.world.probe import routed_reading_prompts
    from jaxrag.models.tokens import source_token

    tok = route_model.tokenizer
    wiki = route_model.token_id(source_token(WIKI))
    passages = [["(Title: A) alpha beta gamma", "(Title: B) delta"]]
    full = routed_reading_prompts(tok, wiki, ["who is a?"], passages, 10 ** 6)[0]
    text = tok.decode(full)
    assert text.replace(" ", "") == ("Question: who is a? Background knowledge:<EOQ><Wiki> (Title: A) alpha beta gamma\n"
                                     "(Title: B) delta<EOK> Answer:").replace(" ", "")
    cut = routed_reading_prompts(tok, wiki, ["who is a?"], passages, 3)[0]
    tail = len(tok(" Answer:", add_special_tokens=False)["input_ids"]) + 1
    head = full.index(wiki) + 1
    assert cut[:head + 3] == full[:head + 3] and cut[head + 3:] == full[-tail:]  # knowledge cut at 3 tokens


def test_reading_gate_asks_both_prompts_and_gates_on_the_base_one(route_model, monkeypatch):
    from jaxrag.world.generate import generate_world
    from jaxrag.world import probe
    from jaxrag.models.tokens import source_token

    world = generate_world()
    tok, wiki = route_model.tokenizer, route_model.token_id(source_token(WIKI))
    gold = {q: a for q, _, a in probe.fresh_reading_questions(world, 6, 3)}
    asked = []

    def fake_generate(decoder, prompts, max_new, stop_ids=()):
        out = []
        for ids in prompts:
            text = tok.decode(ids)
            asked.append((wiki in ids, text))
            q = next(q for q in gold if q in text)
            out.append(tok(" " + (gold[q] if wiki not in ids else "no idea"), add_special_tokens=False)["input_ids"])
        return out

    monkeypatch.setattr(probe, "generate", fake_generate)
    got = probe.fresh_reading(route_model, world, 6, passages=3, max_knowledge_tokens=10 ** 6)
    assert got == {"reading": 1.0, "base_prompt": 1.0, "routed_prompt": 0.0}
    assert sum(routed for routed, _ in asked) == 6 and len(asked) == 12
    for _, text in asked:  # three passages in the index's lines, in either prompt
        assert text.count("(Title: ") == 3
