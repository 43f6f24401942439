"""The launchers run for real: launch/gpu_multihost.sh (slurm, mpirun with Open MPI 4's and 5's
environments) and launch/tpu_vm.sh, through fake `srun`, `mpirun` and `gcloud` (tests/fakes) first on
PATH, which start N local processes with the variables the real ones give each task, rank or TPU
worker. Every process runs the launchers' `--check` (`python -m jaxrag.runtime.multihost`:
jax.distributed over 127.0.0.1 with gloo, the start checks on a shared workdir, a barrier and an
allgather) and exits 0; for 2 and 4 processes. A rerun of the TPU launch on the existing VM
resumes it, and each TPU worker keeps its own log."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multihost_fixtures import free_ports

ROOT = Path(__file__).resolve().parents[1]
FAKES = ROOT / "tests" / "fakes"


def fake_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "OMPI_", "PMIX_", "JAXRAG_"))}
    env.update(PATH=f"{FAKES}{os.pathsep}{env['PATH']}", JAX_PLATFORMS="cpu", FAKE_GCLOUD_ROOT=str(tmp_path / "gcloud"),
               FAKE_PYTHON=sys.executable, XLA_FLAGS="--xla_force_host_platform_device_count=1", **extra)
    return env


def launch(script, args, env, timeout=120):
    return subprocess.run([str(ROOT / "launch" / script), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def joined(n: int) -> set[str]:
    """Each process's line from `python -m jaxrag.runtime.multihost`: all n joined, one device each."""
    return {f"process {i} of {n}: joined; {n} devices on processes {list(range(n))}" for i in range(n)}


def lines_joined(out: str) -> set[str]:
    return {line.split("; workdir")[0] for line in out.splitlines() if ": joined;" in line}


@pytest.mark.parametrize("n", [2, 4])
def test_slurm_through_srun(n, tmp_path):
    """Inside an allocation (SLURM_JOB_ID, a GPU per node as SLURM_GPUS_ON_NODE says): the port
    comes from the job id (20000 + SLURM_JOB_ID % 40000), the GPUs from SLURM_GPUS_ON_NODE."""
    port = free_ports()
    while not 20000 <= port < 60000:
        port = free_ports()
    env = fake_env(tmp_path, SLURM_JOB_ID=str(port - 20000 + 40000), FAKE_GPUS_ON_NODE="1")
    proc = launch("gpu_multihost.sh", ["slurm", "--hosts", str(n), "--check", "--workdir", str(tmp_path / "w"),
                                       "--python", sys.executable], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert lines_joined(proc.stdout) == joined(n), proc.stdout


def test_slurm_without_gpus_on_node_is_one_line_per_task(tmp_path):
    env = fake_env(tmp_path, SLURM_JOB_ID="7")
    proc = launch("gpu_multihost.sh", ["slurm", "--hosts", "2", "--check", "--workdir", str(tmp_path / "w")], env)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: SLURM_GPUS_ON_NODE is not set on "
                      f"{os.uname().nodename} (an allocation without --gpus-per-node): pass --gpus-per-host G"] * 2


@pytest.mark.parametrize("version,n", [("4", 2), ("5", 4)])
def test_mpirun_open_mpi_4_and_5(version, n, tmp_path):
    """Each rank takes its id and count from OMPI_COMM_WORLD_RANK / _SIZE, which Open MPI 4 and 5
    both set (JAX's own detection needs Open MPI 4's OMPI_MCA_orte_hnp_uri); the coordinator is
    the hostfile's first host."""
    port = free_ports()
    (tmp_path / "hosts").write_text("# one slot per node\n127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    env = fake_env(tmp_path, FAKE_OMPI_VERSION=version)
    proc = launch("gpu_multihost.sh", ["mpirun", "--hosts", str(n), "--hostfile", str(tmp_path / "hosts"),
                                       "--port", str(port), "--check", "--workdir", str(tmp_path / "w"),
                                       "--python", sys.executable], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert f"-x JAX_COORDINATOR_ADDRESS=127.0.0.1:{port}" in proc.stderr
    assert lines_joined(proc.stdout) == joined(n), proc.stdout


def wait_for_workers(vm: Path, n: int, timeout: float = 120) -> dict[int, tuple[str, str]]:
    """Each TPU worker's (exit status, log) once every worker's run has ended (it runs detached)."""
    deadline = time.monotonic() + timeout
    status = {i: vm / f"worker-{i}" / "jaxrag-run.status" for i in range(n)}
    while not all(p.exists() and p.read_text().strip() for p in status.values()):
        if time.monotonic() > deadline:
            for i in range(n):  # the runs' own process groups, by the pid files the launcher wrote
                pid = (vm / f"worker-{i}" / "jaxrag-run.pid").read_text().strip()
                subprocess.run(["kill", "-9", "--", f"-{pid}"], capture_output=True)
            raise AssertionError(f"the workers did not finish: {[(vm / f'worker-{i}' / 'jaxrag-run.log').read_text()[-2000:] for i in range(n)]}")
        time.sleep(0.2)
    return {i: (p.read_text().strip(), (vm / f"worker-{i}" / "jaxrag-run.log").read_text()) for i, p in status.items()}


@pytest.mark.parametrize("accel,n", [("v4-16", 2), ("v4-32", 4)])
def test_tpu_vm_through_gcloud_and_rerun_resumes(accel, n, tmp_path):
    """`tpu_vm.sh` creates the slice and starts every worker's command detached (nohup), each
    logging to its own ~/jaxrag-run.log and leaving its status in ~/jaxrag-run.status; the same
    command again (the v4-16 case) finds the VM, reuses it instead of failing at create, and runs again."""
    args = ["--name", "jr", "--zone", "us-central2-b", "--accelerator-type", accel, "--no-install", "--check",
            "--workdir", str(tmp_path / "w")]
    vm = tmp_path / "gcloud" / "jr"
    for attempt in range(2 if n == 2 else 1):
        proc = launch("tpu_vm.sh", args, fake_env(tmp_path, FAKE_TPU_PORT=str(free_ports())))
        assert proc.returncode == 0, proc.stderr
        assert ("TPU VM jr exists in us-central2-b: reusing it" in proc.stderr) == (attempt == 1), proc.stderr
        workers = wait_for_workers(vm, n)
        assert sorted(p.name for p in vm.iterdir()) == [f"worker-{i}" for i in range(n)]
        for i, (status, log) in workers.items():
            assert status == "0", log[-3000:]
            mine = [line.split("; workdir")[0] for line in log.splitlines() if ": joined;" in line]
            assert mine == [f"process {i} of {n}: joined; {n} devices on processes {list(range(n))}"] * (attempt + 1)
