"""What tests/test_pipeline.py builds on: the miniature embedded world's config, the notebooks run
headless, and how a run's output and files are compared."""

import fcntl
import hashlib
import os
import shutil
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from jaxrag.pipeline.config import tiny_config

REPO = Path(__file__).parent.parent

MINI_WORLD = dict(num_persons=60, num_cities=30, num_companies=30, num_bands=20, num_rivers=6,
                  num_event_passages=10, nq_size=20, fever_size=12, obqa_size=8, arc_easy_size=6, wow_size=12,
                  asqa_size=4, eval_test_size=10, rc_docs_per_epoch=50,
                  rule_qa_per_epoch=30, rule_verbalize_per_epoch=30, vocab_size=1200)


def mini_config():
    cfg = tiny_config("qwen2")
    cfg.world.update(MINI_WORLD)
    cfg.model.arch.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1)
    cfg.model.datastore_layer = 2  # its last layer, as the tiny config's
    cfg.model.max_length = 160
    cfg.pretrain.update(steps=3, batch_size=4, checkpoint_every=2)
    # a 3-step model fails the gates: 2 attempts, then it runs on (a failed reading gate would stop it)
    cfg.world_probe.update(questions=3, reading_questions=4, rule_questions=4, allow_failed_reading_gate=True)
    cfg.retrieval.n_passages = 2
    cfg.construct.update(n_contexts=2, verbalize_max_tokens=8, kmeans_clusters=2, demos_per_cluster=1)
    cfg.stage1.update(batch_size=4, epochs=1)
    cfg.stage2.update(batch_size=4, epochs=1)
    # One batch of 16 rows holds a whole test set (10 questions): one routed batch per set, path
    # and method's latency, where batches of 8 take two (the second padded to 8 rows).
    cfg.inference.update(batch_size=16, k=3, max_answer_tokens=4, max_knowledge_tokens=96)
    cfg.baselines.update(seakr_samples=2, max_train_questions=20, ik_answer_tokens=4)
    # What tests/test_multihost.py runs as 2 processes x 2 devices against this run on 1 x 4: the
    # fsdp axis spans every device, so each parameter is split across the process boundary there;
    # construct's 62 questions in 4 shards (each process builds two); stage 1 checkpoints every 4
    # of its steps, so that a kill during it resumes from a checkpoint.
    cfg.mesh.update(data=1, fsdp=-1, tensor=1)
    cfg.construct.shard_size = 16
    cfg.stage1.checkpoint_every = 4
    return cfg


# The devices of a single-process run of the miniature pipeline (the mesh of tests/test_multihost.py).
DEVICES = 4
# How every run of the miniature pipeline compiles, on 1 process or several: its programs are tiny
# and run for seconds, so compiling them is most of a cold run, and LLVM's optimizations are a
# sixth of that. Runs compared with each other (1 x 4 devices, 2 x 2, the reruns) share these flags.
MINI_XLA_FLAGS = "--xla_backend_optimization_level=0"


def single_process_env(**extra) -> dict[str, str]:
    """The environment of a single-process run on `DEVICES` CPU devices (XLA's collective timeouts
    raised as `jaxrag.train` raises them: four device threads on two busy cores)."""
    from jaxrag.pipeline.cli import PATIENT_CPU_COLLECTIVES

    flags = " ".join([f"--xla_force_host_platform_device_count={DEVICES}", *PATIENT_CPU_COLLECTIVES, MINI_XLA_FLAGS])
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, **extra)


def built_once(tmp_path_factory, name: str, build) -> Path:
    """`build(path)` once per test session, whichever xdist worker asks first; a worker that asks
    while it is being built waits for it. Under the session's temporary root, so pytest removes it
    with the rest."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    path = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / f"{name}.built").exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            build(path)
            (root / f"{name}.built").touch()
    return path


def _flat(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def mini_overrides() -> dict:
    """mini_config as flattened overrides of the tiny config (notebook / command-line form)."""
    tiny = dict(_flat(tiny_config("qwen2").to_dict()))
    return {k: v for k, v in _flat(mini_config().to_dict()) if tiny[k] != v}


def run_notebook(name: str, params: dict, cwd: Path, env: dict | None = None) -> nbformat.NotebookNode:
    """Executes colab/NAME.ipynb headless with `params` injected after its parameters cell (its
    kernel in `env`, by default this process's environment)."""
    nb = nbformat.read(REPO / "colab" / f"{name}.ipynb", as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in params.items())))
    NotebookClient(nb, timeout=1800, kernel_name="python3",
                   resources={"metadata": {"path": str(cwd)}}).execute(env=env or dict(os.environ))
    return nb


def quickstart_run(tmp_path_factory) -> tuple[Path, nbformat.NotebookNode]:
    """The quickstart notebook runs the miniature pipeline once per session, on `DEVICES` CPU
    devices: the single-process run that tests/test_pipeline.py checks and tests/test_multihost.py
    compares its 2-process run with. (workdir, the executed notebook)"""
    def build(home):
        nb = run_notebook("quickstart", {"WORKDIR": str(home / "run"), "OVERRIDES": mini_overrides()}, home,
                          env=single_process_env())
        nbformat.write(nb, home / "quickstart.ipynb")

    home = built_once(tmp_path_factory, "quickstart", build)
    return home / "run", nbformat.read(home / "quickstart.ipynb", as_version=4)


def outputs(nb) -> str:
    return "".join(o.get("text", "") + "".join(map(str, o.get("data", {}).values()))
                   for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def statuses(out: str) -> list[str]:
    """The status word of each stage's progress line ("done", "running")."""
    return [line.split(":")[1].strip().split()[0] for line in out.splitlines()
            if line.startswith("[") and "finished in" not in line]


def file_digests(root: Path, parts=None) -> dict[str, tuple[str, int]]:
    """relative path -> (sha256, mtime_ns) of every file under root (or under its `parts`)."""
    tops = [root / p for p in parts] if parts else [root]
    return {str(f.relative_to(root)): (hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_mtime_ns)
            for top in tops for f in sorted(top.rglob("*")) if f.is_file()}


# The code identity a run records: two runs in one working checkout may straddle a commit, and a
# resumed stage also records the code it started with (what is recorded is tested in
# tests/test_provenance.py). Never compared between runs.
CODE_IDENTITY = ("code", "code_started")


def without_timings(obj):
    """`obj` (a results.json) without its wall-clock times and `CODE_IDENTITY`."""
    if isinstance(obj, dict):
        return {k: without_timings(v) for k, v in obj.items()
                if "latency" not in k and k != "phases" and k not in CODE_IDENTITY}
    if isinstance(obj, list):
        return [without_timings(v) for v in obj]
    if isinstance(obj, float) and obj != obj:  # undefined (an AUROC over one class) equals itself
        return "nan"
    return obj
