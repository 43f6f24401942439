"""Joining a multi-host run: `initialize_distributed`, first thing in every process of a run.

`jax.distributed.initialize` is bounded by a start-up timeout (`JAXRAG_STARTUP_TIMEOUT`, default
300 s): a process that cannot join stops with one line and exit status 2, where JAX would wait
its own 300 s, then abort with a C++ stack dump. Process 0 serves JAX's coordination service from
a child process (`jaxrag.runtime.coordinator`) when the launcher names the coordinator, so that
its death is reported by the others' watchdogs with one line (`jaxrag.runtime.multihost`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

import jax
from jax._src import compiler, distributed  # the persistent cache's writer (`cache_from_every_process`)

from jaxrag.errors import JaxragError

# A peer whose heartbeat stalls this long is lost: JAX's own default, so that a network blip JAX
# rides out does not stop a run; JAX's heartbeat is given longer (`join`), so that this line comes first.
SILENCE_S = 100.0
STARTUP_TIMEOUT_S = 300  # default of JAXRAG_STARTUP_TIMEOUT: joining, and the checks at start


def is_multihost_launch(env: Mapping[str, str] = os.environ) -> bool:
    """True when the launcher started several processes: JAXRAG_DISTRIBUTED=1 (explicit
    opt-in, e.g. on a TPU pod slice), JAX_COORDINATOR_ADDRESS, SLURM, Open MPI, or
    TPU_WORKER_HOSTNAMES listing several workers. JAXRAG_DISTRIBUTED=0 is one process whatever
    the environment says (launch/gpu_single.sh: inside an sbatch of several tasks, SLURM_NTASKS
    describes the job, not this process)."""
    def count(name):
        try:
            return int(env.get(name, "1"))
        except ValueError:
            return 1
    if env.get("JAXRAG_DISTRIBUTED") == "0":
        return False
    return env.get("JAXRAG_DISTRIBUTED") == "1" or bool(env.get("JAX_COORDINATOR_ADDRESS")) \
        or count("SLURM_NTASKS") > 1 \
        or count("OMPI_COMM_WORLD_SIZE") > 1 or "," in env.get("TPU_WORKER_HOSTNAMES", "")


def initialize_distributed(env: Mapping[str, str] = os.environ) -> bool:
    """Calls `jax.distributed.initialize()` once on multi-host launches; must run before any other
    JAX call. JAX_NUM_PROCESSES / JAX_PROCESS_ID override cluster auto-detection. On CPU devices
    the processes' collectives go over gloo (TCP), as on one machine running several processes.
    Joining is bounded by JAXRAG_STARTUP_TIMEOUT (`join`); a process that
    cannot join exits with one `error:` line and status 2."""
    if not is_multihost_launch(env) or jax.distributed.is_initialized():
        return False
    num = env.get("JAX_NUM_PROCESSES")
    pid = env.get("JAX_PROCESS_ID")
    if env.get("JAX_PLATFORMS") == "cpu":  # CPU devices of several processes: collectives over TCP
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        cache_from_every_process()
    try:
        for name, value in (("JAX_NUM_PROCESSES", num), ("JAX_PROCESS_ID", pid)):
            if value is not None and not value.isdigit():
                raise JaxragError(f"{name}={value!r}: must be a whole number")
        join(env.get("JAX_COORDINATOR_ADDRESS"), int(num) if num else None, int(pid) if pid else None, env)
    except JaxragError as e:  # before the CLI's own error handling: one line, not a traceback
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return True


def cache_from_every_process() -> None:
    """Every process of a CPU run writes the compiled programs it misses to the persistent cache,
    not process 0 alone. JAX writes from process 0 only, so that processes compiling one program
    under one key do not all write it (contention on shared filesystems, e.g. GCS). On the CPU no
    two processes share a key (it hashes the devices' topology and assignment, which name the
    process), so each process's entries are its own; with JAX's rule every other process of a
    local launch (`launch/local.sh`) compiled every program again at every launch, each resume
    after a failure included. JAX's own write runs, with its checks (host callbacks, the minimum
    compile time), as if from process 0: JAX reads the process id elsewhere only when it creates
    a backend."""
    write = compiler._cache_write

    def every_process(*args, **kwargs):
        own, distributed.global_state.process_id = distributed.global_state.process_id, 0
        try:
            return write(*args, **kwargs)
        finally:
            distributed.global_state.process_id = own
    compiler._cache_write = every_process


def startup_timeout(env=os.environ) -> int:
    """Seconds every process has to join the run and pass the start checks (JAXRAG_STARTUP_TIMEOUT)."""
    value = env.get("JAXRAG_STARTUP_TIMEOUT", str(STARTUP_TIMEOUT_S))
    if not value.isdigit() or int(value) < 1:
        raise JaxragError(f"JAXRAG_STARTUP_TIMEOUT={value!r}: must be a whole number of seconds "
                          f"(default {STARTUP_TIMEOUT_S})")
    return int(value)


def check_port(address: str, variable: str = "JAX_COORDINATOR_ADDRESS") -> None:
    """The coordinator's port P: its watchdogs' hub listens at P + 1, so P must be below 65535."""
    _, _, port = address.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65535:
        raise JaxragError(f"{variable}={address}: the port must be 1..65534 (the run's watchdogs listen "
                          "one port above it); pick another port")


def join(address: str | None, processes: int | None, process: int | None, env=os.environ) -> None:
    """`jax.distributed.initialize`, or one line and exit status 2 when this process cannot join
    within `startup_timeout()`: JAX would wait its own 300 s, then abort with a C++ stack dump.
    A timer thread watches the join (JAX's connect releases the GIL); JAX's own timeouts are set
    beyond ours (its heartbeat also beyond the watchdog's `SILENCE_S`), so our line comes first."""
    timeout = startup_timeout(env)
    if address:
        check_port(address)
    who = "process" if process is None else f"process {process} of {processes}"

    def give_up():
        where = address or "the address JAX found"
        up = _reachable(address) if address else False
        why = ("its coordinator is up but not every process joined: a host did not start the command, or "
               "failed or was killed at start" if up else "the coordinator (process 0) is not listening there: "
               "it did not start, died, or the address or port is unreachable from this host")
        print(f"\nerror: {who} could not join the run at {where} within {timeout} s (JAXRAG_STARTUP_TIMEOUT): "
              f"{why}; see every host's log, then relaunch the same command on every host", file=sys.stderr, flush=True)
        os._exit(2)

    timer = threading.Timer(timeout, give_up)
    timer.daemon = True
    timer.start()
    heartbeat = int(max(2 * SILENCE_S, timeout + 60))
    try:
        if process == 0 and address and processes:  # the coordinator in a child that outlives this process
            _serve_and_connect(address, processes, timeout + 60, heartbeat, env)
        else:
            jax.distributed.initialize(coordinator_address=address, num_processes=processes, process_id=process,
                                       initialization_timeout=timeout + 60, heartbeat_timeout_seconds=heartbeat)
    except (ValueError, TypeError, RuntimeError) as e:  # no cluster found, bad values: before any wait
        raise JaxragError(f"{who} could not start jax.distributed ({e}): set JAX_COORDINATOR_ADDRESS, "
                          "JAX_NUM_PROCESSES and JAX_PROCESS_ID (launch/gpu_multihost.sh env prints them)") from None
    finally:
        timer.cancel()


_coordinator: dict[str, subprocess.Popen] = {}


def coordinator_child() -> subprocess.Popen | None:
    """Process 0's coordinator child (`_serve_and_connect`), once started."""
    return _coordinator.get("child")


def _serve_and_connect(address: str, processes: int, init_timeout: int, heartbeat: int, env) -> None:
    """Process 0's join: JAX's coordination service in a child process (`jaxrag.runtime.coordinator`,
    which outlives this process long enough for the others' watchdogs to report its loss with one
    line), then this process joins it as every other process does (what `jax.distributed.initialize`
    does after starting the service in-process). The port must be free first: a coordinator of an
    earlier run that lost its process 0 holds it for its grace period."""
    from jax._src import distributed  # what jax.distributed.initialize fills in: no public API for it
    from jax._src.lib import _jax  # as above

    port = int(address.rsplit(":", 1)[1])
    bind = env.get("JAX_COORDINATOR_BIND_ADDRESS", f"[::]:{port}")
    deadline = time.monotonic() + 60
    while not _port_free(port):
        if time.monotonic() > deadline:
            raise JaxragError(f"port {port} (the coordinator's) stayed in use for 60 s: another run or program holds "
                              "it; stop it, or choose another --port")
        time.sleep(0.5)
    child = subprocess.Popen([sys.executable, "-m", "jaxrag.runtime.coordinator", "--bind", bind, "--processes",
                              str(processes), "--heartbeat", str(heartbeat)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    if child.stdout.readline().strip() != b"ready":
        raise JaxragError(f"the coordinator could not listen at {bind} (exit status {child.wait()}); choose another "
                          "--port")
    _coordinator["child"] = child  # its stdin stays open while this process lives
    state = distributed.global_state
    state.coordinator_address, state.process_id, state.num_processes = address, 0, processes
    state.client = _jax.get_distributed_runtime_client(address, 0, init_timeout=init_timeout, use_compression=True,
                                                        heartbeat_timeout=heartbeat)
    state.client.connect()
    state.initialize_preemption_sync_manager()


def _port_free(port: int) -> bool:
    """No socket listens on `port` (connections of an earlier run closing there do not count)."""
    with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def _reachable(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=3):
            return True
    except (OSError, ValueError):
        return False
