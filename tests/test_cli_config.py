"""Config mistakes are user errors: one `error:` line, exit code 2, no traceback (`python -m
jaxrag.train`); a field the chosen mode does not read is refused when the user set it, never when
it is a default; overrides keep their field's type."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrag.errors import JaxragError
from jaxrag.pipeline import config_check
from jaxrag.pipeline import run as pipeline
from jaxrag.pipeline.config import paper_config, tiny_config

REPO = Path(__file__).parent.parent


def train_cli(tmp_path, config: str, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxrag.train", "--config", config, "--workdir",
                           str(tmp_path / "w"), *overrides], capture_output=True, text=True, cwd=REPO, timeout=300)


@pytest.mark.parametrize("config, overrides, says", [
    ("configs/qwen.py:tiny", ["--config.stage1.learning_rate=3"], "stage1.learning_rate does not exist; did you mean stage1.lr?"),
    ("configs/qwen.py:tiny", ["--config.inference.tua=0.3"], "did you mean inference.tau?"),
    ("configs/qwen.py:huge", [], "unknown config size 'huge'"),
    ("configs/nope.py", [], "no such config file 'configs/nope.py'"),
    ("configs/qwen.py:tiny", ["--config.stage1.lr=fast"], "stage1.lr is a number"),
    ("configs/qwen.py:tiny", ["--config.inference.k=2.5"], "inference.k is an integer"),
    ("configs/qwen.py:tiny", ["--config.stage1=3"], "stage1 is a section"),
    ("configs/qwen.py:tiny", ["--config.data.paths.popqa=/missing/file.jsonl"],
     "data.paths.popqa is set, but the embedded world"),
    ("configs/qwen.py:tiny", ["--config.retrieval.corpus=/data/psgs_w100.tsv"], "retrieval.corpus is set, but the embedded"),
    ("configs/qwen.py:tiny", ["--config.model.path=Qwen/Qwen2.5-7B-Instruct", "--config.pretrain.steps=5"],
     "pretrain.steps is set, but with a real model"),
    ("configs/qwen.py", ["--config.data.paths.popqa=/missing/popqa.jsonl"], "data.paths.popqa=/missing/popqa.jsonl: no such file"),
    ("configs/qwen.py", ["--config.world.seed=3"], "world.seed does not exist; did you mean seed?"),
    ("configs/qwen.py:tiny", ["--config.pipeline.rerun_from=stage9"], "rerun_from='stage9': not a stage"),
    ("configs/qwen.py:tiny", ["--config.model.datastore_layer=5"], "model.datastore_layer=5: the model has 4 layers"),
    ("configs/qwen.py:tiny", ["--workdri=x"], "Unknown command line flag 'workdri'"),
])
def test_each_config_mistake_is_one_line_and_exit_2(tmp_path, config, overrides, says):
    proc = train_cli(tmp_path, config, *overrides)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], proc.stderr
    assert not (tmp_path / "w").exists()  # refused before anything was done


@pytest.mark.parametrize("overrides, says", [
    (["--config", "configs/qwen.py", "--config.stage1.learning_rate=3"], "did you mean stage1.lr?"),
    (["--config", "configs/qwen.py:huge"], "unknown config size 'huge'"),
    (["--config", "configs/qwen.py", "--config.model.remat=some"], "model.remat"),
])
def test_plan_takes_the_same_config_flag(overrides, says):
    proc = subprocess.run([sys.executable, "-m", "jaxrag.plan", "--devices", "2", *overrides], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], proc.stderr


def test_overrides_keep_their_types_and_lists_split_on_commas():
    cfg, user = config_check.load_config(str(REPO / "configs/qwen.py") + ":tiny", [
        ("stage1.lr", "1e-3"), ("inference.k", "7"), ("data.eval", "popqa,arc_challenge"), ("seed", "3"),
        ("model.arch.rope_theta", "500000.0")])  # model.arch takes any Hugging Face config field
    assert (cfg.stage1.lr, cfg.inference.k, cfg.data.eval, cfg.world.seed) == (1e-3, 7, ["popqa", "arc_challenge"], 3)
    assert cfg.model.arch.rope_theta == 500000.0 and user == {"stage1.lr", "inference.k", "data.eval", "seed",
                                                            "model.arch.rope_theta"}
    config_check.check_config(cfg, user)


def test_split_argv_takes_every_override_form():
    rest, overrides = config_check.split_argv(["prog", "--config", "c.py", "--config.a.b=1", "--config.c", "x",
                                               "--noconfig.d", "--config.e", "--workdir=w"])
    assert rest == ["prog", "--config", "c.py", "--workdir=w"]
    assert overrides == [("a.b", "1"), ("c", "x"), ("d", "false"), ("e", "true")]


def test_defaults_a_mode_ignores_are_not_errors():
    config_check.check_config(tiny_config("qwen2"))  # data.paths.*, retrieval.corpus: defaults
    real = tiny_config("llama")
    real.model.path = "meta-llama/Llama-2-7b-chat-hf"  # the tiny config's world / pretrain: defaults
    config_check.check_config(real)
    config_check.check_config(paper_config("phi3"))


def test_a_config_file_that_sets_an_unread_field_is_refused(tmp_path):
    """Fields a config file changes against the shipped config count as set by the user."""
    (tmp_path / "mine.py").write_text("from jaxrag.pipeline.config import tiny_config\n\ndef get_config():\n"
                                      "    cfg = tiny_config('qwen2')\n    cfg.data.paths.nq = '/data/nq.jsonl'\n"
                                      "    return cfg\n")
    proc = train_cli(tmp_path, str(tmp_path / "mine.py"))
    assert proc.returncode == 2 and proc.stderr.startswith("error: data.paths.nq is set, but the embedded world")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_the_python_api_refuses_the_same_mistakes(tmp_path):
    cfg = tiny_config("qwen2")
    cfg.retrieval.passage_embeddings = "/data/wikipedia_passages_0.pkl"
    with pytest.raises(JaxragError, match="retrieval.passage_embeddings is set, but the embedded world"):
        pipeline.run(cfg, tmp_path / "w")
    cfg = tiny_config("qwen2")
    cfg.stage1.learnign_rate = 1.0  # a typo in Python adds a field
    with pytest.raises(JaxragError, match="stage1.learnign_rate does not exist; did you mean stage1.lr"):
        pipeline.run(cfg, tmp_path / "w")
    cfg = tiny_config("qwen2")
    cfg.pipeline.workers = 0
    with pytest.raises(JaxragError, match=r"--config.pipeline.workers=0: must be at least 1"):
        pipeline.run(cfg, tmp_path / "w")
    assert not (tmp_path / "w").exists()


_FAULTS = """
import resource, sys
from jaxrag.pipeline.cli import reuse_cpu_temporaries
print(reuse_cpu_temporaries() if sys.argv[1] == "tune" else False)
import jax, jax.numpy as jnp
f = jax.jit(lambda x: (lambda y: (y @ y[:8].T).sum())(jnp.exp(x)))  # y: a 64 MB temporary
x = jnp.ones((2048, 8192))
f(x).block_until_ready()
faulted = 0
for _ in range(30):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faulted += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before > (32 << 20) // 4096
print(faulted)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_cpu_temporaries_are_reused_not_faulted_in_per_call():
    """The kernel's own page-fault count: untuned, every call maps its 64 MB temporary afresh
    (>= half of its 4 KB pages faulted in); after `reuse_cpu_temporaries` the freed block is
    reused (a call may still grow the heap while an earlier one's block is in use)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = {mode: subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True,
                                cwd=REPO, env=env, timeout=120, check=True).stdout.split() for mode in ("tune", "plain")}
    assert out["tune"][0] == "True" and out["plain"][0] == "False"
    assert int(out["plain"][1]) == 30
    assert int(out["tune"][1]) <= 10
    cuda = subprocess.run([sys.executable, "-c", "from jaxrag.pipeline.cli import reuse_cpu_temporaries as r; print(r())"],
                          capture_output=True, text=True, cwd=REPO, env=env | {"JAX_PLATFORMS": "cuda"}, check=True)
    assert cuda.stdout.split() == ["False"]  # an accelerator's host is left alone


_RELEASE = """
import numpy as np
from jaxrag.runtime import host_memory
from jaxrag.pipeline.cli import reuse_cpu_temporaries
assert reuse_cpu_temporaries()
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20  # MB resident
host_memory.bound(0.5)  # the first call records where the process stands
base = rss()
big = np.ones(1 << 27)  # 1 GB from the heap, then a small block above it, as a next step's would be
small = np.ones(1 << 10)
del big
held = rss()
host_memory.bound(2.0)  # grown by 1 GB, within 2 GB of slack: kept for reuse
kept = rss()
host_memory.bound(0.5)  # beyond 0.5 GB: given back
print(base, held, kept, rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_memory_goes_back_to_the_os_once_the_process_has_grown():
    """The kernel's resident-set count: under `reuse_cpu_temporaries` a freed 1 GB block stays
    resident (the heap never trims, and a later block sits above it), so without help a run's
    RSS is the peak of everything it ran; `host_memory.bound` (once per step or batch) gives it
    back when the process has grown by more than its slack, and keeps it for reuse otherwise."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    base, held, kept, released = map(int, subprocess.run([sys.executable, "-c", _RELEASE], capture_output=True,
                                                         text=True, cwd=REPO, env=env, timeout=120,
                                                         check=True).stdout.split())
    assert held - base > 900 and kept - base > 900  # freed, still resident
    assert released - base < 100


def test_cpu_collectives_wait_for_a_late_participant_on_the_cpu_only(monkeypatch):
    """On the CPU, XLA_FLAGS gains both collective timeouts (30 minutes, not XLA's 40 s), after what
    the user set; a timeout the user set is kept; an accelerator's flags are left alone."""
    from jaxrag.pipeline.cli import patient_cpu_collectives

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    assert patient_cpu_collectives()
    assert os.environ["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=2"
                                       " --xla_cpu_collective_call_terminate_timeout_seconds=1800"
                                       " --xla_cpu_collective_timeout_seconds=1800")
    assert not patient_cpu_collectives()  # already there: nothing added twice
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_collective_timeout_seconds=60")
    assert patient_cpu_collectives()
    assert os.environ["XLA_FLAGS"] == ("--xla_cpu_collective_timeout_seconds=60"
                                       " --xla_cpu_collective_call_terminate_timeout_seconds=1800")
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    monkeypatch.delenv("XLA_FLAGS")
    assert not patient_cpu_collectives() and "XLA_FLAGS" not in os.environ
