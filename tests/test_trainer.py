"""Featurizer validation, end-to-end stage 1 / stage 2 runs, NaN stop, kill -9 and resume."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from train_fixtures import stopped_after, tiny_model, toy_record, toy_records, train_config

from jaxrag.errors import JaxragError
from jaxrag.models.tokens import EOK
from jaxrag.prompts import prompt_text
from jaxrag.train import stages
from jaxrag.train.batches import RecordData, as_records, read_records

REPO = Path(__file__).resolve().parents[1]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Self routing lets a model verbalize what it knows.",
         "Retrieval augmented generation reads passages from Wikipedia before answering."] * 6


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def params_of(model):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model.decoder)))


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def broken(change):
    record = toy_record(1, "self")
    change(record)
    return record


@pytest.mark.parametrize("record, message", [
    (broken(lambda r: r.pop("question")), "field 'question': missing"),
    (broken(lambda r: r.update(label="web")), "field 'label': unknown source 'web'"),
    (broken(lambda r: r["contexts"][0].update(source="bing")), "contexts[0]: field 'source': unknown source 'bing'"),
    (broken(lambda r: r["best"].update(self=4)), "field 'best': 'self' -> 4 is not the index of a 'self' context"),
    (broken(lambda r: r.update(golden_answers=[])), "'golden_answers'[0] must be non-empty"),
    ("{not json", "invalid JSON"),
])
def test_bad_record_names_file_and_line(tmp_path, model, record, message):
    path = write_jsonl(tmp_path / "train.jsonl", [toy_record(0, "wiki"), record])
    with pytest.raises(JaxragError) as e:
        read_records(path, model.sources)
    assert f"{path}:2" in str(e.value) and message in str(e.value)
    if isinstance(record, dict) and "id" in record:
        assert "record 'q1'" in str(e.value)


def test_empty_dataset_and_unfittable_records(tmp_path, model):
    with pytest.raises(JaxragError, match="no training records"):
        read_records(write_jsonl(tmp_path / "empty.jsonl", []), model.sources)
    path = write_jsonl(tmp_path / "long.jsonl", [toy_record(0, "wiki"), toy_record(1, "self")])
    with pytest.raises(JaxragError, match=f"{path}:1 .*question and answer alone take .* > max_length 12"):
        RecordData(read_records(path, model.sources), model.tokenizer, 12, 2.0, seed=0)
    no_worst = broken(lambda r: r["worst"].pop("self"))
    with pytest.raises(JaxragError, match=r"records\[0\] \(record 'q1'\): field 'worst'"):
        RecordData(as_records([no_worst], model.sources), model.tokenizer, 40, 2.0, seed=0, pairs=True)


def test_knowledge_is_truncated_never_the_answer(model):
    tok = model.tokenizer
    data = RecordData(as_records(toy_records(6), model.sources), tok, 30, 2.0, seed=0, pairs=True)
    rows = data.rows(np.arange(6), 0)
    eos, eok = tok.eos_token_id, tok.convert_tokens_to_ids(EOK)
    for b in range(6):
        n = rows["mask"][b].sum()
        ans = rows["ids"][b][rows["ans"][b] > 0]
        assert tok.decode(ans[:-1]).strip() == "Hawthorne" and ans[-1] == eos and rows["ans"][b][n - 1] == 1
        assert rows["src"][b].sum() == 1
        verb = rows["ids"][b][rows["verb"][b] > 0]
        if b % 3 == 0:  # Self: c_i+ (possibly cut) and the <EOK> that ends it
            assert verb[-1] == eok and rows["dpo"][b] == 1
        else:
            assert len(verb) == 0 and rows["dpo"][b] == 0
    assert rows["truncated"].sum() >= 1  # max_length 30 cuts some knowledge...
    wide = RecordData(as_records(toy_records(6), model.sources), tok, 200, 2.0, seed=0).rows(np.arange(6), 0)
    assert wide["truncated"].sum() == 0  # ...which fits at 200


def test_extra_wiki_passages_are_poisson_and_seeded(model):
    record = toy_record(1, "wiki")
    record["contexts"] += [{"source": "wiki", "text": f"passage {j}", "loglik": -5.0} for j in range(30)]
    data = RecordData(as_records([record] * 400, model.sources), model.tokenizer, 200, 2.0, seed=0)
    counts = [len(data.passages(i, 0)) - 1 for i in range(400)]
    assert abs(np.mean(counts) - 2.0) < 0.25 and abs(np.var(counts) - 2.0) < 0.5  # Poisson(2)
    assert all(data.passages(i, 0)[0] == record["contexts"][record["best"]["wiki"]]["text"] for i in range(20))
    assert [data.passages(i, 0) for i in range(20)] == [data.passages(i, 0) for i in range(20)]
    assert [data.passages(i, 0) for i in range(20)] != [data.passages(i, 1) for i in range(20)]


def test_chat_template_wraps_the_question(model):
    tok = model.tokenizer
    assert prompt_text(tok, "who?") == "Question: who? Background knowledge:"
    tok.chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}</s>{% endfor %}<|assistant|>"
    try:
        assert prompt_text(tok, "who?") == "<|user|>Question: who?</s><|assistant|>Background knowledge:"
    finally:
        tok.chat_template = None


def read_metrics(workdir):
    return [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def test_stage1_then_stage2(tmp_path, model, capsys):
    records = write_jsonl(tmp_path / "train.jsonl", toy_records(10))
    cfg = train_config()
    s1 = stages.train_stage1(model, records, cfg, tmp_path / "s1")  # 3 steps of 4 (last one padded)
    log = read_metrics(tmp_path / "s1")
    assert [r["step"] for r in log] == [1, 2, 3]
    for key in ("loss", "src", "verb", "ans", "lr", "grad_norm", "tokens_per_s"):
        assert all(math.isfinite(r[key]) for r in log), key
    assert all(abs(r["loss"] - (r["src"] + r["verb"] + r["ans"])) < 1e-3 * r["loss"] for r in log)
    assert any((tmp_path / "s1" / "tensorboard").glob("events.out.tfevents.*"))
    out = capsys.readouterr()
    assert f"knowledge truncated in {log[-1]['truncated_total']} of 10 training sequences" in out.out + out.err
    before, after = params_of(model), params_of(s1)
    assert not np.allclose(before["embed"], after["embed"])
    # A finished training keeps its final model and removes its checkpoints (params + optimizer
    # state); a run killed between the two leaves them, and its rerun just loads and removes them.
    assert (tmp_path / "s1" / stages.FINAL).is_dir() and not (tmp_path / "s1" / "checkpoints").exists()
    (tmp_path / "s1" / "checkpoints" / "3").mkdir(parents=True)
    again = stages.train_stage1(model, records, cfg, tmp_path / "s1")  # finished workdir: just loads
    np.testing.assert_array_equal(params_of(again)["embed"], after["embed"])
    assert not (tmp_path / "s1" / "checkpoints").exists()

    s2 = stages.train_stage2(s1, s1, records, cfg, tmp_path / "s2")
    ref = np.load(tmp_path / "s2" / "ref_logprobs.npy")
    is_self = np.arange(10) % 3 == 0
    assert (ref[is_self] < 0).all() and (ref[~is_self] == 0).all()
    first = read_metrics(tmp_path / "s2")[0]
    order = RecordData(as_records(toy_records(10), model.sources), model.tokenizer, 40, 2.0, seed=0).order(0, 4)
    n_self = sum(1 for i in order[0] if i >= 0 and i % 3 == 0)
    # Step 1: policy = reference, so each Self pair contributes exactly log 2 (Eq. 6).
    np.testing.assert_allclose(first["verb_dpo"], n_self * math.log(2) / 4, rtol=1e-5)
    assert not np.allclose(params_of(s2)["embed"], after["embed"])


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, model):
    cfg = train_config(pretrain=dict(lr=1e30, checkpoint_every=1, warmup_ratio=0.0))
    with pytest.raises(JaxragError, match=r"at step \d+: training stopped. The last good checkpoint is step \d+"):
        stages.train_lm(model, TEXTS, cfg, tmp_path)
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and not (tmp_path / "model").exists()
    last = read_metrics(tmp_path)[-1]
    assert last["step"] == steps[-1] + 1 and not math.isfinite(float(last["loss"]))


def test_the_last_step_is_not_checkpointed_and_a_run_stopped_after_it_redoes_it(tmp_path, model):
    """The last step's state becomes the stage's model, never a checkpoint (3x its bytes, removed
    right after): a run stopped after that step, before its model is saved, resumes from the
    latest checkpoint and redoes the steps after it, to the uninterrupted run's weights."""
    cfg = train_config(pretrain=dict(steps=5, checkpoint_every=2))
    straight = stages.train_lm(model, TEXTS, cfg, tmp_path / "straight")
    with stopped_after(5):
        stages.train_lm(model, TEXTS, cfg, tmp_path / "run")
    assert sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
    assert not (tmp_path / "run" / stages.FINAL).exists()
    resumed = stages.train_lm(model, TEXTS, cfg, tmp_path / "run")
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5]
    assert not (tmp_path / "run" / "checkpoints").exists()
    jax.tree.map(np.testing.assert_array_equal, params_of(resumed), params_of(straight))


SCRIPT = """
import sys, time
from jaxrag.train import batches, stages
from train_fixtures import tiny_model, train_config
from test_trainer import TEXTS
rows = batches.TextData.rows
batches.TextData.rows = lambda self, *a: (time.sleep(0.3), rows(self, *a))[1]  # time to kill it
stages.train_lm(tiny_model(), TEXTS, train_config(pretrain=dict(steps=16, checkpoint_every=3)), sys.argv[1])
"""


def test_kill_9_then_rerun_resumes_to_the_same_parameters(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    command = [sys.executable, "-c", SCRIPT, str(tmp_path / "run")]
    proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not (tmp_path / "run" / "checkpoints" / "3").is_dir():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline, "no checkpoint within 120 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "run" / "model").exists()  # killed mid-training
    rerun = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == list(range(1, 17))
    assert not (tmp_path / "run" / "checkpoints").exists()

    cfg = train_config(pretrain=dict(steps=16, checkpoint_every=3))
    straight = stages.train_lm(tiny_model(), TEXTS, cfg, tmp_path / "straight")
    resumed = stages.load_model(tmp_path / "run" / "model")
    jax.tree.map(np.testing.assert_array_equal, params_of(resumed), params_of(straight))
    log = read_metrics(tmp_path / "straight")
    assert log[-1]["loss"] < log[0]["loss"]


def test_token_rows_step_token_lr_scale_times_as_far():
    """One AdamW step: the SR-RAG tokens' rows (embed rows, lm_head columns; under LoRA the whole
    token_rows tree) move token_lr_scale times as far as at scale 1, everything else the same."""
    from jaxrag.train.trainer import TrainSpec, make_optimizer

    rng = np.random.default_rng(0)
    full = {"embed": rng.normal(size=(6, 4)), "lm_head": rng.normal(size=(4, 6)), "w": rng.normal(size=(4, 4))}
    lora = {"q_lora_a": rng.normal(size=(4, 2)), "token_rows": {"embed": rng.normal(size=(2, 4))}}
    for params in (full, lora):
        params = jax.tree.map(lambda x: jax.numpy.asarray(x, "float32"), params)
        grads = jax.tree.map(lambda x: x * 0.1 + 0.05, params)

        def step(scale):
            spec = TrainSpec("stage1", 4, 1e-2, 10, token_lr_scale=scale, token_ids=(4, 5))
            tx = make_optimizer(spec)
            return tx.update(grads, tx.init(params), params)[0]
        base, fast = step(1.0), step(7.0)
        want = jax.tree.map(np.array, base)
        if "embed" in want:
            want["embed"][4:] *= 7.0
            want["lm_head"][:, 4:] *= 7.0
        else:
            want["token_rows"]["embed"] *= 7.0
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), fast, want)
    with pytest.raises(JaxragError, match="stage1.token_lr_scale=0"):
        TrainSpec.from_section("stage1", {"batch_size": 4, "lr": 1e-3, "token_lr_scale": 0}, 10, 0)
