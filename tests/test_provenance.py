"""The stage-dependency table and the rerun plan (`jaxrag.pipeline.provenance`), without running stages:
which fields each stage is built from, what a changed field makes stale, rerun_from, and
workdirs made before records existed. The pipeline-level behaviour is in test_pipeline.py."""

import pytest

from jaxrag.errors import JaxragError
from jaxrag.pipeline import provenance as P
from jaxrag.pipeline.config import paper_config, tiny_config
from jaxrag.pipeline.config_check import flatten

NAMES = list(P.STAGES)


def stages_reading(cfg, field: str, embedded: bool = True) -> list[str]:
    return [n for n in NAMES if field in P.stage_inputs(n, cfg, embedded)]


def test_each_field_is_recorded_by_the_stages_that_read_it():
    cfg = tiny_config("qwen2")
    assert stages_reading(cfg, "world.num_persons") == ["world", "eval"]
    assert stages_reading(cfg, "pretrain.lr") == ["base", "eval"]
    assert stages_reading(cfg, "stage1.lr") == ["stage1", "baselines", "eval"]
    assert stages_reading(cfg, "stage2.dpo_beta") == ["stage2", "baselines", "eval"]
    assert stages_reading(cfg, "construct.label_rule") == ["construct", "eval"]
    assert stages_reading(cfg, "model.datastore_layer") == ["datastore", "baselines", "eval", "export"]
    for eval_only in ("inference.tau", "inference.selective_tau", "inference.k", "eval.thresholds",
                      "baselines.seakr_samples"):
        assert stages_reading(cfg, eval_only) in (["eval"], ["eval", "export"]), eval_only
    # the embedded world's recall probe reads the evaluation sets; a real model's index does not
    assert "data.eval" in P.stage_inputs("index", cfg, True)
    assert "data.eval" not in P.stage_inputs("index", paper_config("qwen2"), False)
    assert "seed" not in P.stage_inputs("base", paper_config("qwen2"), False)  # conversion: no seed


def test_fields_that_cannot_change_a_result_are_never_recorded():
    cfg = tiny_config("qwen2")
    neutral = [f for f in flatten(cfg) if P.is_neutral(f)]
    assert {"pipeline.stop_after", "pipeline.rerun_from", "stage1.per_device_batch_size", "stage2.log_every",
            "pretrain.checkpoint_every", "mesh.data", "model.remat"} <= set(neutral)
    assert not any(f in P.stage_inputs(n, cfg, True) for n in NAMES for f in neutral)


def test_a_field_added_later_is_covered_by_its_prefix():
    cfg = tiny_config("qwen2")
    cfg.stage1.label_smoothing = 0.1  # a new training field: stage 1 and later are stale
    cfg.eval.new_metric = True  # a new eval-only section field
    cfg.newsection = dict(x=1)  # a field no stage claims: eval, which writes the whole config
    assert stages_reading(cfg, "stage1.label_smoothing") == ["stage1", "baselines", "eval"]
    assert stages_reading(cfg, "eval.new_metric") == ["eval"]
    assert stages_reading(cfg, "newsection.x") == ["eval"]


def finished(tmp_path, cfg, names=NAMES):
    """A workdir whose stages all finished under `cfg` (records only; no artifacts needed)."""
    for step in P.plan(cfg, tmp_path, names, dict.fromkeys(names, False), True):
        P.write_record(tmp_path, step.record)
    return dict.fromkeys(names, True)


def actions(steps):
    return {s.name: s.action for s in steps}


def test_an_unchanged_config_skips_everything_and_an_eval_only_change_redoes_eval_and_export(tmp_path):
    cfg = tiny_config("qwen2")
    done = finished(tmp_path, cfg)
    assert set(actions(P.plan(cfg, tmp_path, NAMES, done, True)).values()) == {"skip"}
    old, cfg.inference.tau = cfg.inference.tau, 0.5
    steps = P.plan(cfg, tmp_path, NAMES, done, True)
    assert [n for n, a in actions(steps).items() if a != "skip"] == ["eval", "export"]
    assert steps[-2].why == [f"inference.tau {old} → 0.5"]
    assert steps[-1].why == [f"inference.tau {old} → 0.5", "eval was rebuilt since"]


def test_a_changed_training_field_stops_with_the_stage_and_the_difference(tmp_path):
    cfg = tiny_config("qwen2")
    done = finished(tmp_path, cfg)
    before = {p.name: p.read_bytes() for p in (tmp_path / "inputs").iterdir()}
    cfg.stage2.dpo_beta, cfg.inference.tau = 0.5, 0.3
    with pytest.raises(JaxragError) as e:
        P.plan(cfg, tmp_path, NAMES, done, True)
    msg = str(e.value)
    assert "stage2 was built from another config (stage2.dpo_beta 0.3 → 0.5)" in msg
    assert "--config.pipeline.rerun_from=stage2" in msg and "fresh --workdir" in msg and "\n" not in msg
    assert {p.name: p.read_bytes() for p in (tmp_path / "inputs").iterdir()} == before
    steps = P.plan(cfg, tmp_path, NAMES, done, True, rerun_from="stage2")
    assert [n for n, a in actions(steps).items() if a == "redo"] == NAMES[NAMES.index("stage2"):]
    with pytest.raises(JaxragError, match="stage2 was built from another config"):
        P.plan(cfg, tmp_path, NAMES, done, True, rerun_from="datastore")  # too late: stage2 stays stale


def test_a_workdir_of_an_older_world_generator_is_refused_at_the_world_stage(tmp_path):
    """`world.version` names the generator: a workdir built before a version existed (version 1)
    or by another version is refused, not silently reused with the new code's world."""
    from jaxrag.world.generate import WorldConfig

    cfg = tiny_config("qwen2")
    assert cfg.world.version == WorldConfig().version
    old = tiny_config("qwen2")
    del old.world["version"]  # as a version-1 workdir recorded it
    done = finished(tmp_path, old)
    with pytest.raises(JaxragError, match=r"world was built from another config \(world.version .* → "
                                          + str(cfg.world.version)):
        P.plan(cfg, tmp_path, NAMES, done, True)


def test_a_stage_rebuilt_at_the_same_config_makes_its_dependents_stale(tmp_path):
    cfg = tiny_config("qwen2")
    done = finished(tmp_path, cfg)
    for step in P.plan(cfg, tmp_path, NAMES[:NAMES.index("stage1") + 1], done, True, rerun_from="stage1"):
        P.write_record(tmp_path, step.record)  # stage1 redone alone (stop_after=stage1)
    with pytest.raises(JaxragError, match=r"stage2 was built from another config \(stage1 was rebuilt since\)"):
        P.plan(cfg, tmp_path, NAMES, done, True)


def test_a_workdir_made_before_records_is_refused_unless_rerun_from_vouches(tmp_path):
    cfg, done = tiny_config("qwen2"), dict.fromkeys(NAMES, True)
    with pytest.raises(JaxragError, match="world was made before jaxrag recorded each stage's inputs"):
        P.plan(cfg, tmp_path, NAMES, done, True)
    steps = P.plan(cfg, tmp_path, NAMES, done, True, rerun_from="eval")
    assert actions(steps) == {**dict.fromkeys(NAMES[:-2], "adopt"), "eval": "redo", "export": "redo"}
    with pytest.raises(JaxragError, match="rerun_from='stage3': not a stage of this run"):
        P.plan(cfg, tmp_path, NAMES, done, True, rerun_from="stage3")


def test_an_interrupted_stage_resumes_only_under_the_same_inputs(tmp_path):
    cfg = tiny_config("qwen2")
    done = finished(tmp_path, cfg)
    done.update(stage1=False, stage2=False)  # killed during stage 1
    assert actions(P.plan(cfg, tmp_path, NAMES, done, True))["stage1"] == "run"
    cfg.stage1.epochs = 2
    with pytest.raises(JaxragError, match="stage1 was built from another config"):
        P.plan(cfg, tmp_path, NAMES, done, True)


# -- the code each stage was built by ---------------------------------------------------------------

CODE_A = {"commit": "a" * 40, "dirty": False, "jaxrag": "0.1.0", "jax": "1", "flax": "2", "transformers": "3"}
CODE_B = {**CODE_A, "commit": "b" * 40, "dirty": True}


def test_records_name_their_code_and_a_new_commit_makes_nothing_stale(tmp_path, monkeypatch):
    """Each record names the code that built the stage; a later commit (the same config) skips
    every finished stage, keeping the code that built it, and a resumed stage names both codes."""
    cfg = tiny_config("qwen2")
    monkeypatch.setattr(P, "code_identity", lambda: CODE_A)
    done = finished(tmp_path, cfg)
    assert P.stages_code(tmp_path) == dict.fromkeys(NAMES, CODE_A)
    monkeypatch.setattr(P, "code_identity", lambda: CODE_B)
    steps = P.plan(cfg, tmp_path, NAMES, done, True)
    assert set(actions(steps).values()) == {"skip"} and all(s.record["code"] == CODE_A for s in steps)
    done.update(stage2=False)  # killed during stage 2 at commit a, resumed at commit b
    step = next(s for s in P.plan(cfg, tmp_path, NAMES, done, True) if s.name == "stage2")
    assert (step.action, step.record["code"], step.record["code_started"]) == ("run", CODE_B, CODE_A)
    assert step.record["build"] == P.read_record(tmp_path, "stage2")["build"]  # the same build
    cfg.inference.tau = 0.5  # a redone stage is built by the code running now
    eval_step = next(s for s in P.plan(cfg, tmp_path, NAMES, done, True) if s.name == "eval")
    assert (eval_step.action, eval_step.record["code"]) == ("redo", CODE_B)
    adopted = P.plan(cfg, tmp_path / "old", NAMES, dict.fromkeys(NAMES, True), True, rerun_from="eval")
    assert adopted[0].action == "adopt" and adopted[0].record["code"] is None  # made by code nobody recorded


def test_code_identity_is_the_checkouts_commit_and_the_libraries_versions(monkeypatch):
    import subprocess

    import flax
    import jax
    import transformers

    root = P.Path(P.__file__).resolve().parents[2]
    git = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True).stdout.strip()
    got = P.code_identity()
    assert got["commit"] == git("rev-parse", "HEAD") and len(got["commit"]) == 40
    assert got["dirty"] == bool(git("status", "--porcelain", "--untracked-files=no"))
    assert (got["jax"], got["flax"], got["transformers"]) == (jax.__version__, flax.__version__,
                                                              transformers.__version__)

    def no_git(*a, **kw):
        raise FileNotFoundError("git")

    monkeypatch.setattr(P.subprocess, "run", no_git)  # a machine without git: the installed version
    assert P.code_identity() == {**got, "commit": None, "dirty": None}
