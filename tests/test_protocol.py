"""The paper's evaluation protocol: thresholds from the config, validation from the training
mixture, Table 5 sampling, Table 2 per dataset, the w/o DPO objective, measured latency of a mixed
batch (injected clock) and bootstrap intervals."""

import json
import types

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from jaxrag.data.mixture import mixture_split, stratified_sample
from jaxrag.data.schema import QAExample
from jaxrag.decode.policy import PolicyDecision, PolicyInputs
from jaxrag.eval import harness, latency, stats
from jaxrag.eval.harness import Decision, Paths
from jaxrag.eval.methods import Evaluation, Method
from jaxrag.models.tokens import SELF, WIKI
from jaxrag.pipeline.config import TABLE5_TRAIN, TABLE5_VALIDATION, tiny_config


def make_paths(names, verb, ret, p_wiki=None):
    items = [(n, QAExample(f"{n}-{i}", f"question {i}?", ("a",))) for i, n in enumerate(names)]
    n = len(items)
    p = np.zeros((n, 2)) if p_wiki is None else np.column_stack([p_wiki, 1 - np.asarray(p_wiki)])
    inputs = PolicyInputs([ex.question for _, ex in items], (WIKI, SELF), p, np.eye(n, 4))
    return Paths(items, (WIKI, SELF), {SELF: np.asarray(verb, float), WIKI: np.asarray(ret, float)},
                 {SELF: np.zeros(n), WIKI: np.zeros(n)}, {SELF: ["v"] * n, WIKI: ["r"] * n}, inputs)


class NoSelectors:
    def paper_threshold(self, rule):
        raise AssertionError(rule)


def test_paper_thresholds_come_from_the_config():
    cfg = tiny_config("qwen2")
    paths = make_paths(["popqa"] * 4, [0, 0, 0, 0], [1, 1, 1, 1], p_wiki=[0.1, 0.25, 0.5, 0.9])
    for tau, want in ((0.2, [False, True, True, True]), (0.6, [False, False, False, True])):
        cfg.inference.tau, cfg.inference.selective_tau = tau, 1.0 - tau
        ev = Evaluation(cfg, NoSelectors())
        d, _ = ev.decide(Method("srrag_no_knn", "srrag", "tau_no_knn"), paths, None, None)
        assert d.retrieve.tolist() == want and ev.thresholds["srrag_no_knn"] == tau
        # with kNN: p_D = share of Wiki neighbours (here 1 of 2), so the product halves p_M
        d, _ = ev.decide(Method("srrag", "srrag", "tau"), paths, None, lambda h: np.tile([0, 1], (len(h), 1)))
        assert d.retrieve.tolist() == (np.array([0.1, 0.25, 0.5, 0.9]) / 2 > tau).tolist()
        d, _ = ev.decide(Method("selective_rag", "selective", "selective_tau"), paths, None, None)
        assert ev.thresholds["selective_rag"] == 1.0 - tau
        assert d.retrieve.tolist() == (np.array([0.1, 0.25, 0.5, 0.9]) > 1.0 - tau).tolist()
    cfg.eval.thresholds = "tuned"
    with pytest.raises(Exception, match="eval.thresholds"):
        Evaluation(cfg, NoSelectors())


def test_validation_variant_tunes_on_the_validation_paths_only():
    cfg = tiny_config("qwen2")
    cfg.eval.thresholds = "validation"
    ev = Evaluation(cfg, NoSelectors())
    # validation: retrieval helps only where p_M(<Wiki>) >= 0.7 -> t lands in [0.3, 0.7)
    val = make_paths(["nq"] * 4, [1, 1, 0, 0], [0, 0, 1, 1], p_wiki=[0.1, 0.3, 0.7, 0.9])
    test = make_paths(["popqa"] * 3, [0, 0, 0], [1, 1, 1], p_wiki=[0.2, 0.5, 0.8])
    d, _ = ev.decide(Method("srrag_no_knn", "srrag", "tau_no_knn"), test, val, None)
    assert 0.3 <= ev.thresholds["srrag_no_knn"] < 0.7 and d.retrieve.tolist()[::2] == [False, True]


def test_mixture_split_counts_disjoint_and_seeded():
    pool = list(range(1000))
    train, val = mixture_split(pool, 600, 50, seed=3, name="nq")
    assert len(train) == 600 and len(val) == 50 and not set(train) & set(val)
    assert train == sorted(train) and (train, val) == mixture_split(pool, 600, 50, seed=3, name="nq")
    assert mixture_split(pool, 600, 50, seed=4, name="nq")[1] != val
    small_train, small_val = mixture_split(pool[:30], 600, 50, seed=3, name="nq")  # validation first
    assert len(small_val) == 30 and small_train == []
    assert sum(TABLE5_TRAIN.values()) == 50912 and sum(TABLE5_VALIDATION.values()) == 2677


def test_stratified_sample_is_proportional():
    items = [("wow", i) for i in range(600)] + [("nq", i) for i in range(300)] + [("asqa", i) for i in range(100)]
    sample = stratified_sample(items, 100, seed=0)
    counts = {n: sum(1 for m, _ in sample if m == n) for n in ("wow", "nq", "asqa")}
    assert counts == {"wow": 60, "nq": 30, "asqa": 10}
    assert sample == sorted(sample, key=items.index)  # input order kept
    assert len(stratified_sample(items, 7, seed=0)) == 7  # largest remainders fill the rounding gap
    assert stratified_sample(items[:5], 10, seed=0) == items[:5]


def test_validation_comes_from_the_training_mixture(tmp_path):
    """Real data: validation = Table 5 counts drawn from the training files; no test question."""
    from jaxrag.pipeline.config import paper_config
    from jaxrag.pipeline.workdir import eval_items

    cfg = paper_config("qwen2")
    cfg.data.train, cfg.data.eval = ["nq", "fever"], ["popqa"]
    for name, n in (("nq", 40), ("fever", 30), ("popqa", 25)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"id": f"{name}{i}", "question": f"{name} question {i}?",
                                            "golden_answers": ["true" if name == "fever" else "x"]}) + "\n"
                                for i in range(n)))
        cfg.data.paths[name] = str(path)
    cfg.data.train_sizes.update(nq=20, fever=10)
    cfg.data.validation_sizes.update(nq=5, fever=4)
    val, test = eval_items(cfg, tmp_path)
    assert [n for n, _ in val].count("nq") == 5 and [n for n, _ in val].count("fever") == 4
    assert len(test) == 25 and {n for n, _ in test} == {"popqa"}  # the test set whole
    assert not {ex.question for _, ex in val} & {ex.question for _, ex in test}


def test_table2_per_dataset_by_hand():
    # popqa: ret/verb pairs (1,0) (1,1) (0,1) (0,0); arc: only ties -> no AUROC (one class)
    paths = make_paths(["popqa"] * 4 + ["arc"] * 2, [0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 1, 0])
    d = Decision(np.array([True, False, False, True, True, False]), np.array([0.9, 0.2, 0.4, 0.1, 0.5, 0.5]))
    sel = harness.source_selection(paths, d)
    # popqa: retrieve where ret wins (right), verbalize on a tie (right), verbalize where verb wins
    # (right), retrieve on a tie (right) -> 1.0; arc: both ties -> right either way -> 1.0
    assert sel["per_dataset"]["popqa"]["acc_verb_ge_ret"] == 1.0
    # popqa AUROC: one positive (0.9) above all three negatives -> 1.0; arc has none -> left out
    assert sel["per_dataset"]["popqa"]["auroc_ret_gt_verb"] == 1.0
    assert sel["per_dataset"]["arc"]["auroc_ret_gt_verb"] is None and sel["auroc_left_out"] == ["arc"]
    assert sel["auroc_ret_gt_verb"] == 1.0
    d2 = Decision(np.array([False, True, True, False, False, True]), np.array([0.1, 0.9, 0.8, 0.7, 0.5, 0.5]))
    sel2 = harness.source_selection(paths, d2)  # popqa: wrong on rows 0 and 2 -> 0.5; arc: 1.0
    assert sel2["acc_verb_ge_ret"] == pytest.approx((0.5 + 1.0) / 2)
    assert sel2["auroc_ret_gt_verb"] == 0.0  # the one positive (0.1) ranks below all three negatives


def test_accuracy_by_question_kind_by_hand():
    """The world's question kinds per dataset: the method's ACC and % RAG, each path's own."""
    paths = make_paths(["triviaqa"] * 4 + ["popqa"] * 2, [1, 1, 0, 1, 0, 1], [0, 0, 1, 1, 1, 0])
    kinds = ["chain", "chain", "fact", "fact", "fact", "fact"]
    paths.items = [(n, QAExample(ex.id, ex.question, ex.golden_answers, metadata={"kind": k}))
                   for (n, ex), k in zip(paths.items, kinds)]
    d = Decision(np.array([True, False, False, True, True, True]), None)
    out = harness.by_kind(paths, d)
    assert list(out) == ["popqa/fact", "triviaqa/chain", "triviaqa/fact"]
    # chains: retrieved row 0 (ret 0), verbalized row 1 (verb 1) -> 0.5 at 50%; paths 0.0 / 1.0
    assert out["triviaqa/chain"] == {"acc": 0.5, "rag_frac": 0.5, "n": 2, "acc_retrieval": 0.0,
                                     "acc_other": 1.0}
    assert out["triviaqa/fact"]["acc"] == 0.5 and out["popqa/fact"]["acc"] == 0.5
    assert harness.by_kind(make_paths(["popqa"] * 2, [1, 0], [0, 1]), d) == {}  # real data: no kinds


def test_no_choice_fraction_reads_each_rows_chosen_path():
    # ARC rows 0-3, each path's answer by hand; the decision picks which answer counts.
    paths = make_paths(["arc_challenge"] * 4 + ["popqa"], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1])
    paths.items = [(n, QAExample(ex.id, ex.question, ("blue",), ("red", "blue", "pink", "grey")))
                   for n, ex in paths.items[:4]] + paths.items[4:]
    paths.answers = {SELF: ["blue", "blue", "B", "The city of Pulu belongs to Kreda.", "x"],
                     WIKI: ["false", "blue.", "jeweler", "(D)", "x"]}
    d = Decision(np.array([True, True, False, True, True]), None)
    per, avg = harness.summarize(paths, d)
    # chosen answers: "false" (none), "blue." (blue), "B" (letter: blue), "(D)" (grey) -> 1 of 4
    assert per["arc_challenge"]["no_choice_frac"] == 0.25
    assert "no_choice_frac" not in per["popqa"] and "no_choice_frac" not in avg  # not multiple choice
    d_other = Decision(~d.retrieve, None)  # "blue", "blue", "jeweler", "The city ..." -> 2 of 4
    assert harness.summarize(paths, d_other)[0]["arc_challenge"]["no_choice_frac"] == 0.5


def test_no_dpo_stage_runs_the_stage1_objective(monkeypatch, tmp_path):
    from jaxrag.train import losses, stages

    seen = {}

    def fake_fit(decoder, data, objective, spec, workdir, mesh, fingerprint, trainable):
        seen.update(objective=objective, spec=spec, fingerprint=fingerprint, pairs=data.pairs, trainable=trainable)
        raise StopIteration  # stop before any training: only the wiring is under test

    class FakeData:
        def __init__(self, recs, tok, max_length, lam, seed, pairs):
            self.pairs, self.lam, self.max_length = pairs, lam, max_length

        def __len__(self):
            return 40

    monkeypatch.setattr(stages, "fit", fake_fit)
    monkeypatch.setattr(stages, "RecordData", FakeData)
    monkeypatch.setattr(stages, "as_records", lambda records, sources: records)
    cfg = tiny_config("qwen2")
    ids = {"<EOQ>": 7, "<Wiki>": 8, "<Self>": 9, "<EOK>": 10}
    model = type("M", (), {"sources": ("wiki", "self"), "tokenizer": None, "decoder": None,
                           "config": types.SimpleNamespace(lora_rank=0), "token_id": lambda self, t: ids[t]})()
    with pytest.raises(StopIteration):
        stages.train_stage2_no_dpo(model, [], cfg, tmp_path)
    assert seen["objective"] is losses.stage1_objective and not seen["pairs"]
    s2 = cfg.stage2
    assert seen["spec"].lr == s2.lr and seen["spec"].batch_size == s2.batch_size
    assert seen["spec"].total_steps == s2.epochs * -(-40 // s2.batch_size)
    assert seen["spec"].token_ids == (7, 8, 9, 10) and seen["spec"].token_lr_scale == s2.token_lr_scale
    assert seen["fingerprint"]["task"] == "stage2_no_dpo" and not seen["trainable"].lora  # full FT: all trains


@pytest.fixture(scope="module")
def route_model(tmp_path_factory):
    from hf_fixtures import make_hf_model

    import jaxrag
    from jaxrag.models.model import add_special_tokens

    out = tmp_path_factory.mktemp("latency")
    make_hf_model(out, "qwen2", seed=5)
    return add_special_tokens(jaxrag.load_model(out))


def test_mixed_batch_latency_with_an_injected_clock(route_model, monkeypatch):
    """App. B.2 in one real routed batch: T_d and T_g shared by all 4 rows, T_v by the one Self
    row, T_r by the three Wiki rows (one batched retrieval)."""
    from types import SimpleNamespace

    from jaxrag.decode import routing
    from jaxrag.decode.routing import RouteConfig

    wiki, self_ = route_model.sources.index(WIKI), route_model.sources.index(SELF)
    policy = lambda inputs: PolicyDecision(np.array([wiki, self_, wiki, wiki]))  # noqa: E731
    items = [("popqa", QAExample(str(i), f"who is person {i}?", ("x",))) for i in range(4)]
    retrieve = lambda qs: [[f"passage on {q}"] for q in qs]  # noqa: E731
    cfg = RouteConfig(hidden_layer=1, max_verbal_tokens=4, max_answer_tokens=3)
    latency.route_items(route_model, items, policy, retrieve, cfg, 4, "compile")  # the clock below times one run
    # select, policy, append the source tokens (T_d), verbalize, retrieve, answer
    ticks = iter([0, 1, 1, 1.5, 2, 2.5, 2.5, 6, 6, 8, 8, 10])
    monkeypatch.setattr(routing, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    routed = latency.route_items(route_model, items, policy, retrieve, cfg, 4, "test")
    want = [2 / 4 + 2 / 3 + 2 / 4, 2 / 4 + 3.5 / 1 + 2 / 4, 2 / 4 + 2 / 3 + 2 / 4, 2 / 4 + 2 / 3 + 2 / 4]
    assert [latency.item_seconds(r) for r in routed] == pytest.approx(want)
    assert [r.source for r in routed] == [WIKI, SELF, WIKI, WIKI]
    s = latency.summarize(items, routed)
    assert s["latency_s"] == pytest.approx(np.mean(want)) and s["rag_frac"] == 0.75
    assert s["phases"]["T_v"] == pytest.approx(3.5 / 4) and s["phases"]["T_r"] == pytest.approx(3 * (2 / 3) / 4)


def test_latency_questions_are_the_first_of_each_set():
    items = [(n, None) for n in ["a"] * 3 + ["b"] * 5 + ["a"]]
    assert latency.latency_indices(items, 2).tolist() == [0, 1, 3, 4]


def test_bootstrap_interval_matches_scipy_on_one_dataset():
    from scipy.stats import bootstrap

    rng = np.random.default_rng(0)
    values = (rng.random(300) < 0.6).astype(float)
    ours = stats.interval(stats.StratifiedBootstrap(["d"] * 300, 4000, seed=1).average(values))
    ref = bootstrap((values,), np.mean, n_resamples=4000, method="percentile", random_state=2).confidence_interval
    assert ours == pytest.approx([ref.low, ref.high], abs=0.01)


def test_stratified_average_and_paired_differences():
    names = ["a"] * 10 + ["b"] * 30
    a = np.r_[np.ones(10), np.zeros(30)]  # dataset means 1 and 0 -> average 0.5, whatever the draw
    boot = stats.StratifiedBootstrap(names, 500, seed=0)
    assert stats.interval(boot.average(a)) == [0.5, 0.5]
    same = stats.paired_difference(boot, a, a)
    assert same == {"diff": 0.0, "ci95": [0.0, 0.0], "significant": False}
    shifted = stats.paired_difference(boot, a, a - 0.25)
    assert shifted["diff"] == pytest.approx(0.25) and shifted["ci95"] == pytest.approx([0.25, 0.25])
    assert shifted["significant"]
    rng = np.random.default_rng(1)
    noisy = stats.paired_difference(boot, rng.random(40), rng.random(40))
    assert noisy["ci95"][0] < noisy["diff"] < noisy["ci95"][1]


def test_fast_auroc_equals_sklearn():
    rng = np.random.default_rng(0)
    for _ in range(5):
        labels, scores = rng.random(50) < 0.3, np.round(rng.random(50), 1)  # rounding makes ties
        assert stats.auroc(labels, scores) == pytest.approx(roc_auc_score(labels, scores))
    assert np.isnan(stats.auroc(np.ones(3, bool), np.arange(3.0)))


def test_bootstrap_auroc_equals_the_auroc_of_each_resample():
    rng = np.random.default_rng(2)
    names = ["a"] * 40 + ["b"] * 25 + ["c"] * 6  # c: one class only, never in the mean
    labels = np.r_[rng.random(40) < 0.3, rng.random(25) < 0.6, np.ones(6, bool)]
    scores = np.round(rng.random(71), 1)  # ties
    boot = stats.StratifiedBootstrap(names, 300, seed=3)
    ref = []
    for draw in range(300):
        per = [roc_auc_score(labels[d[draw]], scores[d[draw]]) if len(set(labels[d[draw]])) == 2 else np.nan
               for d in boot.draws.values()]
        ref.append(np.nanmean(per))
    assert boot.auroc(labels, scores) == pytest.approx(np.array(ref), abs=1e-12)
    assert np.isnan(stats.StratifiedBootstrap(["c"] * 6, 10).auroc(np.ones(6, bool), scores[:6])).all()


def test_tau_curves_average_datasets_then_workdirs_and_ties_go_to_less_retrieval():
    from jaxrag.pipeline import tau

    # workdir A: nq (2 questions) + fever (2); retrieval helps exactly where the score >= 0.5
    a = make_paths(["nq", "nq", "fever", "fever"], [1, 0, 1, 0], [0, 1, 0, 1])
    b = make_paths(["nq", "nq"], [1, 1], [0, 0])  # workdir B: verbalizing is always right
    score_a, score_b = np.array([0.1, 0.5, 0.3, 0.9]), np.array([0.2, 0.6])
    per = [{rule: (a, score_a) for rule in tau.RULES}, {rule: (b, score_b) for rule in tau.RULES}]
    points = {p["threshold"]: p for p in tau.curves(per)["srrag"]}
    for t in (0.05, 0.25, 0.45, 0.55, 0.95):
        r_a, r_b = score_a > t, score_b > t
        acc_a = np.mean([np.mean(np.where(r_a, [0, 1, 0, 1], [1, 0, 1, 0])[s]) for s in (slice(0, 2), slice(2, 4))])
        acc_b = np.mean(np.where(r_b, [0, 0], [1, 1]))
        assert points[t]["acc"] == pytest.approx((acc_a + acc_b) / 2)
        assert points[t]["rag_frac"] == pytest.approx((np.mean([r_a[:2].mean(), r_a[2:].mean()]) + r_b.mean()) / 2)
    # by hand: 0.75 on [0.3, 0.5), 0.625 on [0.5, 0.6), 0.875 on [0.6, 0.9): the larger tie wins
    best = tau.best(tau.curves(per)["srrag"])
    assert (best["threshold"], best["acc"]) == (0.85, pytest.approx(0.875))


def test_latency_batches_that_compiled_are_timed_again(monkeypatch):
    """Compilation is not latency: a routed batch during which JAX compiled (a shape or a model
    seen for the first time) is routed again and the second run kept; a batch that compiled
    nothing runs once. Before, one untimed warm-up per model left the compiles of the other
    methods' own programs and batch shapes (IK, SeaKR, CCSK: 8-11 s each on a 2-core CPU) in
    their latency."""
    import jax

    from jaxrag.decode.routing import Routed

    compiled, calls = set(), []

    def fake_route(model, questions, policy, retrieve, cfg, rows=None):
        calls.append((model, len(questions), rows))
        seconds = 1.0
        if (model, rows) not in compiled:  # a new shape (rows: the batch size): JAX compiles, slowly
            compiled.add((model, rows))
            jax.monitoring.record_event_duration_secs("/jax/core/compile/backend_compile_duration", 5.0)
            seconds = 5.0
        return [Routed(q, WIKI, [1.0, 0.0], None, None, "", "a", False, {"T_d": seconds}) for q in questions]

    monkeypatch.setattr(latency, "route", fake_route)
    ev = Evaluation(tiny_config("qwen2"), NoSelectors())
    paths = make_paths(["popqa"] * 2 + ["triviaqa"] * 3, [0] * 5, [1] * 5, p_wiki=[0.9] * 5)
    d = Decision(np.full(5, True), np.full(5, 0.9))
    # 2 batches (popqa's 2 questions, triviaqa's 3), both padded to the batch size: the first
    # compiles and runs twice, the second reuses its programs and runs once.
    expected_calls = {"srrag": 3, "srrag_no_knn": 2, "selective_rag": 3}
    for name, model in (("srrag", "srrag"), ("srrag_no_knn", "srrag"), ("selective_rag", "selective")):
        calls.clear()
        ev.results["average"][name] = {"acc": 1.0, "rag_frac": 1.0}
        for ds in ("popqa", "triviaqa"):
            ev.results["datasets"].setdefault(ds, {})[name] = {}
        routed = latency.route_items(model, paths.items, None, None, None, ev.bs, name)
        ev.measured(Method(name, model, "tau"), routed, paths, d, np.arange(5))
        assert ev.results["latency"][name]["latency_s"] == 1.0  # a compiling run's 5 s is never kept
        assert len(calls) == expected_calls[name] and {rows for _, _, rows in calls} == {ev.bs}


def test_without_compiles_reruns_only_a_run_that_compiled():
    """Against a real jitted function: its first call traces and compiles (run twice), a call
    with the shapes already compiled runs once."""
    import jax
    import jax.numpy as jnp

    from jaxrag.eval.harness import without_compiles

    f, x, calls = jax.jit(lambda v: v * 3 + 1), jnp.arange(7.0), []

    def run():
        calls.append(1)
        return f(x)

    assert np.array_equal(without_compiles(run), np.arange(7.0) * 3 + 1) and len(calls) == 2
    calls.clear()
    assert np.array_equal(without_compiles(run), np.arange(7.0) * 3 + 1) and len(calls) == 1
