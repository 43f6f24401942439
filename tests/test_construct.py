"""Data construction (Algorithm 1): labels and best/worst contexts equal an independent
computation, a kill -9 mid-stage loses and duplicates nothing, bad input is counted."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from train_fixtures import SELF_TEXTS, WIKI_TEXTS, random_params

from jaxrag.data import construct as C
from jaxrag.data import construct_genread as G
from jaxrag.data.schema import QAExample
from jaxrag.decode.sampler import SamplingParams
from jaxrag.errors import JaxragError
from jaxrag.models.hf import decoder_config
from jaxrag.models.model import Model, add_special_tokens
from jaxrag.models.params import build_decoder, host_params
from jaxrag.prompts import GENREAD_AMBIGUOUS, GENREAD_PROMPT, answer_ids, base_prompt_ids, base_prompt_text

TESTS = Path(__file__).resolve().parent
pytestmark = pytest.mark.filterwarnings("ignore:construct. problems counted")  # expected on a random model
SECTION = dict(n_contexts=2, verbalize_max_tokens=6, kmeans_clusters=2, demos_per_cluster=1, label_rule="sum",
               verbalize_temperature=0.7, verbalize_top_p=0.9, max_prompt_tokens=512, shard_size=2,
               generate_batch_size=8, score_batch_size=16)
NQ = "who wrote the famous novel number {} that was written in the year 1850?"
OBQA = "what reads the passages from Wikipedia before answering, case {}?"
EXAMPLES = ([("nq", QAExample(f"n{i}", NQ.format(i), ("Hawthorne",))) for i in range(4)]
            + [("asqa", QAExample(f"a{i}", f"where is the quick brown fox number {i}?", ("under the tree",)))
               for i in range(2)]
            + [("obqa", QAExample(f"o{i}", OBQA.format(i), ("Retrieval",), ("Retrieval", "a lazy dog")))
               for i in range(2)])
CORPUS = [f"{t}, and {v}." for t, v in zip(WIKI_TEXTS, SELF_TEXTS * 2)]
_MODEL = {}


def model() -> Model:
    """A random Qwen2-style decoder (hidden 32, 2 layers) on a byte-level BPE that knows the
    GenRead and base prompts, so prompts stay short (few compiled shapes, fast tests)."""
    if "m" not in _MODEL:
        words = [GENREAD_PROMPT + GENREAD_AMBIGUOUS, "Background knowledge: Answer:",  # a few tokens each
                 *" ".join([*CORPUS, *(f"{e.prompt_question()} {e.golden_answers[0]}" for _, e in EXAMPLES)]).split()]
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)  # merges span words
        bpe.decoder = decoders.ByteLevel()
        bpe.train_from_iterator(words * 8, trainers.BpeTrainer(
            vocab_size=600, special_tokens=["<unk>", "<pad>", "</s>"], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="</s>",
                                                   clean_up_tokenization_spaces=False)
        hf = transformers.Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        cfg = decoder_config(hf)
        _MODEL["m"] = add_special_tokens(Model(build_decoder(cfg, random_params(cfg, 0)), tok, hf))
    return _MODEL["m"]


def retrieve(questions, k):
    """Toy corpus ranked by word overlap (ties by corpus order)."""
    def overlap(q, p):
        return len(set(q.lower().split()) & set(p.lower().split()))
    return [sorted(CORPUS, key=lambda p: (-overlap(q, p), CORPUS.index(p)))[:k] for q in questions]


class HashEncoder:
    """Bag of hashed words -> unit vectors [n, 16]: deterministic and fast."""

    def encode(self, texts):
        out = np.zeros((len(texts), 16), np.float32)
        for i, t in enumerate(texts):
            for w in t.lower().split():
                out[i, zlib.crc32(w.encode()) % 16] += 1
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


def run_construct(out_dir, slow: float = 0.0, **kw):
    """The reference run (also run in a subprocess by the kill test); `slow` s per retrieval
    call leaves time to kill it between shards."""
    def slow_retrieve(questions, k):
        time.sleep(slow)
        return retrieve(questions, k)
    return C.construct(model(), EXAMPLES, slow_retrieve, HashEncoder(), SECTION, out_dir, rng_seed=0,
                       progress=False, **kw)


def records_of(out_dir):
    return [json.loads(line) for p in sorted(Path(out_dir).glob("shard-*.jsonl"))
            for line in p.read_text().splitlines()]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = run_construct(tmp_path_factory.mktemp("construct") / "out")
    return out, records_of(out)


def direct_logliks(m: Model, question: str, answer: str, contexts: list[str]) -> np.ndarray:
    """log p(a | q, c) for c in [no context, *contexts] from one full forward pass (right-padded
    rows, numpy log-softmax): independent of the KV cache, bucketing and `scoring.score`."""
    tok = m.tokenizer
    prefixes = base_prompt_ids(tok, [base_prompt_text(question)] + [base_prompt_text(question, [c]) for c in contexts])
    target = answer_ids(tok, [answer])[0]
    rows = [p + target for p in prefixes]
    length = 256
    ids = np.zeros((len(rows), length), np.int32)
    mask = np.zeros((len(rows), length), bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, True
    logits = np.asarray(m.logits(ids, mask), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return np.array([sum(logp[i, t - 1, r[t]] for t in range(len(r) - len(target), len(r)))
                     for i, r in enumerate(rows)])


def test_labels_and_best_worst_equal_a_direct_computation(built):
    out, records = built
    m = model()
    assert sorted((r["dataset"], r["id"]) for r in records) == sorted((d, e.id) for d, e in EXAMPLES)
    margins, pools = [], json.loads((out / "round1" / "pools.json").read_text())
    assert {d: len(set(p["clusters"])) for d, p in pools.items()} == {"asqa": 2, "nq": 2, "obqa": 2}
    for r in records:
        texts = [c["text"] for c in r["contexts"]]
        assert all(texts)  # every context is a document
        direct = direct_logliks(m, r["question"], r["golden_answers"][0], texts)
        np.testing.assert_allclose([r["no_context_loglik"]] + [c["loglik"] for c in r["contexts"]], direct, atol=2e-4)
        l0, ll = direct[0], direct[1:]
        src = np.array([c["source"] for c in r["contexts"]])
        assert list(src) == ["self"] * 2 + ["wiki"] * 2  # self first, n = 2 each
        p_self, p_wiki = np.exp(ll[src == "self"]).sum(), np.exp(ll[src == "wiki"]).sum()  # Algorithm 1 line 11
        margins.append(abs(math.log(p_self) - math.log(p_wiki)))
        assert r["label"] == ("self" if p_self > p_wiki else "wiki")
        for s in ("self", "wiki"):
            idx = np.flatnonzero(src == s)
            assert r["best"][s] == idx[np.argmax(ll[idx])] and r["worst"][s] == idx[np.argmin(ll[idx])]
        no_kv = "wiki" if p_wiki >= 2 * math.exp(l0) else "self"  # verbalizations replaced by no context
        assert r["no_kv_label"] == no_kv and r["selective_label"] == {"wiki": "wiki", "self": "none"}[no_kv]
        pool = pools[r["dataset"]]  # verbalization j: one demonstration from cluster j mod K, never itself
        for j, c in enumerate(r["contexts"][:2]):
            cluster = j % len(set(pool["clusters"]))
            others = [q for q, k in zip(pool["ids"], pool["clusters"]) if k == cluster and q != r["id"]]
            assert c["cluster"] == cluster and c["demos"] == min(1, len(others))
    assert min(margins) > 1e-3  # labels are not decided by float noise
    # which labels a random toy model produces depends on its sampled verbalizations; both
    # branches of the rule are pinned on hand-made likelihoods below
    assert {r["label"] for r in records} <= {"self", "wiki"}
    loaded = C.read_construct(out, m.sources)  # the trainer's reader accepts every record
    assert [t.id for t in loaded] == [r["id"] for r in records]
    stats = json.loads((out / "stats.json").read_text())
    assert stats["all"]["n"] == len(EXAMPLES)
    nq_self = sum(r["label"] == "self" for r in records if r["dataset"] == "nq")
    assert stats["datasets"]["nq"]["self_pct"] == 100 * nq_self / 4
    assert "| nq | 4 |" in C.stats_markdown(stats)


def test_label_rules_on_hand_made_likelihoods():
    # Sum of probabilities, not of log-likelihoods: one near-certain verbalization beats two mediocre passages.
    assert C.label_source(["self", "self", "wiki", "wiki"], [-0.01, -8, -1.5, -1.5]) == "self"
    # Majority of the top-n can disagree with the sum.
    src, ll = ["self"] * 3 + ["wiki"] * 3, [-0.01, -5, -6, -0.9, -1.0, -7]
    assert C.label_source(src, ll, "sum", 3) == "self" and C.label_source(src, ll, "majority", 3) == "wiki"
    assert C.label_source(["self", "wiki"], [-1.0, -1.0]) == "wiki"  # ties go to retrieval
    assert C.label_source(["self", "self"], [-9.0, -9.0]) == "self"  # no passage retrieved
    assert C.no_context_label([-1.0, -3.0], -1.5, 2) == "self"  # 0.42 < 2 * 0.22
    assert C.no_context_label([-1.0, -3.0], -1.7, 2) == "wiki"
    assert C.best_worst(["self", "wiki", "self", "wiki"], [-2, -1, -3, -1]) == ({"self": 0, "wiki": 1},
                                                                                 {"self": 2, "wiki": 1})
    with pytest.raises(JaxragError, match="label_rule"):
        C.ConstructParams.from_config({**SECTION, "label_rule": "max"})
    with pytest.raises(JaxragError, match="unknown field 'n_context'"):
        C.ConstructParams.from_config({"n_context": 5})


def test_kill_9_mid_stage_then_rerun_loses_and_duplicates_nothing(built, tmp_path):
    out = tmp_path / "out"
    code = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_construct as t; "
            "t.run_construct(sys.argv[1], slow=3.0)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        deadline = time.monotonic() + 120
        while not (out / "shard-00000.jsonl").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "construct subprocess ended or stalled"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "shard-00003.jsonl").exists() and not (out / "stats.json").exists()  # really mid-stage
    run_construct(out)  # the rerun resumes
    rerun, reference = records_of(out), built[1]
    assert len(rerun) == len({(r["dataset"], r["id"]) for r in rerun}) == len(EXAMPLES)
    assert [(r["id"], r["label"], [c["text"] for c in r["contexts"]]) for r in rerun] == \
           [(r["id"], r["label"], [c["text"] for c in r["contexts"]]) for r in reference]
    assert not list(out.glob(".*.tmp"))


def test_hosts_take_their_own_shards_and_a_changed_setup_is_refused(built, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(built[0], out)
    for k in (1, 3):
        (out / f"shard-{k:05d}.jsonl").unlink()
    (out / "stats.json").unlink()
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.jsonl")}
    run_construct(out, process_index=1, process_count=2)  # builds shards 1 and 3, writes no stats
    assert sorted(p.name for p in out.glob("shard-*.jsonl")) == [f"shard-{k:05d}.jsonl" for k in range(4)]
    assert {n: (out / n).stat().st_mtime_ns for n in before} == before and not (out / "stats.json").exists()
    run_construct(out, process_index=0, process_count=2)  # nothing left to build: process 0 reports
    assert records_of(out) == built[1] and C.construct_done(out)
    with pytest.raises(JaxragError, match="other inputs or settings"):
        C.construct(model(), EXAMPLES[:3], retrieve, HashEncoder(), SECTION, out, progress=False)


def test_two_processes_split_round_1_and_the_shards(built, tmp_path, monkeypatch):
    """Process 0 and 1 of 2 side by side (threads, each with its own copy of the model): round 1
    is split and joined by process 0's k-means pools, the shards are split, process 0 reports."""
    monkeypatch.setattr(G, "POLL_S", 0.05)
    out, errors = tmp_path / "out", []

    def host(index, m):
        try:
            C.construct(m, EXAMPLES, retrieve, HashEncoder(), SECTION, out, process_index=index, process_count=2,
                        progress=False, wait_timeout_s=120)
        except BaseException as e:  # noqa: BLE001  reported below
            errors.append(e)

    copy = Model(build_decoder(model().config, jax.tree.map(np.array, host_params(model().decoder))), model().tokenizer,
                 model().hf_config, model().sources)
    threads = [threading.Thread(target=host, args=(i, m)) for i, m in ((1, copy), (0, model()))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert records_of(out) == built[1] and C.construct_done(out)


def eos_model(m: Model, weight: float = 50.0) -> Model:
    """The tiny model made to emit EOS first: embedding dim 0 is a large constant, and the EOS
    column of lm_head reads it with `weight` (50: always; 0.5: greedy always, sampling rarely)."""
    params = jax.tree.map(np.array, host_params(m.decoder))
    params["embed"][:, 0] = 10.0
    params["lm_head"][0, m.tokenizer.eos_token_id] = weight
    return Model(build_decoder(m.config, params), m.tokenizer, m.hf_config, m.sources)


def test_bad_input_is_counted_in_stats(tmp_path):
    examples = [*EXAMPLES[:3], ("nq", QAExample("blank", "who is lazy?", ("  ",))),
                ("nq", QAExample("none", "who is lazy now?", ("a lazy dog",)))]

    def patchy(questions, k):  # nothing for one question, an empty and a single passage for another
        return [[] if q.endswith("now?") else ["", CORPUS[0]] if "number 0 " in q else r
                for q, r in zip(questions, retrieve(questions, k))]

    with pytest.warns(UserWarning, match="skipping 1 questions without a golden answer"):
        out = C.construct(model(), examples, patchy, HashEncoder(), SECTION, tmp_path / "a", progress=False)
    records, stats = records_of(out), json.loads((out / "stats.json").read_text())
    nq = stats["datasets"]["nq"]
    assert nq["n"] == 4 and nq["skipped_no_answer"] == 1 and "blank" not in {r["id"] for r in records}
    assert (nq["no_wiki"], nq["short_retrieval"], nq["empty_passages"]) == (1, 2, 1)
    empty = next(r for r in records if r["id"] == "none")
    assert empty["label"] == "self" and "wiki" not in empty["best"] and empty["selective_label"] == "none"
    assert empty["source_loglik"]["wiki"] is None
    flags = [c["truncated"] for r in records for c in r["contexts"] if c["source"] == "self"]
    assert stats["all"]["truncated_verbalizations"] == sum(flags) > 0  # 6 tokens rarely reach EOS
    C.read_construct(out, model().sources)
    # A model that always stops at once: every verbalization stays empty after the redraws, so
    # none is a context; the questions are labelled from their passages alone.
    out = C.construct(eos_model(model()), EXAMPLES[:3], retrieve, HashEncoder(), SECTION, tmp_path / "b",
                      progress=False)
    stats = json.loads((out / "stats.json").read_text())
    assert (stats["all"]["empty_verbalizations"], stats["all"]["verbalizations"]) == (6, 0)
    assert stats["all"]["round1_empty"] == 3 and stats["all"]["no_context"] == 0
    records = records_of(out)
    assert len(records) == 3 and all(r["label"] == "wiki" and "self" not in r["best"] for r in records)
    assert all(c["source"] == "wiki" and c["text"] for r in records for c in r["contexts"])
    assert "| 0 / 0 | 6 |" in C.stats_markdown(stats) and "fewer than n verbalizations" in C.stats_markdown(stats)
    C.read_construct(out, model().sources)


def test_an_empty_genread_document_is_drawn_again(tmp_path):
    """Greedy decoding of this model starts with EOS on every prompt; the redraws sample, and
    construct's records hold non-empty contexts only (round 1 is greedy too)."""
    m = eos_model(model(), weight=0.5)
    prompts = [G.genread_prompt(m.tokenizer, e.prompt_question(), False, [])[0] for _, e in EXAMPLES]
    greedy = dict(sampling=SamplingParams(), rng=jax.random.key(0), batch_size=8)
    assert all(not v.text for v in G.verbalize(m, prompts, 6, redraws=0, **greedy))
    again = G.verbalize(m, prompts, 6, redraw=SamplingParams(temperature=0.7, top_p=0.9), **greedy)
    assert all(v.text for v in again)
    assert again == G.verbalize(m, prompts, 6, redraw=SamplingParams(temperature=0.7, top_p=0.9), **greedy)
    out = C.construct(m, EXAMPLES, retrieve, HashEncoder(), SECTION, tmp_path / "c", progress=False)
    records, stats = records_of(out), json.loads((out / "stats.json").read_text())["all"]
    assert len(records) == len(EXAMPLES) and all(c["text"] for r in records for c in r["contexts"])
    assert stats["round1_empty"] == 0
    assert stats["empty_verbalizations"] == sum(r["problems"]["empty_verbalizations"] for r in records)
    assert stats["verbalizations"] + stats["empty_verbalizations"] == 2 * len(EXAMPLES)


def test_zero_shot_round_2_skips_round_1_and_counts_every_question(tmp_path, monkeypatch):
    """demos_per_cluster = 0 (the tiny config: a 3M-parameter model copies a demo's entity):
    round 2 prompts are GenRead's zero-shot ones; no round 1, no pools, no encoder. A question
    left with no context at all (every verbalization empty, nothing retrieved) still counts."""
    demos, real = [], C.genread_prompt

    def spy(tok, question, ambiguous, given, limit=0):
        demos.append(len(given))
        return real(tok, question, ambiguous, given, limit)

    class NoEncoder:
        def encode(self, texts):
            raise AssertionError("zero-shot round 2 clusters nothing")

    monkeypatch.setattr(C, "genread_prompt", spy)
    section = {**SECTION, "demos_per_cluster": 0}
    out = C.construct(model(), EXAMPLES, retrieve, NoEncoder(), section, tmp_path / "z", progress=False)
    assert not (out / "round1").exists() and demos == [0] * 2 * len(EXAMPLES)
    records = records_of(out)
    assert sorted(r["id"] for r in records) == sorted(e.id for _, e in EXAMPLES)
    assert all((c["demos"], c["cluster"]) == (0, -1) for r in records for c in r["contexts"] if c["source"] == "self")

    def nothing_for_one(questions, k):
        return [[] if "number 0 " in q else r for q, r in zip(questions, retrieve(questions, k))]

    out = C.construct(eos_model(model()), EXAMPLES, nothing_for_one, NoEncoder(), section, tmp_path / "e",
                      progress=False)
    nq = json.loads((out / "stats.json").read_text())["datasets"]["nq"]
    assert (nq["n"], nq["no_context"]) == (3, 1) and "n0" not in {r["id"] for r in records_of(out)}


def test_relabel_drops_records_with_no_context_of_the_new_label():
    """The ablations' relabelling (w/o kv label, Selective RAG) keeps a record only when the new
    label has a context to train on. Seen on a world seed: every verbalization of a FEVER-like
    question came out empty and the no-context likelihood labelled it <Self>; stage 1 of the
    w/o-kv-label ablation then refused the record ("no context for the label 'self'")."""
    from jaxrag.pipeline.baselines import relabel
    from jaxrag.train.batches import as_records

    wiki = {"source": "wiki", "text": "A passage.", "loglik": -0.5}
    verb = {"source": "self", "text": "A verbalization.", "loglik": -0.2}
    base = {"question": "q?", "golden_answers": ["a"], "label": "wiki", "selective_label": "wiki"}
    records = [
        {**base, "id": "no-verbalization", "no_kv_label": "self", "contexts": [wiki], "best": {"wiki": 0}, "worst": {"wiki": 0}},
        {**base, "id": "both", "no_kv_label": "self", "contexts": [verb, wiki], "best": {"self": 0, "wiki": 1},
         "worst": {"self": 0, "wiki": 1}},
        {**base, "id": "no-passage", "label": "self", "no_kv_label": "wiki", "selective_label": "wiki", "contexts": [verb],
         "best": {"self": 0}, "worst": {"self": 0}},
        {**base, "id": "selective-none", "selective_label": "none", "no_kv_label": "wiki", "contexts": [verb],
         "best": {"self": 0}, "worst": {"self": 0}},
    ]
    no_kv = relabel(records, "no_kv_label")
    assert [(r["id"], r["label"]) for r in no_kv] == [("both", "self")]
    selective = relabel(records, "selective_label")
    assert [(r["id"], r["label"]) for r in selective] == [("no-verbalization", "wiki"), ("both", "wiki"), ("selective-none", "none")]
    assert all(c["source"] == "wiki" for r in selective for c in r["contexts"])
    as_records(no_kv, ("wiki", "self"))  # what stage 1 reads: no error
    as_records(selective, ("wiki", "none"))


def test_a_question_too_long_to_train_on_is_dropped_and_counted(tmp_path):
    """Stage 1 never truncates the question or the answer: a pair longer than model.max_length is
    dropped at construct (counted in stats.json and the report), and the rest train as usual."""
    from jaxrag.train.batches import RecordData, read_records

    long_q = ("nq", QAExample("long", "who " + "really " * 60 + "wrote it?", ("Hawthorne",)))
    tok = model().tokenizer
    # The stage-1 sequence without knowledge, counted directly: prompt + <EOQ>, source, <EOK>, " Answer:", answer, EOS.
    prompt = tok(f"Question: {long_q[1].question} Background knowledge:")["input_ids"]
    need = len(prompt) + 1 + 1 + 1 + len(tok(" Answer:", add_special_tokens=False)["input_ids"]) \
        + len(tok(" Hawthorne", add_special_tokens=False)["input_ids"]) + 1
    short = max(C.training_lengths(tok, C.prepare_items(EXAMPLES[:3])[0]))
    assert short < 100 < need
    with pytest.warns(UserWarning, match="dropping 1 questions .* model.max_length=100"):
        out = C.construct(model(), [*EXAMPLES[:3], long_q], retrieve, HashEncoder(), SECTION, tmp_path / "a",
                          progress=False, max_length=100)
    stats = json.loads((out / "stats.json").read_text())
    assert stats["datasets"]["nq"]["too_long"] == 1 and stats["datasets"]["nq"]["n"] == 3
    assert "long" not in {r["id"] for r in records_of(out)}
    assert "| 0 / 1 / 0 |" in C.stats_markdown(stats)
    records = [r for p in sorted(out.glob("shard-*.jsonl")) for r in read_records(p, model().sources)]
    RecordData(records, tok, 100, 2.0, 0)  # stage 1's batching accepts every kept record
    assert need == C.training_lengths(tok, C.prepare_items([long_q])[0])[0]
    with pytest.raises(JaxragError, match="every question .* longer than model.max_length=8"):
        C.construct(model(), EXAMPLES[:3], retrieve, HashEncoder(), SECTION, tmp_path / "b", progress=False,
                    max_length=8)
