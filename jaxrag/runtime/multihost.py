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
- `agree_on_plan`: every process plans the same stages (each decides from its own view of the
  workdir what is done; a shared filesystem's caches can make the views differ).
- `barrier`: every process reaches a point before any goes on (before and after each stage).
- `leader_check`: a check every process would compute alike (the fit check compiles every
  program) is run by process 0 alone, and every process passes or stops with its line.
- joining the run is `jaxrag.runtime.join`'s (`initialize_distributed`, first thing in a process).

In a single-process run every function here is a no-op, but the workdir's rename probe
(`check_renames`). `python -m jaxrag.runtime.multihost --workdir DIR` (the launchers' `--check`)
runs the start of a run without the pipeline: join, agree, a barrier and an allgather.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxrag.errors import FAILURE_HOOKS, SETTLE_HOOKS, JaxragError, run
from jaxrag.runtime import join
from jaxrag.runtime.join import SILENCE_S, check_port, startup_timeout

PACKAGES = ("jax", "jaxlib", "flax", "orbax-checkpoint")  # compared at start, with jaxrag's source
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

    state = distributed.global_state
    if state.client is None:  # several processes, but no jax.distributed: a pod started without it
        raise JaxragError(f"this is process {jax.process_index()} of {jax.process_count()}, but jax.distributed "
                          "was not started, so the processes cannot agree or wait for each other: set "
                          "JAXRAG_DISTRIBUTED=1 on every worker (launch/tpu_vm.sh does) and relaunch")
    return state


def barrier(name: str, processes: Sequence[int] | None = None) -> None:
    """Every process reaches this point before any goes on: a barrier of the coordinator's
    key-value service (`name` is unique in a run), which waits as long as the slowest process
    works; a lost process is the watchdog's to report. Not a device collective: processes reach a
    barrier minutes apart (process 0 alone runs some stages; the fit check compiles), and on CPU
    devices the first collective over a set of devices gives its peers 30 s to join (gloo's
    rendezvous), so a barrier that was the run's first collective failed the run. `processes`:
    the processes that meet (all of them by default); each of them passes the same list."""
    if is_multiprocess():
        ids = None if processes is None or len(processes) == jax.process_count() else list(processes)
        _client().client.wait_at_barrier(f"{_PREFIX}/barrier/{name}", BARRIER_TIMEOUT_MS, ids)


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
    address = _client().coordinator_address
    check_port(address, "the coordinator address")
    host, port = address.rsplit(":", 1)
    _watchdog["child"] = subprocess.Popen(
        [sys.executable, "-m", "jaxrag.runtime.watchdog", "--process", str(jax.process_index()),
         "--processes", str(jax.process_count()), "--parent", str(os.getpid()), "--host", host,
         "--port", str(int(port) + 1), "--silence", str(SILENCE_S),
         "--join", str(startup_timeout())],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    FAILURE_HOOKS.append(report_failure)
    SETTLE_HOOKS.append(settle)
    if (coordinator := join.coordinator_child()) is not None:  # from now on a loss is reported: it may outlive us
        coordinator.stdin.write(b"watched\n")
        coordinator.stdin.flush()


def finish() -> None:
    """At the end of a run: every process is done before any stops watching the others."""
    if is_multiprocess():
        barrier("finished")
        _tell("finished")


# How long a process whose code raised waits before it reports the error itself: an error raised
# in a collective whose peer died is that loss, which this process's watchdog reports (one line,
# then it stops the process) within a few seconds.
SETTLE_S = 8.0


def settle() -> None:
    """Before this process reports an unexpected error: time for its watchdog to report a lost peer
    instead (which stops this process), since a collective fails as soon as a peer is gone."""
    time.sleep(SETTLE_S)


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


def _stop(message: str) -> None:
    """One line and exit status 2, now: a peer is gone, and JAX's exit would wait for it."""
    print(f"\nerror: {message}", file=sys.stderr, flush=True)
    os._exit(2)


def _get(client, key: str, what: str) -> str:
    timeout = startup_timeout()
    try:
        return client.blocking_key_value_get(key, timeout * 1000)
    except Exception:  # JAX's timeout, or the coordinator gone
        _stop(f"process {jax.process_index()} of {jax.process_count()} waited {timeout} s "
              f"(JAXRAG_STARTUP_TIMEOUT) for {what}: that process stopped or hangs at start; see its log, "
              "then relaunch the same command on every host")


def _wait(client, name: str) -> None:
    timeout = startup_timeout()
    try:
        client.wait_at_barrier(f"{_PREFIX}/{name}", timeout * 1000)
    except Exception:
        _stop(f"process {jax.process_index()} of {jax.process_count()}: not every process reached '{name}' within "
              f"{timeout} s (JAXRAG_STARTUP_TIMEOUT); see every host's log, then relaunch the same command")


def check_renames(workdir: Path) -> None:
    """Renames a directory holding a file inside `workdir`, as every stage does to finish (and
    orbax to commit a checkpoint): a workdir that cannot (a Cloud Storage bucket of flat
    namespace mounted by gcsfuse, say) is refused now, not at the first save hours in. Leaves
    nothing behind, not even `workdir` when it did not exist."""
    workdir = Path(workdir)
    made = [d for d in (workdir, *workdir.parents) if not d.exists()]
    probe = workdir / f".jaxrag-rename-probe-{os.getpid()}"
    try:
        (probe / "a").mkdir(parents=True)
        (probe / "a" / "f").write_text("probe")
        os.rename(probe / "a", probe / "b")
        renamed = (probe / "b" / "f").read_text() == "probe"
    except OSError as e:
        why = f"{errno.errorcode.get(e.errno, 'error')}: {e.strerror or e}"
        renamed = False
    else:
        why = "the renamed directory lost its file"
    try:
        shutil.rmtree(probe, ignore_errors=False)
        for d in made:
            d.rmdir()
    except OSError as e:
        print(f"warning: could not remove the rename probe {probe}: {e}", file=sys.stderr)
    if not renamed:
        raise JaxragError(f"workdir {workdir}: cannot rename a directory ({why}), as every stage and checkpoint "
                          "does to finish: use a filesystem that can (an NFS mount such as Filestore, or a Cloud "
                          "Storage bucket with hierarchical namespace mounted by gcsfuse), not a flat bucket")


def identity() -> dict:
    """The code a process runs: jaxrag's source digest (every .py of the package, as `plan/fit.py`
    hashes it), its git commit where it runs from a checkout (shown, not compared: the source
    is), and the versions of `PACKAGES`."""
    package = Path(__file__).resolve().parents[1]
    source = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        source.update(str(path.relative_to(package)).encode() + path.read_bytes())
    try:
        git = subprocess.run(["git", "-C", str(package), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=60)
        commit = git.stdout.strip() if git.returncode == 0 else None
    except OSError:
        commit = None
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {"source": source.hexdigest(), "commit": commit, "packages": versions}


def model_files(config: dict) -> dict[str, str]:
    """Digest of every file of the local model the config reads (`model.path`: a directory, or a
    GGUF file), keyed `model.path/<file>`; nothing for an embedded model or a hub name."""
    path = Path(str((config.get("model") or {}).get("path") or ""))
    if not str(path) or str(path) == ".":
        return {}
    if path.is_file():
        return {"model.path": file_digest(path)}
    if not path.is_dir():
        return {}
    return {f"model.path/{f.relative_to(path)}": file_digest(f) for f in sorted(path.rglob("*"))
            if f.is_file() and not any(part.startswith(".") for part in f.relative_to(path).parts)}


def agree_at_start(config: dict, files: dict[str, str], workdir: Path) -> None:
    """Refuses a workdir that cannot rename directories (`check_renames`, by process 0) and, in
    every process at once, a process started differently from process 0: another config (seed,
    override), another view of a data file or of the model's weights (a file missing, or other
    content), other jaxrag code or packages (`identity`), or a workdir that is not the one process
    0 writes (not shared storage, or another path). A process that does not show up within the
    start-up timeout stops the others with one line."""
    if not is_multiprocess():
        check_renames(workdir)
        return
    client, me, n = _client().client, jax.process_index(), jax.process_count()
    token_file = Path(workdir) / ".jaxrag-process-0"
    if me == 0:
        try:
            check_renames(workdir)
        except JaxragError as e:
            client.key_value_set(f"{_PREFIX}/start/token", f"!{e}")  # every process stops with the line
            raise
        token = os.urandom(8).hex()
        Path(workdir).mkdir(parents=True, exist_ok=True)
        token_file.write_text(token)
        client.key_value_set(f"{_PREFIX}/start/token", token)
    token = _get(client, f"{_PREFIX}/start/token", "process 0's start")
    if token.startswith("!"):
        raise JaxragError(token[1:])
    try:
        sees = token_file.read_text() == token
    except OSError:
        sees = False
    view = {"config": config, "files": {**files, **model_files(config)}, "workdir": str(workdir),
            "sees_workdir": sees, "identity": identity()}
    client.key_value_set(f"{_PREFIX}/start/{me}", json.dumps(view, sort_keys=True, default=str))
    views = {p: json.loads(_get(client, f"{_PREFIX}/start/{p}", f"process {p}'s start")) for p in range(n)}
    _wait(client, "start/read")  # every view read before process 0 goes on
    if me == 0:
        token_file.unlink()
    for p in range(1, n):
        if problem := _differs(views[0], views[p]):
            raise JaxragError(f"process {p} of {n} {problem}")


def leader_check(name: str, check: Callable[[], None]) -> None:
    """`check()` on process 0 alone, for a verdict every process of a run shares (alike hosts);
    every process then raises the `JaxragError` it raised, or goes on. The others wait for it as
    long as a barrier does (a lost process 0 is the watchdog's to report)."""
    if not is_multiprocess():
        return check()
    client, key = _client().client, f"{_PREFIX}/check/{name}"
    if is_leader():
        try:
            check()
            verdict = "ok"
        except JaxragError as e:
            verdict = f"!{e}"
        client.key_value_set(key, verdict)
    else:
        verdict = client.blocking_key_value_get(key, BARRIER_TIMEOUT_MS)
    if verdict.startswith("!"):
        _tell("finished")  # every process refuses alike: no watchdog reports it as a peer's loss
        raise JaxragError(verdict[1:])


def agree_on_plan(names, steps) -> None:
    """Every process plans the same action for every stage (`provenance.plan`'s steps), each from
    its own view of the workdir; where one does not (a shared filesystem's cache showed it
    another workdir), every process stops with one line naming the stage and the process, instead
    of one skipping a stage while the others wait for it at its barrier."""
    if not is_multiprocess():
        return
    client, me, n = _client().client, jax.process_index(), jax.process_count()
    plan = [[name, step.action] for name, step in zip(names, steps)]
    client.key_value_set(f"{_PREFIX}/plan/{me}", json.dumps(plan))
    plans = {p: json.loads(_get(client, f"{_PREFIX}/plan/{p}", f"process {p}'s plan")) for p in range(n)}
    _wait(client, "plan/read")
    for p in range(1, n):
        for (name, lead), (_, other) in zip(plans[0], plans[p]):
            if lead != other:
                _tell("finished")  # every process refuses alike: no watchdog reports it as a peer's loss
                raise JaxragError(
                    f"process {p} of {n} plans stage '{name}' as '{other}' where process 0 plans '{lead}': they "
                    "see the workdir differently (a shared filesystem's cache); turn its caching off (NFS: mount "
                    "with lookupcache=none,actimeo=0) and relaunch the same command")


def _differs(lead: dict, other: dict) -> str:
    same = "; start every process with the same command, config files and data"
    if not other["sees_workdir"]:
        return (f"does not see the workdir process 0 writes ({lead['workdir']}): the workdir must be one shared "
                f"directory at the same path on every host{same}")
    a, b = lead["identity"], other["identity"]
    if a["source"] != b["source"]:
        return (f"runs other jaxrag code than process 0 (source {b['source'][:12]}, commit {b['commit']}, where "
                f"process 0 has {a['source'][:12]}, commit {a['commit']}); install the same jaxrag on every host")
    if changed := [f"{k} {b['packages'].get(k)} where process 0 has {v}" for k, v in a["packages"].items()
                   if b["packages"].get(k) != v]:
        return f"has other packages than process 0 ({', '.join(changed)}); install the same versions on every host"
    if other["config"] != lead["config"]:
        fields = sorted(_changed(lead["config"], other["config"]))
        return f"was started with another config than process 0's ({', '.join(fields[:5])} differ){same}"
    mine, theirs = lead["files"], other["files"]
    if missing := sorted(set(mine) - set(theirs)):
        return f"does not find {', '.join(missing[:5])}, which process 0 reads (a file missing on its host){same}"
    if extra := sorted(set(theirs) - set(mine)):
        return f"finds {', '.join(extra[:5])}, which process 0 does not (a file missing on process 0's host){same}"
    if names := sorted(k for k in mine if mine[k] != theirs[k]):
        what = "model weights" if all(k.startswith("model.path") for k in names) else "data"
        return f"sees other {what} than process 0 ({', '.join(names[:5])} differ by content){same}"
    return ""


def _changed(a, b, prefix: str = ""):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in set(a) | set(b):
            yield from _changed(a.get(k), b.get(k), f"{prefix}{k}.")
    elif a != b:
        yield prefix.rstrip(".")


def main(argv=None) -> None:
    """`python -m jaxrag.runtime.multihost --workdir DIR`: what a run does before its first stage,
    without the pipeline (join, the start checks, the watchdogs), then a barrier and an allgather
    across every process; one line per process. The launchers' `--check` runs it."""
    from jaxrag.runtime import multihost  # this file's module, not __main__: one watchdog registry

    parser = argparse.ArgumentParser(prog="python -m jaxrag.runtime.multihost")
    parser.add_argument("--workdir", required=True, help="the run's workdir (shared by every host)")
    args = parser.parse_args(argv)
    join.initialize_distributed()

    def check():
        multihost.agree_at_start({}, {}, Path(args.workdir))
        multihost.start_watchdog()
        multihost.barrier("check")
        seen = multihost_utils.process_allgather(np.array([jax.process_index(), jax.local_device_count()]))
        seen = np.asarray(seen).reshape(-1, 2)
        line = (f"process {jax.process_index()} of {jax.process_count()}: joined; {int(seen[:, 1].sum())} devices on "
                f"processes {seen[:, 0].tolist()}; workdir {args.workdir} shared and renames directories\n")
        os.write(sys.stdout.fileno(), line.encode())  # one write: the processes may share one stream
        multihost.finish()

    run(check)


if __name__ == "__main__":
    main()
