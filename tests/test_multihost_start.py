"""The start of a multi-host run (`jaxrag.runtime.multihost`), without the pipeline: a process killed
at start-up (the coordinator, or another) stops the survivor within the start-up timeout with one
line; the start check covers the model's weights, a missing file, the code and the packages; the
processes agree on the stage plan; a workdir that cannot rename directories (a flat Cloud Storage
bucket through gcsfuse) is refused; a pod started without JAXRAG_DISTRIBUTED=1 is one line; the
coordinator's port leaves room for the watchdogs' (P + 1); JAX's own timeouts come after ours;
on the CPU every process reads back the programs it compiled when relaunched."""

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest
from multihost_fixtures import free_ports, process_env

from jaxrag.errors import JaxragError
from jaxrag.runtime import multihost
from jaxrag.runtime import join

STARTUP = 8  # JAXRAG_STARTUP_TIMEOUT of these launches, s
TAIL = "see every host's log, then relaunch the same command on every host"

# Two processes' start, as `jaxrag.pipeline.run` does it, with what differs on process 1 (CASE).
PROGRAM = """
import os, sys
from pathlib import Path
from jaxrag.runtime.join import initialize_distributed
initialize_distributed()
import jax
from types import SimpleNamespace
from jaxrag.errors import JaxragError, run
from jaxrag.runtime import multihost
case, me = os.environ["CASE"], jax.process_index()
def check():
    raise JaxragError(f"the check ran on process {me}")
def main():
    multihost.agree_at_start({"model": {"path": "model"}}, {}, Path(sys.argv[1]))
    multihost.start_watchdog()
    actions = ["skip", "run"] if case == "plan" and me == 1 else ["skip", "skip"]
    multihost.agree_on_plan(["base", "construct"], [SimpleNamespace(action=a) for a in actions])
    if case == "fit":  # the fit check's way: process 0 alone checks, every process stops with its line
        multihost.leader_check("fit", check)
    multihost.finish()
run(main)
"""


def start(tmp_path, case, processes=(0, 1), port=None):
    """PROGRAM as 2 processes, each in its own directory (a host's: its model/ folder)."""
    port = port or free_ports()
    procs = {}
    for i in processes:
        host = tmp_path / f"host{i}"
        (host / "model").mkdir(parents=True, exist_ok=True)
        (host / "model" / "weights.bin").write_bytes(b"w1" if case == "weights" and i == 1 else b"w0")
        env = process_env(port, i, 2, JAXRAG_STARTUP_TIMEOUT=str(STARTUP), CASE=case,
                          XLA_FLAGS="--xla_force_host_platform_device_count=1")
        procs[i] = subprocess.Popen([sys.executable, "-c", PROGRAM, str(tmp_path / "w")], cwd=host, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return procs, port


def outcome(proc, timeout=120):
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def errors(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Start-up kills, both at once: the coordinator (process 0) killed before process 1 joins
    (process 1 then starts and tries to join it), and process 1 killed before it joins (process 0
    waits for it). {victim: (survivor's exit status, stderr, seconds from the kill)}."""
    root = tmp_path_factory.mktemp("startkill")
    out = {}
    zero, port0 = start(root / "a", "kill", processes=(0,))
    both, port1 = start(root / "b", "kill", processes=(0,))
    for port in (port0, port1):  # each coordinator is up, waiting for its process 1
        while not join._reachable(f"127.0.0.1:{port}"):
            time.sleep(0.1)
    zero[0].kill()
    late, _ = start(root / "b", "kill", processes=(1,), port=port1)
    late[1].kill()  # before its interpreter could even start: it never joins
    killed_at = time.monotonic()
    one, _ = start(root / "a", "kill", processes=(1,), port=port0)
    for victim, survivor in ((0, one[1]), (1, both[0])):
        code, err = outcome(survivor)
        out[victim] = (code, err, time.monotonic() - killed_at)
    return out


def test_the_coordinator_killed_at_start_up_stops_the_others_with_one_line(killed):
    code, err, seconds = killed[0]
    assert code == 2 and seconds < STARTUP + 15, (code, seconds, err[-2000:])
    assert errors(err) == [f"error: process 1 of 2 could not join the run at 127.0.0.1:{err.split('run at 127.0.0.1:')[1].split()[0]} "
                           f"within {STARTUP} s (JAXRAG_STARTUP_TIMEOUT): the coordinator (process 0) is not listening "
                           f"there: it did not start, died, or the address or port is unreachable from this host; {TAIL}"]
    assert "Traceback" not in err and "Check failure" not in err and "Fatal Python error" not in err, err[-2000:]


def test_a_process_killed_at_start_up_stops_the_coordinator_with_one_line(killed):
    code, err, seconds = killed[1]
    assert code == 2 and seconds < STARTUP + 15, (code, seconds, err[-2000:])
    [line] = errors(err)
    assert line.startswith("error: process 0 of 2 could not join the run at 127.0.0.1:") and line.endswith(
        f"within {STARTUP} s (JAXRAG_STARTUP_TIMEOUT): its coordinator is up but not every process joined: a host did "
        f"not start the command, or failed or was killed at start; {TAIL}"), line
    assert "Traceback" not in err and "Check failure" not in err and "Fatal Python error" not in err, err[-2000:]


@pytest.mark.parametrize("case,line", [
    ("weights", "error: process 1 of 2 sees other model weights than process 0 (model.path/weights.bin differ by "
                "content); start every process with the same command, config files and data"),
    ("plan", "error: process 1 of 2 plans stage 'construct' as 'run' where process 0 plans 'skip': they see the "
             "workdir differently (a shared filesystem's cache); turn its caching off (NFS: mount with "
             "lookupcache=none,actimeo=0) and relaunch the same command"),
    ("fit", "error: the check ran on process 0"),
])
def test_processes_that_differ_are_refused_by_every_process(case, line, tmp_path):
    """Another model file on process 1's host; another plan on process 1 (its view of the
    workdir); a check that fails (`leader_check`, as the fit check runs): both processes stop
    with the same one line and status 2, no watchdog line, and only process 0 ran the check."""
    procs, _ = start(tmp_path, case)
    for i, proc in procs.items():
        code, err = outcome(proc)
        assert code == 2 and errors(err) == [line], (i, err[-2000:])
        assert "Traceback" not in err


def view(**changes):
    base = {"config": {"seed": 0}, "files": {"data.paths.popqa": "d1", "model.path/w.safetensors": "m1"},
            "workdir": "/w", "sees_workdir": True, "identity": multihost.identity()}
    return {**base, **changes}


def test_the_start_check_names_a_missing_file_the_code_and_the_packages():
    lead = view()
    assert multihost._differs(lead, view()) == ""
    assert multihost._differs(lead, view(files={"model.path/w.safetensors": "m1"})).startswith(
        "does not find data.paths.popqa, which process 0 reads (a file missing on its host)")
    assert multihost._differs(lead, view(files={**lead["files"], "model.path/x": "m2"})).startswith(
        "finds model.path/x, which process 0 does not")
    other = {**lead["identity"], "source": "0" * 64}
    assert multihost._differs(lead, view(identity=other)).startswith("runs other jaxrag code than process 0 (source 000000000000")
    other = {**lead["identity"], "packages": {**lead["identity"]["packages"], "orbax-checkpoint": "0.0.1"}}
    assert multihost._differs(lead, view(identity=other)) == (
        f"has other packages than process 0 (orbax-checkpoint 0.0.1 where process 0 has "
        f"{lead['identity']['packages']['orbax-checkpoint']}); install the same versions on every host")
    assert set(lead["identity"]["packages"]) == {"jax", "jaxlib", "flax", "orbax-checkpoint"}
    assert all(lead["identity"]["packages"].values())


def test_model_files_digest_every_weight_file(tmp_path):
    (tmp_path / "m" / "sub").mkdir(parents=True)
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m" / "sub" / "w.safetensors").write_bytes(b"x")
    digests = multihost.model_files({"model": {"path": str(tmp_path / "m")}})
    assert sorted(digests) == ["model.path/config.json", "model.path/sub/w.safetensors"]
    assert multihost.model_files({"model": {"path": ""}}) == {}


def flat_bucket(monkeypatch):
    """A gcsfuse mount of a flat bucket: renaming a directory fails (files rename fine)."""
    real = os.rename

    def rename(src, dst, *a, **k):
        if Path(src).is_dir():
            raise OSError(errno.ENOTSUP, "Operation not supported", str(src))
        return real(src, dst, *a, **k)
    monkeypatch.setattr(os, "rename", rename)


def test_a_workdir_that_cannot_rename_directories_is_refused_at_start(tmp_path, monkeypatch):
    """Through the pipeline's own start (`jaxrag.pipeline.run.run`): one line naming the workdir and
    what to use instead, before any work, nothing left behind."""
    from jaxrag.pipeline.config import tiny_config
    from jaxrag.pipeline.run import run

    flat_bucket(monkeypatch)
    with pytest.raises(JaxragError) as e:
        run(tiny_config("qwen2"), tmp_path / "w")
    assert str(e.value) == (
        f"workdir {tmp_path / 'w'}: cannot rename a directory (ENOTSUP: Operation not supported), as every stage and "
        "checkpoint does to finish: use a filesystem that can (an NFS mount such as Filestore, or a Cloud Storage "
        "bucket with hierarchical namespace mounted by gcsfuse), not a flat bucket")
    assert not (tmp_path / "w").exists()


def test_the_rename_probe_leaves_nothing(tmp_path):
    multihost.check_renames(tmp_path / "a" / "w")
    assert not (tmp_path / "a").exists()
    (tmp_path / "w").mkdir()
    multihost.check_renames(tmp_path / "w")
    assert list((tmp_path / "w").iterdir()) == []


def test_a_pod_started_without_jaxrag_distributed_is_one_line(monkeypatch, tmp_path):
    """A TPU pod's worker: jax sees the pod's processes, but jax.distributed was never started."""
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    with pytest.raises(JaxragError, match=r"^this is process 1 of 4, but jax.distributed was not started, so the "
                       r"processes cannot agree or wait for each other: set JAXRAG_DISTRIBUTED=1 on every worker "
                       r"\(launch/tpu_vm.sh does\) and relaunch$"):
        multihost.agree_at_start({}, {}, tmp_path / "w")


def test_the_coordinator_port_leaves_room_for_the_watchdogs():
    with pytest.raises(JaxragError, match=r"JAX_COORDINATOR_ADDRESS=h:65535: the port must be 1..65534"):
        join.join("h:65535", 2, 0, {})
    join.check_port("h:65534")


def test_jax_waits_longer_than_the_start_up_timeout_and_the_watchdog(monkeypatch):
    """JAX's own timeouts (which end in a C++ abort and a stack dump) come after ours: joining after
    JAXRAG_STARTUP_TIMEOUT, the heartbeat after the watchdog's silence (itself JAX's default 100 s,
    so a blip JAX rides out does not stop a run)."""
    seen = {}
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.update(kw))
    join.join("h:1234", 2, 1, {"JAXRAG_STARTUP_TIMEOUT": "30"})
    assert seen["initialization_timeout"] > 30 and seen["heartbeat_timeout_seconds"] > join.SILENCE_S >= 100
    with pytest.raises(JaxragError, match="JAXRAG_STARTUP_TIMEOUT='soon': must be a whole number of seconds"):
        join.startup_timeout({"JAXRAG_STARTUP_TIMEOUT": "soon"})


def test_checkpoints_that_cannot_be_removed_are_named(tmp_path, monkeypatch, capsys):
    """`train/stages.py` removes a finished training's checkpoints; one it cannot (another user's
    files on a shared filesystem) is one warning line naming it, not silence."""
    import shutil

    from jaxrag.train import stages

    (tmp_path / "checkpoints" / "3").mkdir(parents=True)

    def refuse(path, *a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(Path(path) / "3"))
    monkeypatch.setattr(shutil, "rmtree", refuse)
    stages._drop_checkpoints(tmp_path)
    assert capsys.readouterr().err.splitlines() == [
        f"warning: could not remove the finished training's checkpoints {tmp_path / 'checkpoints'} (Permission denied: "
        f"{tmp_path / 'checkpoints' / '3'}); remove them by hand to free the space"]


# A program on this process's devices and one over every process's (a psum across them), with the
# persistent cache hits each process saw.
CACHED = """
import sys
from pathlib import Path
from jaxrag.runtime.join import initialize_distributed
initialize_distributed()
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
hits = []
jax.monitoring.register_event_listener(lambda event, **_: hits.append(event)
                                       if event == "/jax/compilation_cache/cache_hits" else None)
local = jax.jit(lambda x: jnp.sin(x) * 3)(jnp.arange(8.0))
mesh = Mesh(np.array(jax.devices()), ("d",))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), np.ones(2, np.float32))
total = jax.jit(lambda x: jnp.sum(x * 2), out_shardings=NamedSharding(mesh, P()))(x)
Path(sys.argv[1]).write_text(f"{len(hits)} {float(total)}")
"""


def test_every_process_of_a_cpu_run_reads_back_the_programs_it_compiled(tmp_path):
    """JAX writes the persistent cache from process 0 only; on the CPU every process's keys are its
    own (`join.cache_from_every_process`), so a relaunch compiles nothing on any process."""
    def launch():
        port, procs = free_ports(), []
        for i in range(2):
            env = process_env(port, i, 2, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
                              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
            procs.append(subprocess.Popen([sys.executable, "-c", CACHED, str(tmp_path / f"{i}.txt")], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], logs
        return [(tmp_path / f"{i}.txt").read_text().split() for i in range(2)]

    first = launch()
    assert [float(t) for _, t in first] == [8.0, 8.0]  # 2 x the 4 ones of both processes' devices
    assert [hits for hits, _ in first] == ["0", "0"]
    # on the relaunch both programs are read back on both processes: the sum, the sine and the
    # small programs their arguments need (JAX's rule alone: process 1 reads none)
    again = launch()
    assert [float(t) for _, t in again] == [8.0, 8.0]
    assert int(again[0][0]) >= 2 and again[0][0] == again[1][0], again
