"""JAX's coordination service in a process of its own: `python -m jaxrag.runtime.coordinator`
(started by `jaxrag.runtime.join` on process 0, never by hand).

`jax.distributed.initialize` runs the service inside process 0. When process 0 dies, the others'
JAX clients lose it at once and abort with a C++ check failure and a stack dump, before their
watchdogs (`jaxrag.runtime.watchdog`) can stop them with the one line that names the lost
process. Served from this child instead, the service outlives process 0 by `--grace` seconds once
the watchdogs run (the parent writes `watched` to the child's stdin): the others' collectives with
process 0 fail as Python errors, and their watchdogs stop them with that line. The child lives as
long as its parent (its stdin is the parent's pipe), then the grace.

It prints `ready` once the service listens.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

GRACE_S = 10.0  # the others' watchdogs stop them within a few seconds of process 0's loss


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxrag.runtime.coordinator")
    parser.add_argument("--bind", required=True, help="address the service listens on, e.g. [::]:8476")
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--heartbeat", type=int, required=True, help="JAX's heartbeat timeout, seconds")
    parser.add_argument("--grace", type=float, default=GRACE_S)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    from jax._src.lib import _jax  # the service jax.distributed would start: no public API starts it alone

    service = _jax.get_distributed_runtime_service(args.bind, args.processes, heartbeat_timeout=args.heartbeat,
                                                   shutdown_timeout=int(args.grace) + 60)
    print("ready", flush=True)
    watched, chunk = False, b""
    while chunk := os.read(sys.stdin.fileno(), 4096):  # until the parent's end closes: it exited or was killed
        watched = watched or b"watched" in chunk
    # Before the watchdogs run, nothing would report the loss: the others' start-up timeout does,
    # once they cannot reach this service.
    time.sleep(args.grace if watched else 0.0)
    del service
    os._exit(0)


if __name__ == "__main__":
    main()
