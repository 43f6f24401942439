"""Several processes, one run: the miniature pipeline of tests/test_pipeline.py launched as 2
processes x 2 CPU devices by `launch/local.sh` (jax.distributed over a 127.0.0.1 coordinator, gloo
collectives: the multi-controller runtime of a TPU pod or a Slurm GPU cluster) gives the results of
the same config as 1 process x 4 devices; process 1 and process 0 (the coordinator), each killed
during construct and again during a training stage, stop the other within 60 s with one line, and
the same launch then resumes to those results; a process started differently is refused at start.

The mesh (data=1, fsdp=4) splits every parameter across the two processes, so every training
step's collectives (and DPO's reference scoring, the base probe's generation) cross them. The
generation stages place the model on each process's own 2 devices, split over the model axis
(`generation.tensor=2`), and each process computes its share of the questions."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import transformers
from multihost_fixtures import (REPO, audit_writes, audited_env, free_ports, kill_during, launch, log,
                                same_results, train_args)
from pipeline_fixtures import file_digests

import jaxrag
from jaxrag.retrieval.datastore import PolicyDatastore

LOST = "error: process {} of 2 was lost during stage '{}'; this process stops too. Relaunch the same command to resume"
# Float fields of results.json may differ in their last bits: the two runs' training steps are one
# XLA program over the same 4-device mesh, but their all-reduces sum across devices in another order
# (gloo between processes against the in-process CPU collectives), so trained weights agree to
# float32 rounding, not bit for bit. Decisions and accuracies built on them agree exactly unless two
# scores tie within that rounding; the thresholds fitted on those scores moved by up to 4.4e-8 when
# this was measured.
ATOL = 1e-6
# The launches split the generation model over each process's 2 devices (a model axis: the
# single process's run has one copy per device), so the generation side is checked on both
# placements in one run (tests/test_placement.py reruns it on one device).
TENSOR = ("--config.generation.tensor=2",)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """(single-process workdir: the quickstart's run on 1 process x 4 devices, shared with
    tests/test_pipeline.py and asked for once the launches are done, as another worker may be
    building it meanwhile; multi-process workdir, the two kills' records, the audits' root)."""
    root = tmp_path_factory.mktemp("multihost")
    two = root / "two"

    def running(stage):
        """The stage is under way in the launch about to start: its line, then a second inside it."""
        since = len(log(two, 0))

        def ready():
            if f"{stage}: running" not in log(two, 0)[since:]:
                return False
            time.sleep(1)
            return True
        return ready
    kills = {}
    for stage, victim, ready in (
            ("construct", 1, lambda: any((two / "construct").glob("shard-*.jsonl"))
             or any((two / "construct").glob("round1/*"))),
            ("construct", 0, None),  # the coordinator: construct resumes from what process 1's kill left
            ("stage1", 1, lambda: any((two / "stage1").glob("checkpoints/[0-9]*"))),
            ("stage2", 0, None)):
        survivor = 1 - victim
        start = len(log(two, survivor))
        ready = ready or running(stage)
        kills[stage, victim] = kill_during(launch(two, root / "audit-two", extra=TENSOR), two, root / "audit-two", ready,
                                           victim)
        kills[stage, victim]["survivor_log"] = log(two, survivor)[start:]
    resumed = launch(two, root / "audit-two", extra=TENSOR)
    out, err = resumed.communicate(timeout=3600)
    assert resumed.returncode == 0, err[-2000:] + log(two, 0)[-3000:]
    return request.getfixturevalue("quickstart")[0], two, kills, root


def results(workdir):
    return json.loads((workdir / "results.json").read_text())


def test_results_are_the_single_process_results(runs):
    one, two, _, _ = runs
    r1, r2 = results(one), results(two)
    assert (r1["config"]["generation"], r2["config"]["generation"]) == ({"tensor": 0}, {"tensor": 2})
    r2["config"]["generation"] = r1["config"]["generation"]  # where the model was placed: neutral
    same_results(r1, r2, ATOL)
    assert (two / "report.md").is_file() and (two / "export" / "srrag.json").is_file()


def test_construct_records_and_trained_models_are_the_single_process_ones(runs):
    one, two, _, _ = runs
    # construct's shards are built by one process each (process p: shards p, p + 2, ...) on its own
    # device, after a kill in the middle: the single process's records, labels and texts exactly;
    # their log-likelihoods (sums over an answer's tokens, up to ~200 nats) carry the base's
    # float32 rounding (1.5e-5 when measured)
    shards = sorted(p.name for p in (one / "construct").glob("shard-*.jsonl"))
    assert len(shards) == 4 and shards == sorted(p.name for p in (two / "construct").glob("shard-*.jsonl"))
    for name in shards:
        a, b = ([json.loads(line) for line in (w / "construct" / name).read_text().splitlines()] for w in (one, two))
        same_results(a, b, atol=1e-3, path=name)
    for stage in ("base", "stage1/model", "stage2/model"):
        a, b = (jaxrag.load_model(w / stage) for w in (one, two))
        ids = np.arange(3, 40)[None]
        np.testing.assert_allclose(np.asarray(a.logits(ids)), np.asarray(b.logits(ids)), atol=1e-4, err_msg=stage)


def test_the_export_loads_in_transformers_with_our_logits(runs):
    _, two, _, _ = runs
    ours = jaxrag.load_model(two / "export")
    hf = transformers.AutoModelForCausalLM.from_pretrained(two / "export")
    ids = list(range(3, 30))
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours.logits([ids])), want, atol=1e-4)


def test_each_process_splits_the_generation_model_over_its_devices(runs):
    """`generation.tensor=2`: each process places the generation model on its own 2 devices, split
    over the model axis (data 1 x tensor 2); each generation stage records it, and each process's
    log says it."""
    _, two, _, _ = runs
    for stage in ("construct", "datastore", "baselines", "eval"):
        placement = json.loads((two / "inputs" / f"{stage}.json").read_text())["placement"]
        assert placement == {"processes": 2, "devices_per_process": 2, "data": 1, "tensor": 2}, stage
    for i in (0, 1):
        assert f"generation: process {i} of 2, 2 devices: data 1 x tensor 2" in log(two, i)


def test_each_process_computes_its_share_of_the_datastores_and_eval(runs):
    """Each process's log names the batches it computes of the datastore and of eval's retrieval
    (jaxrag/runtime/shares.py; the write audit below checks that each wrote its spool), and the
    eval units it runs: each unit on one process, SR-RAG's (the costliest: its model's methods and
    the seeds' selectors) alone on process 0, the four others on process 1."""
    _, two, _, _ = runs
    runs_units = {}
    for i in (0, 1):
        text = log(two, i)
        for loop in ("datastore", "retrieve"):
            assert f"{loop}: process {i} of 2 computes batches" in text, (i, loop)
        runs_units[i] = re.findall(rf"eval: process {i} of 2 runs (\w+)$", text, re.M)
    assert runs_units == {0: ["srrag"], 1: ["untuned", "selective", "no_dpo", "no_kv_label"]}
    assert "srrag paths [wiki]: process" not in log(two, 0)  # a unit on one process maps its batches in place


def test_the_datastores_are_the_single_process_ones(runs):
    """Keys within the float32 rounding of the trained weights and of the model split in two."""
    one, two, _, _ = runs
    for rel in ("datastore", "baselines/no_kv_label_datastore", "baselines/no_dpo_datastore"):
        want, got = PolicyDatastore.load(one / rel), PolicyDatastore.load(two / rel)
        assert [(e.question_id, e.source) for e in got.entries] == [(e.question_id, e.source) for e in want.entries]
        np.testing.assert_allclose(got.keys(), want.keys(), atol=1e-4, err_msg=rel)


def test_every_file_is_written_by_one_process(runs):
    """The write audit (tests/write_audit) of every Python process of the three launches: each
    path under the workdir was written, renamed or removed by one process id. Orbax's checkpoint
    folders are the exception by design: every process writes its own shards into them, and orbax
    commits them (its metadata files, written from each process, are left to it)."""
    _, two, _, root = runs
    writers = audit_writes(root / "audit-two")
    assert any(p.startswith("construct/shard-") for p in writers)
    shared = {p: w for p, w in writers.items() if len(w) > 1 and ".orbax-checkpoint-tmp" not in p}
    assert not shared, shared
    # process 1 wrote no file of its own outside orbax's but its construct shards, its shares of
    # the datastores' and eval's batches (jaxrag/runtime/shares.py) and its eval units' parts
    # (W/eval_parts/<unit>.pkl), which process 0 read
    spools = ("datastore.shares/", "baselines/no_kv_label_datastore.shares/", "baselines/no_dpo_datastore.shares/",
              "eval_parts/")
    assert not [p for p, w in writers.items() if w == {"1"} and ".orbax-checkpoint-tmp" not in p
                and not p.startswith(("construct/", *spools))]
    for spool in spools:  # every process computed its share
        assert {frozenset(w) for p, w in writers.items() if p.startswith(spool) and p.endswith(".pkl")} \
            == {frozenset("0"), frozenset("1")}, spool
    # nothing half-written is left: no temp file or folder, no ".building"
    leftovers = [p for p in two.rglob("*") if ".tmp" in p.name or p.name.endswith(".building")]
    assert not leftovers, leftovers


def test_each_stage_records_the_single_process_provenance(runs):
    one, two, _, _ = runs
    for name in ("world", "base", "index", "construct", "stage1", "stage2", "datastore", "baselines", "eval",
                 "export"):
        a, b = (json.loads((w / "inputs" / f"{name}.json").read_text()) for w in (one, two))
        same_results(a, b, atol=0.0, path=name)


def test_a_lost_process_stops_the_other_within_60_seconds(runs):
    """Process 1, then process 0 (the coordinator), killed -9 in construct, and each again in a
    training stage: the survivor stops within 60 s by its own watchdog's SIGKILL (its own exit
    status, as the launcher reports each process's: 137, where the launcher's own is the worst of
    the two and the kill alone makes it 137), and its log of that launch has one error line, naming
    the lost process and the stage, and no traceback or stack dump (process 0's loss included: its
    coordinator outlives it, `jaxrag.runtime.coordinator`)."""
    _, two, kills, _ = runs
    for (stage, victim), kill in kills.items():
        assert kill["seconds"] < 60, (stage, victim, kill["seconds"])
        statuses = dict(re.findall(r"^process (\d+) exited with status (\d+):", kill["stderr"], re.M))
        assert statuses.get(str(1 - victim)) == "137", (stage, victim, kill["stderr"][-2000:])
        survivor = kill["survivor_log"]
        assert [line for line in survivor.splitlines() if line.startswith("error:")] == [LOST.format(victim, stage)], \
            (stage, victim, survivor[-3000:])
        for dump in ("Traceback", "Fatal Python error", "Check failure", "stack trace"):
            assert dump not in survivor, (stage, victim, survivor[-3000:])
    print({f"{stage}, process {victim}": round(kill["seconds"], 1) for (stage, victim), kill in kills.items()})


def _start(workdir, audit, argvs, cwds=None):
    """Processes started by hand, each with its own arguments (what local.sh would not do)."""
    port = free_ports()
    procs = []
    for i, argv in enumerate(argvs):
        env = audited_env(workdir, audit, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                          JAX_PROCESS_ID=str(i), XLA_FLAGS="--xla_force_host_platform_device_count=1")
        procs.append(subprocess.Popen([sys.executable, "-m", "jaxrag.train", *argv], cwd=(cwds or [REPO] * 2)[i],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return [(p.wait(timeout=300), p.stderr.read()) for p in procs]


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("case", ["config", "workdir", "data"])
def test_a_process_started_differently_is_refused_at_start(case, tmp_path):
    w = tmp_path / "w"
    argv = train_args(w)
    cwds = None
    if case == "config":
        argvs = [argv, [*argv, "--config.seed=1"]]
        why = "was started with another config than process 0's (seed, world.seed differ)"  # the world's follows
    elif case == "workdir":
        argvs = [argv, train_args(tmp_path / "elsewhere")]
        why = (f"does not see the workdir process 0 writes ({w}): the workdir must be one shared directory at the "
               "same path on every host")
    else:  # the same relative path names another file on each "host" (its own working directory)
        cwds = [tmp_path / "host0", tmp_path / "host1"]
        for i, cwd in enumerate(cwds):
            (cwd / "data").mkdir(parents=True)
            (cwd / "data" / "popqa.jsonl").write_text(json.dumps(
                {"id": "q1", "question": "Who?", "possible_answers": f'["A{i}"]', "s_pop": 5}) + "\n")
            shutil.copytree(REPO / "configs", cwd / "configs")
        argv = ["--config", "configs/smollm2.py:smoke", "--workdir", str(w), "--config.data.paths.popqa=data/popqa.jsonl"]
        argvs, why = [argv, argv], "sees other data than process 0 (data.paths.popqa differ by content)"
    outcomes = _start(w, tmp_path / "audit", argvs, cwds)
    for code, stderr in outcomes:
        assert code == 2, stderr[-2000:]
        assert _errors(stderr) == [f"error: process 1 of 2 {why}; start every process with the same command, "
                                   "config files and data"], stderr[-2000:]
    assert not w.exists() or not any(p for p in w.rglob("*") if p.is_file())  # nothing written


def test_local_launcher_dry_run_prints_one_command_per_process():
    proc = subprocess.run([str(REPO / "launch" / "local.sh"), "--processes", "3", "--devices-per-process", "2",
                           "--port", "9000", "--config", "configs/qwen.py:tiny", "--workdir", "/w", "--config.seed=1",
                           "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "XLA_FLAGS": "--xla_cpu_use_thunk_runtime=true"})
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.splitlines() == [  # a caller's XLA_FLAGS first, then the launcher's
        f"env JAX_COORDINATOR_ADDRESS=127.0.0.1:9000 JAX_NUM_PROCESSES=3 JAX_PROCESS_ID={i} JAX_PLATFORMS=cpu "
        f"'XLA_FLAGS=--xla_cpu_use_thunk_runtime=true --xla_force_host_platform_device_count=2' python -m jaxrag.train "
        "--config configs/qwen.py:tiny --workdir /w --config.seed=1" for i in range(3)]


BARRIER_PROGRAM = """
import sys, time
from jaxrag.runtime.join import initialize_distributed
initialize_distributed()
import jax, numpy as np
from jax.experimental import multihost_utils
from jaxrag.plan.fit import device_memory_gb
from jaxrag.runtime import multihost
print("device memory", device_memory_gb())  # the fit check's reading, on every process
if jax.process_index() == 1:
    time.sleep(float(sys.argv[1]))  # the fit check compiling, or a stage process 0 runs alone
multihost.barrier("late")
print(multihost_utils.process_allgather(np.array([jax.process_index()])).tolist())
"""


@pytest.fixture(scope="module")
def late():
    """BARRIER_PROGRAM as 2 processes x 1 CPU device, process 1 meeting the first barrier 40 s
    after process 0: [(exit status, stdout, stderr)] per process."""
    port = free_ports()
    env = lambda i: {**os.environ, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
                     "JAX_PROCESS_ID": str(i), "JAX_PLATFORMS": "cpu",
                     "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    procs = [subprocess.Popen([sys.executable, "-c", BARRIER_PROGRAM, "40"], cwd=REPO, env=env(i), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    try:
        return [(p.wait(timeout=150), p.stdout.read(), p.stderr.read()) for p in procs]
    finally:
        for p in procs:
            p.kill()


def test_a_process_reaching_the_first_barrier_late_is_waited_for(late):
    """Process 1 meets the run's first barrier 40 s after process 0: the barrier waits (a device
    collective there gave its peer 30 s to join: gloo's rendezvous), and the collective after it
    spans both processes."""
    for code, out, err in late:
        assert code == 0, err[-2000:]
        assert out.strip().splitlines()[-1] == "[[0], [1]]", out  # after gloo's own lines


def test_every_process_reads_its_own_devices_memory_for_the_fit_check(late):
    """The fit check's device memory (`plan/fit.py: device_memory_gb`) on process 1 as on process
    0: a device of its own (process 0's first device raises INVALID_ARGUMENT there: JAX reads
    memory statistics of addressable devices only); CPU devices report none, 0.0."""
    for code, out, err in late:
        assert code == 0 and "device memory 0.0" in out.splitlines(), err[-2000:]
