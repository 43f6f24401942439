"""SR-RAG routed inference: batched rows equal separate runs; tau flips routes; truncation."""

import contextlib
import copy
import dataclasses
import types

import jax
import numpy as np
import pytest

from jaxrag.decode.routing import RouteConfig, route
from jaxrag.decode.sampler import batch_rows, generate
from jaxrag.errors import JaxragError
from jaxrag.models.model import add_special_tokens, for_inference
from jaxrag.models.tokens import source_token
from jaxrag.policies import always
from jaxrag.policies.srrag import choose_source, policy_distribution, srrag_policy
from jaxrag.prompts import answer_prefix_ids, knowledge_ids, prompt_ids

QUESTIONS = ["who wrote the novel?", "where is the fox?", "what does retrieval read?", "who is lazy?"]
LABELS = {0: "wiki", 1: "self", 2: "wiki", 3: "self"}
CFG = RouteConfig(hidden_layer=2, max_verbal_tokens=6, max_knowledge_tokens=200, max_answer_tokens=5)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from hf_fixtures import make_hf_model

    import jaxrag

    out = tmp_path_factory.mktemp("route")
    make_hf_model(out, "qwen2", seed=3)
    return add_special_tokens(jaxrag.load_model(out))


def retrieve(questions):
    return [[f"Passage about {q} number {j}." for j in range(2)] for q in questions]


@pytest.fixture(scope="module")
def datastore(model):
    """Hand-built: key = each question's own hidden state at <EOQ>, label from LABELS."""
    keys = []
    for q in QUESTIONS:
        ids = prompt_ids(model.tokenizer, [q])[0]
        keys.append(np.asarray(model.hidden_states([ids], CFG.hidden_layer))[0, -1])
    keys = np.stack(keys)
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    labels = np.array([["wiki", "self"].index(LABELS[i]) for i in range(len(QUESTIONS))])

    def neighbours(hidden):  # exact cosine 1-NN
        h = hidden / np.linalg.norm(hidden, axis=1, keepdims=True)
        return labels[np.argmax(h @ keys.T, axis=1)][:, None]

    return neighbours


def test_batched_rows_equal_separate_runs(model, datastore):
    policy = srrag_policy(datastore, tau=0.0)
    batched = route(model, QUESTIONS, policy, retrieve, CFG)
    assert [r.source for r in batched] == [LABELS[i] for i in range(4)]
    for i, q in enumerate(QUESTIONS):
        alone = route(model, [q], policy, retrieve, CFG)[0]
        assert (alone.source, alone.knowledge, alone.answer) == (batched[i].source, batched[i].knowledge, batched[i].answer)
        np.testing.assert_allclose(alone.p_model, batched[i].p_model, atol=1e-5)
    for r in batched:
        assert r.latency["T_d"] > 0 and r.latency["T_g"] > 0
        assert ("T_r" in r.latency) == (r.source == "wiki") and ("T_v" in r.latency) == (r.source == "self")
        assert r.knowledge_truncated == (r.source == "self")  # 6 tokens never reach <EOK> here


def test_each_row_answers_to_its_own_max_tokens(model, datastore):
    """Per-question budgets (an OpenAI request's max_tokens): a row stops at its own, greedy, so its
    answer begins the unbudgeted answer, and a budget out of range is refused."""
    policy = srrag_policy(datastore, tau=0.0)
    full = route(model, QUESTIONS, policy, retrieve, CFG)
    budgets = [1, 2, 3, CFG.max_answer_tokens]
    cut = route(model, QUESTIONS, policy, retrieve, CFG, max_tokens=budgets)
    for f, c in zip(full, cut):
        assert (c.source, c.knowledge) == (f.source, f.knowledge) and f.answer.startswith(c.answer)
    assert cut[-1].answer == full[-1].answer and len(cut[0].answer) < len(full[0].answer)
    with pytest.raises(JaxragError, match="max_tokens needs one budget per question"):
        route(model, QUESTIONS, policy, retrieve, CFG, max_tokens=[CFG.max_answer_tokens + 1, 1, 1, 1])


@contextlib.contextmanager
def decoder_traces():
    """The decoder programs (`extend`, `decode`) traced for a new shape inside the block, in
    order: a program the persistent compilation cache holds is traced all the same, never compiled."""
    traced = []

    def listen(event: str, _seconds: float, fun_name: str = "", **_) -> None:
        if event.endswith("jaxpr_trace_duration") and fun_name in ("extend", "decode"):
            traced.append(fun_name)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield traced
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_a_loops_last_shorter_batch_runs_the_full_batches_programs(model, datastore):
    """`rows`: a loop's batch size. Its last, shorter batch is padded to it, so it compiles
    nothing new (a batch of its own power of two would), and routes as it does alone; the
    paper's batch of 10 questions runs 10 rows, not 16 (a multiple of the data-parallel size)."""
    policy = srrag_policy(datastore, tau=0.0)
    with decoder_traces() as traced:
        full = route(model, QUESTIONS[:3], policy, retrieve, CFG, rows=3)  # Wiki, Self, Wiki
    assert traced
    with decoder_traces() as traced:
        # A Wiki and a Self row, as in the full batch (the answer phase appends only as many
        # knowledge columns as its batch needs: a batch of Self rows alone is a shorter chunk).
        last = route(model, QUESTIONS[2:], policy, retrieve, CFG, rows=3)
    assert traced == []
    for got, want in zip(full + last[1:], route(model, QUESTIONS, policy, retrieve, CFG)):
        assert (got.source, got.knowledge, got.answer) == (want.source, want.knowledge, want.answer)
        np.testing.assert_allclose(got.p_model, want.p_model, atol=1e-5)
    assert (batch_rows(7), batch_rows(7, size=10), batch_rows(10, size=10)) == (8, 10, 10)
    mesh = types.SimpleNamespace(shape={"data": 4, "fsdp": 2, "tensor": 1})
    assert (batch_rows(3, mesh), batch_rows(3, mesh, 10), batch_rows(10, mesh, 10)) == (8, 16, 16)
    with pytest.raises(ValueError, match="11 rows do not fit a batch of 10"):
        batch_rows(11, size=10)


def test_datastore_scores_each_source_from_the_cache_routing_leaves(model):
    """`source_likelihoods` (the policy datastore's key and per-source log-likelihoods) in one
    batch equal each question done by hand: the hidden state at <EOQ> (a forward pass), the
    verbalization routing writes (`route` with <Self> forced), and the gold answer scored after
    each source's prefix by a prefill of it (`score`): <Self> with the tokens the model wrote,
    <Wiki> with the passages cut to the knowledge budget, each then `<EOK> Answer:`."""
    from jaxrag.decode.scoring import score
    from jaxrag.decode.source_scores import SOURCES, source_likelihoods
    from jaxrag.prompts import answer_ids

    assert SOURCES == ("self", "wiki")
    tok, eos, eok = model.tokenizer, model.tokenizer.eos_token_id, model.token_id("<EOK>")
    answers = ["Hawthorne", "the fox", "passages", "the dog"]
    passages = [[f"{q} is answered in passage {i}."] for i, q in enumerate(QUESTIONS)]
    passages[3] = []  # no passage: the <Wiki> row scores the answer right after the tail
    cfg = dataclasses.replace(CFG, max_knowledge_tokens=7)  # some passages are cut
    keys, ll = source_likelihoods(model, QUESTIONS, answers, passages, cfg, rows=4)
    routed = route(model, QUESTIONS, always("self"), retrieve, cfg)
    tail = answer_prefix_ids(tok)
    for i, q in enumerate(QUESTIONS):
        prompt = prompt_ids(tok, [q])[0]
        np.testing.assert_allclose(keys[i], np.asarray(model.hidden_states([prompt], cfg.hidden_layer))[0, -1],
                                   atol=1e-4)
        verbal = generate(model.decoder, [prompt + [model.token_id(source_token("self"))]], cfg.max_verbal_tokens,
                          stop_ids=[eok, eos])[0]
        assert tok.decode([t for t in verbal if t not in (eok, eos)]).strip() == routed[i].knowledge
        own = prompt + [model.token_id(source_token("self"))] + verbal + (tail[1:] if verbal[-1:] == [eok] else tail)
        know = knowledge_ids(tok, [passages[i]])[0][:cfg.max_knowledge_tokens]
        wiki = prompt + [model.token_id(source_token("wiki"))] + know + tail
        target = answer_ids(tok, [answers[i]])[0]
        want = score(model.decoder, [own, wiki], [target, target], batch_size=2).total
        np.testing.assert_allclose(ll[i], want, atol=1e-3)
    assert len(knowledge_ids(tok, [passages[0]])[0]) > cfg.max_knowledge_tokens


def test_inference_layout_routes_and_answers_alike(model, datastore):
    """The model as inference loads it (`for_inference`) routes, verbalizes and answers as the
    stacked model does: the same sources, knowledge and answers, p_M to float tolerance."""
    policy = srrag_policy(datastore, tau=0.0)
    want = route(model, QUESTIONS, policy, retrieve, CFG)
    got = route(for_inference(model), QUESTIONS, policy, retrieve, CFG)
    assert [(r.source, r.knowledge, r.answer) for r in got] == [(r.source, r.knowledge, r.answer) for r in want]
    np.testing.assert_allclose([r.p_model for r in got], [r.p_model for r in want], atol=1e-5)


def test_every_row_stops_at_its_stop_token(model):
    """Make row 2's greedy first answer token the EOS: that row's answer ends there, empty, while
    the other rows are unaffected (a stop list that only reached row 0 let rows 1.. run on)."""
    tok = model.tokenizer
    before = route(model, QUESTIONS, always("wiki"), retrieve, CFG)
    row2 = (prompt_ids(tok, [QUESTIONS[2]])[0] + [model.token_id(source_token("wiki"))]
            + knowledge_ids(tok, retrieve(QUESTIONS[2:3]))[0] + answer_prefix_ids(tok))
    first = generate(model.decoder, [row2], 1)[0][0]
    stopping = copy.deepcopy(tok)
    # The fixture's decoder vocabulary is larger than its tokenizer's: name ids up to `first`.
    stopping.add_tokens([f"<unused{i}>" for i in range(len(stopping), first + 1)])
    stopping.eos_token = stopping.convert_ids_to_tokens(first)
    assert stopping.eos_token_id == first
    after = route(dataclasses.replace(model, tokenizer=stopping), QUESTIONS, always("wiki"), retrieve, CFG)
    assert before[2].answer and after[2].answer == ""
    for i in (0, 1, 3):
        if first not in tok(before[i].answer, add_special_tokens=False)["input_ids"]:
            assert after[i].answer == before[i].answer


def test_verbalization_ends_at_eos(model):
    """Make a Self row's greedy first verbalized token the EOS: its knowledge is empty, it is not
    truncated, and its answer follows `q<EOQ><Self></s><EOK> Answer:` (<EOK> appended, since the
    row did not write it), greedy, as `generate` computes it directly."""
    tok = model.tokenizer
    row = prompt_ids(tok, [QUESTIONS[1]])[0] + [model.token_id(source_token("self"))]
    first = generate(model.decoder, [row], 1)[0][0]
    stopping = copy.deepcopy(tok)
    stopping.add_tokens([f"<unused{i}>" for i in range(len(stopping), first + 1)])
    stopping.eos_token = stopping.convert_ids_to_tokens(first)
    out = route(dataclasses.replace(model, tokenizer=stopping), QUESTIONS[1:2], always("self"), retrieve, CFG)[0]
    assert out.knowledge == "" and not out.knowledge_truncated
    expected = generate(model.decoder, [row + [first] + answer_prefix_ids(tok)], CFG.max_answer_tokens,
                        stop_ids=[first])[0]
    assert out.answer == stopping.decode([t for t in expected if t != first], skip_special_tokens=True).strip()


def test_crossing_tau_switches_route(model):
    q = [QUESTIONS[0]]
    always_wiki = lambda hidden: np.zeros((len(hidden), 4), int)  # noqa: E731  all neighbours say wiki
    score = route(model, q, srrag_policy(always_wiki, tau=0.0), retrieve, CFG)[0].score
    assert 0 < score <= 1
    assert route(model, q, srrag_policy(always_wiki, tau=score - 1e-4), retrieve, CFG)[0].source == "wiki"
    assert route(model, q, srrag_policy(always_wiki, tau=score + 1e-4), retrieve, CFG)[0].source == "self"


def test_long_knowledge_is_truncated_not_the_question(model):
    long = lambda qs: [["word " * 400] for _ in qs]  # noqa: E731
    out = route(model, QUESTIONS[:2], always("wiki"), long, CFG)
    assert all(r.knowledge_truncated and r.source == "wiki" for r in out)
    assert [r.question for r in out] == QUESTIONS[:2]


def test_policy_math():
    labels = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    np.testing.assert_allclose(policy_distribution(labels, 2), [[0.4, 0.6], [0.0, 1.0]])
    p_m = np.array([[0.5, 0.5], [0.9, 0.1]])
    src, score = choose_source(p_m, policy_distribution(labels, 2), ("wiki", "self"), tau=0.1)
    np.testing.assert_allclose(score, [0.2, 0.0])
    assert src.tolist() == [0, 1]


def test_bad_requests(model):
    with pytest.raises(JaxragError, match="empty batch"):
        route(model, [], always("wiki"), retrieve, CFG)
    with pytest.raises(JaxragError, match="unknown source 'web'"):
        route(model, QUESTIONS[:1], always("web"), retrieve, CFG)
    with pytest.raises(JaxragError, match="every Wiki row needs passages"):
        route(model, QUESTIONS[:1], always("wiki"), lambda qs: [[]], CFG)


def test_eval_paths_retrieve_each_question_once(model):
    """The harness's RetrievalCache retrieves each distinct question once; routed paths read it
    (no more calls) and charge each Wiki row the cached time as T_r."""
    from jaxrag.data.schema import QAExample
    from jaxrag.eval.harness import RetrievalCache, routed_paths

    calls = []

    def counting(questions):
        calls.append(list(questions))
        return retrieve(questions)

    cache = RetrievalCache(counting, QUESTIONS + QUESTIONS[:2], batch_size=3)
    assert sorted(sum(calls, [])) == sorted(QUESTIONS) and len(calls) == 2
    assert cache(QUESTIONS[::-1]) == retrieve(QUESTIONS[::-1])
    assert all(cache.seconds[q] > 0 for q in QUESTIONS)
    cache.seconds.update({q: 10.0 + i for i, q in enumerate(QUESTIONS)})  # unmistakable
    items = [("popqa", QAExample(f"q{i}", q, ("fox",))) for i, q in enumerate(QUESTIONS)]
    paths = routed_paths(model, items, cache, CFG, batch_size=4)
    assert len(calls) == 2
    # One batch of 4: each row pays its own cached T_r plus an equal share of the batch's phases
    # (so no wall-clock bound is needed); the Self path charges no T_r at all.
    shared = np.asarray(paths.latency["wiki"]) - (10.0 + np.arange(len(QUESTIONS)))
    assert np.all(shared > 0) and np.allclose(shared, shared[0])
    own = np.asarray(paths.latency["self"])
    assert np.allclose(own, own[0]) and own[0] < 10.0
    for i, q in enumerate(QUESTIONS):
        direct = route(model, [q], always("wiki"), retrieve, CFG)[0]
        assert paths.answers["wiki"][i] == direct.answer
