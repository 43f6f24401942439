"""What the processes of one multi-host run agree on, and how a lost process stops the others.

Every process of a run issues the same collectives in the same order (one program, SPMD); on top
of JAX's runtime (`jax.distributed`) the pipeline adds:

- `agree_at_start`: before any work, every process publishes, in the coordinator's key-value
  store, what it was started with (the config, the digests of the files it reads, whether it
  sees a token process 0 wrote into the workdir); a process whose view differs from process 0's
  is refused, by every process, with one line.
- `start_watchdog`: a child process beside each process (`jaxrag.runtime.watchdog`) that stops it with
  one line naming the lost process and the stage it was in (`stage`) when a peer dies or fails:
  a process blocked in a collective whose peer died would wait for ever, deaf to its own
  threads, and JAX's own heartbeat timeout (100 s) aborts with a stack trace.
- `report_failure`: a process that fails tells its watchdog before it exits, so its peers name
  its error instead of waiting for its silence.
- `barrier`: every process reaches a point before any goes on (before and after each stage).

In a single-process run every function here is a no-op.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import jax

from jaxrag.errors import FAILURE_HOOKS, JaxragError

SILENCE_S = 20.0  # a peer whose heartbeat stalls this long is lost (JAX's own timeout is 100 s)
BARRIER_TIMEOUT_MS = 7 * 24 * 3600 * 1000  # a barrier outwaits any stage: a lost peer is the watchdog's
_PREFIX = "jaxrag"
_watchdog: dict[str, subprocess.Popen] = {}


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_leader() -> bool:
    """Process 0 writes every shared file; the others compute beside it and write nothing."""
    return jax.process_index() == 0


def _client():
    from jax._src import distributed  # the coordinator's key-value store: no public API holds it

    return distributed.global_state


def barrier(name: str) -> None:
    """Every process reaches this point before any goes on: a barrier of the coordinator's
    key-value service (`name` is unique in a run), which waits as long as the slowest process
    works; a lost process is the watchdog's to report. Not a device collective: processes reach a
    barrier minutes apart (process 0 alone runs some stages; the fit check compiles), and on CPU
    devices the first collective over a set of devices gives its peers 30 s to join (gloo's
    rendezvous), so a barrier that was the run's first collective failed the run."""
    if is_multiprocess():
        _client().client.wait_at_barrier(f"{_PREFIX}/barrier/{name}", BARRIER_TIMEOUT_MS)


def _tell(line: str) -> None:
    if (child := _watchdog.get("child")) is not None:
        try:
            child.stdin.write((line.replace("\n", " ") + "\n").encode())
            child.stdin.flush()
        except OSError:  # the watchdog is gone: it has already stopped this process, or will
            pass


@contextmanager
def stage(name: str):
    """Names the stage the watchdog reports if a peer is lost inside the block."""
    _tell(f"stage {name}")
    yield


def start_watchdog() -> None:
    """Starts this process's watchdog (`jaxrag.runtime.watchdog`); its hub listens at the coordinator's
    host, one port above the coordinator's."""
    if not is_multiprocess() or "child" in _watchdog:
        return
    host, port = _client().coordinator_address.rsplit(":", 1)
    _watchdog["child"] = subprocess.Popen(
        [sys.executable, "-m", "jaxrag.runtime.watchdog", "--process", str(jax.process_index()),
         "--processes", str(jax.process_count()), "--parent", str(os.getpid()), "--host", host,
         "--port", str(int(port) + 1), "--silence", str(SILENCE_S)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    FAILURE_HOOKS.append(report_failure)


def finish() -> None:
    """At the end of a run: every process is done before any stops watching the others."""
    if is_multiprocess():
        barrier("finished")
        _tell("finished")


def report_failure(message: str) -> None:
    """This process is about to exit with `message`: its peers stop with that line, not a timeout."""
    _tell(f"failed {message}")


def file_digest(path: Path, whole_below: int = 256 << 20) -> str:
    """sha256 of a file; of its size, first and last 16 MiB when larger than `whole_below` (a
    Wikipedia passage file is 13 GB: every host would read it whole at every start)."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size < whole_below:
            return hashlib.file_digest(f, "sha256").hexdigest()
        h.update(str(size).encode())
        h.update(f.read(16 << 20))
        f.seek(size - (16 << 20))
        h.update(f.read())
    return h.hexdigest()


def agree_at_start(config: dict, files: dict[str, str], workdir: Path) -> None:
    """Refuses, in every process at once, a process started differently from process 0: another
    config (seed, override), another view of a data file, or a workdir that is not the one
    process 0 writes (not shared storage, or another path)."""
    if not is_multiprocess():
        return
    client, me, n = _client().client, jax.process_index(), jax.process_count()
    token_file = Path(workdir) / ".jaxrag-process-0"
    if me == 0:
        token = os.urandom(8).hex()
        Path(workdir).mkdir(parents=True, exist_ok=True)
        token_file.write_text(token)
        client.key_value_set(f"{_PREFIX}/start/token", token)
    token = client.blocking_key_value_get(f"{_PREFIX}/start/token", 600_000)
    try:
        sees = token_file.read_text() == token
    except OSError:
        sees = False
    view = {"config": config, "files": files, "workdir": str(workdir), "sees_workdir": sees}
    client.key_value_set(f"{_PREFIX}/start/{me}", json.dumps(view, sort_keys=True, default=str))
    views = {p: json.loads(client.blocking_key_value_get(f"{_PREFIX}/start/{p}", 600_000)) for p in range(n)}
    client.wait_at_barrier(f"{_PREFIX}/start/read", 600_000)  # every view read before process 0 goes on
    if me == 0:
        token_file.unlink()
    for p in range(1, n):
        if problem := _differs(views[0], views[p]):
            raise JaxragError(f"process {p} of {n} {problem}; start every process with the same command, "
                              "config files and data")


def _differs(lead: dict, other: dict) -> str:
    if not other["sees_workdir"]:
        return (f"does not see the workdir process 0 writes ({lead['workdir']}): the workdir must be one shared "
                "directory at the same path on every host")
    if other["config"] != lead["config"]:
        fields = sorted(_changed(lead["config"], other["config"]))
        return f"was started with another config than process 0's ({', '.join(fields[:5])} differ)"
    if other["files"] != lead["files"]:
        names = sorted(k for k in set(lead["files"]) | set(other["files"])
                       if lead["files"].get(k) != other["files"].get(k))
        return f"sees other data than process 0 ({', '.join(names)} differ by content)"
    return ""


def _changed(a, b, prefix: str = ""):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in set(a) | set(b):
            yield from _changed(a.get(k), b.get(k), f"{prefix}{k}.")
    elif a != b:
        yield prefix.rstrip(".")
