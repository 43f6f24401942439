"""`python -m jaxrag.train` on a miniature embedded world: every stage's artifact, results.json
in the shared schema (docs/method.md) with the twelve methods, the export loading in transformers with the
final model's logits, `stop_after`, and a rerun that skips finished stages."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from pipeline_fixtures import (REPO, file_digests, mini_config, mini_overrides, outputs, run_notebook,
                               single_process_env, statuses, without_timings)

import jaxrag
from jaxrag.errors import JaxragError
from jaxrag.pipeline import run as pipeline
from jaxrag.pipeline.config import tiny_config


@pytest.fixture(scope="module")
def workdir(quickstart):
    """The quickstart notebook's run (conftest.py); every test below checks what it left."""
    return quickstart[0]


def test_every_stage_leaves_its_artifact(workdir):
    assert (workdir / "world" / "corpus.jsonl").is_file()
    assert (workdir / "world" / "datasets" / "popqa" / "test.jsonl").is_file()
    probe = json.loads((workdir / "base" / "metrics.json").read_text())
    assert probe["n_popular"] == 3 and 0.0 <= probe["closed_book_popular"] <= 1.0
    assert 0.0 <= probe["claim_reading"] <= 1.0
    # The gates failed (a 3-step model), so the base was pretrained again from a new init.
    assert len(probe["reading_attempts"]) == len(probe["verbalization_attempts"]) == 2
    assert probe["reading_gate_passed"] is False and probe["verbalization_gate_passed"] is False
    kept = probe["kept_attempt"]
    assert probe["fresh_reading"] == probe["reading_attempts"][kept]
    assert probe["fresh_rule_verbalization"] == probe["verbalization_attempts"][kept]
    assert (workdir / "base_train" / "attempt1" / "model").is_dir()
    recall = json.loads((workdir / "index" / "retrieval_metrics.json").read_text())
    # every test set with a gold passage (a rule question's is absent when no passage states the
    # rule's truth: in a 10-question mini set that can be all of them)
    with_gold = [n for n in ("popqa", "triviaqa", "pubhealth", "arc_challenge")
                 if any(json.loads(line)["metadata"].get("gold_passage_id") for line in
                        (workdir / "world" / "datasets" / n / "test.jsonl").read_text().splitlines())]
    assert {"popqa", "triviaqa", "arc_challenge"} <= set(with_gold)
    assert set(recall) == {f"{name}@{k}" for name in with_gold for k in (2, 5)}
    assert all(recall[f"{name}@2"] <= recall[f"{name}@5"] for name in ("popqa", "arc_challenge"))
    assert all(0.0 <= v <= 1.0 for v in recall.values())
    assert not list(workdir.glob(".*tmp*")) and not (workdir / "index.building").exists()
    assert (workdir / "construct" / "stats.json").is_file()
    for model in ("stage1", "stage2", "baselines/selective", "baselines/no_kv_label"):
        assert (workdir / model / "model" / "jaxrag.json").is_file()
    assert jaxrag.load_model(workdir / "baselines" / "selective" / "model").sources == ("wiki", "none")
    assert (workdir / "report.md").is_file() and (workdir / "plots" / "latency_accuracy.png").is_file()


def test_results_follow_the_shared_schema(workdir):
    results = json.loads((workdir / "results.json").read_text())
    methods = {"no_ft_always_rag", "no_ft_genread", "selective_always_rag", "selective_rag", "srrag_always_rag",
               "srrag", "srrag_no_knn", "srrag_no_kv_label", "srrag_no_dpo", "ik", "seakr", "ccsk"}
    assert set(results["average"]) == methods
    assert set(results["datasets"]) == {"popqa", "triviaqa", "pubhealth", "arc_challenge"}
    for name, per in results["datasets"].items():
        assert set(per) == methods
        choice = {"no_choice_frac"} if name == "arc_challenge" else set()  # multiple choice only
        for m in per.values():
            assert set(m) == {"acc", "rag_frac", "latency_s"} | choice and 0 <= m["acc"] <= 1 and 0 <= m["rag_frac"] <= 1
            if choice:  # an answer that picks no option is wrong
                assert 0 <= m["no_choice_frac"] <= 1 - m["acc"] + 1e-9
    for m in methods:  # the average is the mean over datasets
        want = np.mean([results["datasets"][d][m]["acc"] for d in results["datasets"]])
        assert results["average"][m]["acc"] == pytest.approx(want)
    assert results["average"]["srrag_always_rag"]["rag_frac"] == 1.0
    assert results["average"]["no_ft_genread"]["rag_frac"] == 0.0
    assert {"acc_verb_ge_ret", "auroc_ret_gt_verb", "per_dataset"} <= set(results["source_selection"]["srrag"])
    # The paper's protocol: fixed thresholds from the config, intervals, measured latency.
    th = results["config"]["thresholds"]
    assert th["protocol"] == "paper" and th["srrag"] == mini_config().inference.tau
    assert th["selective_rag"] == mini_config().inference.selective_tau and th["ik_p_know"] == 0.5
    for m in methods:
        lo, hi = results["average"][m]["acc_ci95"]
        assert lo <= results["average"][m]["acc"] + 1e-9 and results["average"][m]["acc"] <= hi + 1e-9
    assert {"srrag - selective_rag", "srrag - srrag_always_rag", "srrag - srrag_no_knn", "srrag - srrag_no_dpo",
            "srrag - srrag_no_kv_label"} <= set(results["comparisons"])
    assert set(results["latency"]) == methods  # every method the same measurement, on the same questions
    assert {e["n"] for e in results["latency"].values()} == {4 * 10} and len(results["figure4"]) == 5
    assert all({"T_d", "T_v", "T_r", "T_g"} == set(e["phases"]) for e in results["latency"].values())
    training = results["config"]["training"]
    assert set(training) == {"srrag", "selective_rag", "srrag_no_kv_label", "srrag_no_dpo"}
    assert [(st["name"], st["objective"]) for st in training["selective_rag"]["stages"]] == [
        ("stage1", "stage1_loss"), ("stage2", "stage1_loss")]  # SR-RAG's second stage, on its own loss
    assert all(st["steps"] > 0 for t in training.values() for st in t["stages"])
    assert set(results["config"]["data_counts"]["popqa"]) == {"test"}  # validation from the mixture only


def test_export_is_the_final_model_in_transformers(workdir):
    base = jaxrag.load_model(workdir / "stage2" / "model")
    assert base.config.num_layers == 2 and base.config.hidden_size == 32 and base.sources == ("wiki", "self")
    hf = transformers.AutoModelForCausalLM.from_pretrained(workdir / "export")
    ids = base.tokenizer("Question: Which city is the birthplace of Kou? Answer:")["input_ids"]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(np.asarray(base.logits([ids])), want, atol=1e-4)


def test_every_saved_model_tokenizes_as_the_world_tokenizer(workdir):
    """Models reloaded from disk (base, stage 1, stage 2) read text as pretraining did, years in
    passages included: under transformers 5 AutoTokenizer would build a tiny qwen2's tokenizer as
    `Qwen2Tokenizer`, whose pre-tokenizer splits "1827" into digits (a reloaded model then read
    passages at ~0.1 where the pretrained one read 0.9)."""
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(workdir / "world" / "tokenizer" / "tokenizer.json"))
    corpus = [json.loads(line)["contents"] for line in (workdir / "world" / "corpus.jsonl").open()]
    passage = next(p for p in corpus if any(c.isdigit() for c in p))
    text = f"Question: Where was it? Background knowledge: {passage} Answer:"
    for model in ("base", "stage1/model", "stage2/model"):
        tokenizer = jaxrag.load_model(workdir / model).tokenizer
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == reference.encode(text).ids, model


def test_a_datastore_layer_beyond_the_model_is_refused_before_anything_is_written(workdir, tmp_path):
    """A real model's layer count is only known from its checkpoint: the datastore stage checks it."""
    from jaxrag.pipeline.datastore import build_policy_datastore

    cfg = mini_config()
    cfg.model.datastore_layer = 3
    with pytest.raises(JaxragError, match="model.datastore_layer=3: .* has 2 layers; choose 1-2"):
        build_policy_datastore(cfg, workdir / "stage2" / "model", [], tmp_path / "datastore")
    assert not (tmp_path / "datastore").exists()


def test_rerun_skips_finished_stages(workdir, capsys):
    pipeline.run(mini_config(), workdir)
    assert statuses(capsys.readouterr().out) == ["done"] * 10
    records = {p.stem: json.loads(p.read_text()) for p in (workdir / "inputs").glob("*.json")}
    assert set(records) == {"world", "base", "index", "construct", "stage1", "stage2", "datastore", "baselines",
                            "eval", "export"}
    assert records["stage1"]["inputs"]["stage1.lr"] == 3e-4 and "inference.tau" not in records["stage1"]["inputs"]


def test_a_changed_training_field_stops_before_anything(workdir):
    """`python -m jaxrag.train` on the finished workdir with another stage-1 lr: one line naming
    the stale stage and the field, exit 2, not one file touched."""
    before = file_digests(workdir)
    cmd = [sys.executable, "-m", "jaxrag.train", "--config", "configs/qwen.py:tiny", "--workdir", str(workdir),
           *(f"--config.{k}={v}" for k, v in mini_overrides().items()), "--config.stage1.lr=0.001"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert "stage1 was built from another config (stage1.lr 0.0003 → 0.001)" in proc.stderr
    assert "--config.pipeline.rerun_from=stage1" in proc.stderr and "[" not in proc.stdout
    assert file_digests(workdir) == before


def test_rerun_from_redoes_exactly_the_stages_from_there(workdir, tmp_path, capsys):
    w = tmp_path / "w"
    shutil.copytree(workdir, w)
    cfg = mini_config()
    cfg.pipeline.rerun_from = "export"
    before = file_digests(w)
    pipeline.run(cfg, w)
    assert statuses(capsys.readouterr().out) == ["done"] * 9 + ["running"]
    after = file_digests(w)
    # config.json is this run's config (rerun_from included)
    assert {k: v for k, v in after.items() if not k.startswith(("export", "inputs", "config.json"))} == \
           {k: v for k, v in before.items() if not k.startswith(("export", "inputs", "config.json"))}
    assert after["export/config.json"][1] != before["export/config.json"][1]  # rewritten
    cfg.pipeline.update(rerun_from="stage2", stop_after="stage2")
    pipeline.run(cfg, w)
    assert statuses(capsys.readouterr().out) == ["done"] * 5 + ["running"]
    rebuilt = file_digests(w)
    assert all(rebuilt[k] == v for k, v in before.items() if k.startswith(("base/", "stage1/", "construct/")))
    assert rebuilt["stage2/model/jaxrag.json"][1] != before["stage2/model/jaxrag.json"][1]
    # what was built from the old stage 2 is not trusted any more
    with pytest.raises(JaxragError, match=r"datastore was built from another config \(stage2 was rebuilt since\)"):
        pipeline.run(mini_config(), w)


def train_command(workdir: Path, *extra: str) -> list[str]:
    """`python -m jaxrag.train` on the miniature config (the quickstart's run, as a command)."""
    return [sys.executable, "-m", "jaxrag.train", "--config", "configs/qwen.py:tiny", "--workdir", str(workdir),
            *(f"--config.{k}={v}" for k, v in mini_overrides().items()), *extra]


def test_an_eval_only_change_redoes_eval_and_export_only(workdir, tmp_path):
    """inference.tau (a constant of the paper's protocol) changes the results and the served
    tau; every trained model and earlier artifact keeps its bytes. Run as the quickstart runs
    (its devices and XLA flags), so eval's programs are the quickstart's."""
    w = tmp_path / "w"
    shutil.copytree(workdir, w)
    earlier = ["world", "base", "index", "construct", "stage1", "stage2", "datastore", "baselines"]
    before = file_digests(w, earlier)
    old = mini_config().inference.tau
    cmd = train_command(w, "--config.inference.tau=0.5")
    proc = subprocess.run(cmd, cwd=REPO, env=single_process_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert statuses(proc.stdout) == ["done"] * 8 + ["running"] * 2
    assert f"eval: running (inputs changed: inference.tau {old} → 0.5)" in proc.stdout
    assert file_digests(w, earlier) == before
    results = json.loads((w / "results.json").read_text())
    assert results["config"]["inference"]["tau"] == 0.5 == results["config"]["thresholds"]["srrag"]
    from jaxrag.serve import SRRAG

    assert SRRAG.load(w / "export").tau == 0.5
    proc = subprocess.run(cmd, cwd=REPO, env=single_process_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert statuses(proc.stdout) == ["done"] * 10  # the same config again: nothing to do


def test_tau_is_chosen_on_validation_before_the_first_eval(workdir, tmp_path):
    """`python -m jaxrag.eval.tau` reads a workdir finished up to the baselines: its config from
    W/config.json (what the run was built with), the same curves as from an evaluated workdir;
    a workdir whose baselines are not finished is refused, naming the stage and the command."""
    from jaxrag.pipeline import tau

    want = json.loads(json.dumps(mini_config().to_dict(), default=str))
    assert json.loads((workdir / "config.json").read_text()) == want
    w = tmp_path / "w"
    shutil.copytree(workdir, w, ignore=shutil.ignore_patterns("results.json", "report.md", "plots", "export"))
    before = tau.main([str(w), "--json", str(tmp_path / "tau.json")])
    assert json.loads((tmp_path / "tau.json").read_text())["best"] == before["best"]
    (w / "config.json").unlink()  # a workdir from before config.json: the evaluated config
    shutil.copy(workdir / "results.json", w / "results.json")
    assert tau.main([str(w)])["curves"] == before["curves"]
    for rule, points in before["curves"].items():  # a higher threshold never retrieves more
        fracs = [p["rag_frac"] for p in points]
        assert fracs == sorted(fracs, reverse=True), rule
    shutil.rmtree(w / "baselines")
    with pytest.raises(JaxragError, match=r"stage baselines is not finished; .*stop_after=baselines"):
        tau.main([str(w)])


# The eval stage of a workdir, in a process of its own run as the quickstart's (its devices and
# XLA flags, so eval's programs are the quickstart's); "killed": interrupted while loading the
# no-DPO model. Prints the paths it decoded.
RESUMED_EVAL = """
import json, sys
from pathlib import Path
from pipeline_fixtures import mini_config
from jaxrag.eval import harness
from jaxrag.pipeline import eval as eval_stage
w, killed, decoded = Path(sys.argv[1]), sys.argv[2] == "killed", []
load, routed_paths, untuned_paths = eval_stage.load, harness.routed_paths, harness.untuned_paths
def killed_at_no_dpo(cfg, path, **kw):
    if "no_dpo" in str(path):
        raise KeyboardInterrupt
    return load(cfg, path, **kw)
eval_stage.load = killed_at_no_dpo if killed else load
harness.routed_paths = lambda *a, **kw: decoded.append(a[5]) or routed_paths(*a, **kw)
harness.untuned_paths = lambda *a, **kw: decoded.append("untuned paths") or untuned_paths(*a, **kw)
try:
    eval_stage.eval_stage(mini_config(), w)
except KeyboardInterrupt:
    print(json.dumps(decoded))
    sys.exit(3)
print(json.dumps(decoded))
"""


def test_an_interrupted_eval_resumes_with_the_models_it_finished(workdir, tmp_path):
    """Killed while loading the third fine-tuned model, the eval has kept the state of each unit
    it finished (W/eval_parts/<unit>.pkl); the rerun decodes only the models after them, and its
    results are the uninterrupted run's (timings aside)."""
    w = tmp_path / "w"
    shutil.copytree(workdir, w, ignore=shutil.ignore_patterns("results.json", "report.md", "plots", "export"))

    def eval_run(mode: str) -> tuple[int, list[str]]:
        proc = subprocess.run([sys.executable, "-c", RESUMED_EVAL, str(w), mode], cwd=REPO, capture_output=True,
                              text=True, env=single_process_env(PYTHONPATH=f"{REPO / 'tests'}:{REPO}"))
        assert proc.returncode in (0, 3), proc.stderr[-2000:]
        return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])

    assert eval_run("killed") == (3, ["untuned paths", "selective paths", "srrag paths"])
    assert sorted(p.name for p in (w / "eval_parts").iterdir()) == ["selective.pkl", "srrag.pkl", "untuned.pkl"]
    assert eval_run("rerun") == (0, ["no_dpo paths", "no_kv_label paths"])
    assert not (w / "eval_parts").exists()
    got, want = (json.loads((d / "results.json").read_text()) for d in (w, workdir))
    assert without_timings(got) == without_timings(want)


def test_stop_after_stops(tmp_path, capsys):
    cfg = mini_config()
    cfg.pipeline.stop_after = "world"
    pipeline.run(cfg, tmp_path / "w")
    assert (tmp_path / "w" / "world").is_dir() and not (tmp_path / "w" / "base").exists()
    cfg.pipeline.stop_after = "nonsense"
    with pytest.raises(JaxragError, match="not a stage"):
        pipeline.run(cfg, tmp_path / "w")


def test_paper_config_without_weights_stops_at_once(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jaxrag.train", "--config", "configs/qwen.py",
                           "--workdir", str(tmp_path / "w"), "--config.model.path=/nonexistent/qwen"],
                          capture_output=True, text=True, cwd=str(REPO))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--config.model.path" in proc.stderr and "/nonexistent/qwen" in proc.stderr


def test_quickstart_notebook_shows_the_results_table_and_plots(quickstart):
    _, nb = quickstart
    text = outputs(nb)
    assert "[10/10] export" in text and "srrag_no_kv_label" in text and "acc=" in text
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == len(list((quickstart[0] / "plots").glob("*.png"))) >= 2


def test_inference_notebook_routes_questions_from_the_export(workdir):
    nb = run_notebook("inference", {"EXPORT": str(workdir / "export")}, workdir.parent)
    text = outputs(nb)
    assert text.count("source: <") == 8 and text.count("p_D: wiki=") == 8 and "T_g=" in text
    assert "Qwen2ForCausalLM" in text and "'<Wiki>', '<Self>'" in text


def test_export_serves_sr_rag_with_the_evaluated_tau(workdir):
    from jaxrag.serve import SRRAG

    results = json.loads((workdir / "results.json").read_text())
    system = SRRAG.load(workdir / "export")
    assert system.tau == results["config"]["thresholds"]["srrag"] and system.k == 3 and system.n_passages == 2
    assert len(system.datastore) == len(jaxrag.pipeline.workdir.construct_records(workdir))
    routed = system.ask(["Which city is the birthplace of Kou?"])
    r = routed[0]
    want = "wiki" if r.p_model[0] * r.p_datastore[0] > system.tau else "self"
    assert r.source == want and set(r.latency) >= {"T_d", "T_g"}


def test_killed_runs_rerun_to_the_same_results(workdir, tmp_path):
    """kill -9 during three different stages, then a clean rerun: results.json equals the
    uninterrupted run's (timings aside), and no temp files are left behind."""
    out = tmp_path / "run"
    cmd = train_command(out)
    env = single_process_env()  # the quickstart's devices
    for stage, delay in (("base", 2.0), ("construct", 8.0), ("baselines", 10.0)):
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for line in proc.stdout:
            if f"] {stage}: running" in line:
                break
        time.sleep(delay)
        proc.kill()
        proc.wait()
        assert not (out / "results.json").exists()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = json.loads((workdir / "results.json").read_text())
    got = json.loads((out / "results.json").read_text())
    assert without_timings(got) == without_timings(want)
    assert not list(out.glob(".*tmp*")) and not list(out.glob(".*partial"))


def test_base_gates_retry_from_a_new_init_and_keep_the_largest_margin(tmp_path, monkeypatch):
    """pretrain_until_it_reads_and_verbalizes, with training and the probes replaced by records:
    attempt k trains in its own directory from seed + 1_000_003 k, stops at the first base that
    passes both gates (reading 0.8, verbalization 0.7 here), else keeps the largest margin
    min(reading - 0.8, verbalization - 0.7)."""
    from jaxrag.pipeline import base

    runs = []
    monkeypatch.setattr(base, "_tiny_model", lambda cfg, workdir: int(cfg.seed))
    monkeypatch.setattr(base, "train_lm", lambda seed, texts, cfg, workdir: runs.append((seed, workdir)) or seed)

    def check(reading, verbal, attempts, want_runs, want_kept):
        runs.clear()
        reads, verbs = iter(reading), iter(verbal)
        monkeypatch.setattr(base, "fresh_reading", lambda model, world, n, **kw: {"reading": next(reads)})
        monkeypatch.setattr(base, "fresh_rule_verbalization", lambda model, world, n, tokens: next(verbs))
        cfg = tiny_config("qwen2")
        cfg.update(seed=7)
        cfg.world_probe.update(attempts=attempts, reading_gate=0.8, verbal_gate=0.7)
        model, got = base.pretrain_until_it_reads_and_verbalizes(
            cfg, tmp_path, type("World", (), {"pretraining_documents": None}))
        assert model == 7 + 1_000_003 * want_kept and got["kept_attempt"] == want_kept
        assert got["reading_attempts"] == reading[:want_runs] and got["verbalization_attempts"] == verbal[:want_runs]
        assert got["fresh_reading"] == reading[want_kept] and got["fresh_rule_verbalization"] == verbal[want_kept]
        assert got["reading_gate_passed"] == (reading[want_kept] >= 0.8)
        assert got["verbalization_gate_passed"] == (verbal[want_kept] >= 0.7)
        assert runs == [(7 + 1_000_003 * k, tmp_path / "base_train" / (f"attempt{k}" if k else ""))
                        for k in range(want_runs)]
        assert cfg.seed == 7 and cfg.world.seed == 7  # the config (and its world) untouched

    check([0.9], [0.95], 3, 1, 0)  # passes both at once: one run
    check([0.3, 0.85], [1.0, 0.9], 3, 2, 1)  # second init reads: stop there
    check([0.91, 0.85], [0.25, 0.9], 3, 2, 1)  # reads but does not verbalize: again
    check([0.5, 0.3, 0.4], [0.9, 0.9, 0.9], 3, 3, 0)  # none reads: margins -0.3, -0.5, -0.4
    check([0.95, 0.6, 0.9], [0.2, 0.9, 0.65], 3, 3, 2)  # margins -0.5, -0.2, -0.05: the last
