"""What tests/test_multihost.py builds on: the miniature pipeline of tests/test_pipeline.py as
several processes (`launch/local.sh`, the runtime a pod runs: jax.distributed over a 127.0.0.1
coordinator, gloo collectives), each process's file writes recorded by
tests/write_audit/sitecustomize.py, and a process killed mid-stage by pid."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from pipeline_fixtures import CODE_IDENTITY, MINI_XLA_FLAGS, REPO, mini_overrides

AUDIT = REPO / "tests" / "write_audit"


def train_args(workdir: Path) -> list[str]:
    """The miniature pipeline's command (pipeline_fixtures.mini_config: its mesh's fsdp axis spans
    every device, so with 2 processes x 2 devices each parameter is split across the process
    boundary, and every training step, and every generation and scoring program of an inference
    model placed on the mesh, runs collectives between the processes)."""
    return ["--config", "configs/qwen.py:tiny", "--workdir", str(workdir),
            *(f"--config.{k}={v}" for k, v in mini_overrides().items())]


def free_ports() -> int:
    """A port P with P + 1 free too (the coordinator's and its watchdog hub's)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def audited_env(workdir: Path, audit: Path, **extra) -> dict[str, str]:
    """The test's environment, plus the write audit of every Python process under `workdir`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS"))}
    env.update(PYTHONPATH=os.pathsep.join([str(AUDIT), str(REPO)]), JAXRAG_WRITE_AUDIT_ROOT=str(workdir),
               JAXRAG_WRITE_AUDIT=str(audit), JAX_PLATFORMS="cpu", **extra)
    return env


def process_env(port: int, process: int, processes: int, **extra) -> dict[str, str]:
    """The environment of process `process` of `processes` started by hand on 127.0.0.1:`port`
    (a small program instead of the pipeline): the test's, without its JAX settings, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX")}
    env.update(JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
               JAX_PROCESS_ID=str(process), PYTHONPATH=str(REPO), **extra)
    return env


def launch(workdir: Path, audit: Path, processes: int = 2, devices: int = 2, extra=()) -> subprocess.Popen:
    """`launch/local.sh` as a user runs it (with the miniature pipeline's XLA flags, to which it adds
    its device count); process I logs to workdir/logs/process-I.log."""
    cmd = [str(REPO / "launch" / "local.sh"), "--processes", str(processes), "--devices-per-process", str(devices),
           "--port", str(free_ports()), "--python", sys.executable, *train_args(workdir), *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=audited_env(workdir, audit, XLA_FLAGS=MINI_XLA_FLAGS),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def log(workdir: Path, process: int) -> str:
    path = workdir / "logs" / f"process-{process}.log"
    return path.read_text(errors="replace").replace("\r", "\n") if path.exists() else ""


def pid_of(process: int, audit: Path) -> int | None:
    """The pid of the run's process `process` (its environment names the test's audit folder)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"jaxrag.train" in cmd and f"JAXRAG_WRITE_AUDIT={audit}".encode() in env \
                and f"JAX_PROCESS_ID={process}".encode() in env:
            return int(entry.name)
    return None


def kill_during(proc: subprocess.Popen, workdir: Path, audit: Path, ready, victim: int, timeout: float = 1800) -> dict:
    """Waits until `ready()` (a stage is under way: a file it writes exists), kills process
    `victim` with SIGKILL and measures how long the launcher takes to exit after it."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the launch ended or timed out first:\n{log(workdir, 0)[-3000:]}")
        time.sleep(0.2)
    pid = pid_of(victim, audit)
    assert pid is not None, f"process {victim} not found"
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("the surviving process did not stop within 120 s of the kill") from None
    return {"seconds": time.monotonic() - killed, "returncode": proc.returncode, "stderr": err}


def audit_writes(audit: Path) -> dict[str, set[str]]:
    """relative path -> the process ids that wrote, renamed or removed it."""
    writers: dict[str, set[str]] = {}
    for f in audit.glob("process-*.tsv"):
        process = f.name.split("-")[1]
        for line in f.read_text().splitlines():
            event, *paths = line.split("\t")
            for path in paths:
                if path != "-":
                    writers.setdefault(path, set()).add(process)
    return writers


# Not compared: wall-clock times, the code identity (pipeline_fixtures.CODE_IDENTITY), and how a
# stage placed its generation model (W/inputs/<stage>.json's "placement": the devices differ).
UNCOMPARED = ("phases", "seconds", "placement", *CODE_IDENTITY)


def same_results(a, b, atol: float, path: str = "") -> None:
    """Every field of two results.json (or provenance records) equal, floats within `atol`, but
    for the `UNCOMPARED` and latency fields."""
    if isinstance(a, dict):
        assert set(a) - set(UNCOMPARED) == set(b) - set(UNCOMPARED), path
        for k in a:
            if "latency" not in k and k not in UNCOMPARED and not k.startswith("T_"):
                same_results(a[k], b[k], atol, f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same_results(x, y, atol, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert abs(a - b) <= atol or (np.isnan(a) and np.isnan(b)), f"{path}: {a} != {b}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
