"""The watchdog beside each process of a multi-host run: `python -m jaxrag.runtime.watchdog` (started by
`jaxrag.runtime.multihost.start_watchdog`, never by hand).

A process of the run may be blocked for ever in a collective whose peer died, holding the GIL:
no thread of its own can notice. So each process has this small child process (standard library
only), and the children keep in touch over TCP: process 0's child is the hub (it listens on
`--port`, the coordinator's port + 1, at the coordinator's host), the others connect to it and
send a heartbeat every second. The hub knows a peer is lost when its connection closes before the
peer said it finished, when its heartbeat stops for `--silence` seconds (JAX's own heartbeat
timeout, 100 s: a network blip shorter than that is ridden out), when it never connected within
`--join` seconds (the start-up timeout), or when the peer reports its own failure; it tells
every child, and a child that learns of a loss, or whose hub is gone, prints one line naming the
lost process and its parent's stage, and kills its parent (which may be deaf to anything gentler).

The parent talks to its child through the child's stdin, one line at a time:
`stage NAME`, `failed MESSAGE`, `finished`.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import sys
import time

BEAT_S = 1.0


class Child:
    def __init__(self, args):
        self.me, self.n, self.parent, self.silence = args.process, args.processes, args.parent, args.silence
        self.join = args.join
        self.stage, self.finished, self.buffer = "start", False, b""

    def read_parent(self) -> bool:
        """Lines from the parent; False once it closed its end (exited)."""
        chunk = os.read(sys.stdin.fileno(), 65536)
        if not chunk:
            return False
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            word, _, rest = line.decode("utf-8", "replace").partition(" ")
            if word == "stage":
                self.stage = rest
            elif word == "finished":
                self.finished = True
            elif word == "failed":
                self.on_own_failure(rest)
        return True

    def stop_parent(self, message: str) -> None:
        """One line on the parent's stderr (shared with this child), then the parent is killed:
        it may be blocked in a collective that will never return. The line starts on a line of its
        own: the parent may have left a progress bar half-drawn."""
        if self.finished:
            return
        print(f"\nerror: {message}", file=sys.stderr, flush=True)
        try:
            os.kill(self.parent, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sys.exit(0)

    def lost(self, p: int, why: str) -> str:
        return (f"process {p} of {self.n} {why} during stage '{self.stage}'; this process stops too. "
                "Relaunch the same command to resume")


def _send(sock, obj) -> bool:
    if sock is None:  # not connected yet
        return False
    try:
        sock.sendall((json.dumps(obj) + "\n").encode())
        return True
    except OSError:
        return False


def _lines(sock, buffers: dict) -> list | None:
    """Complete JSON lines received on `sock`; None when it closed."""
    try:
        chunk = sock.recv(65536)
    except OSError:
        chunk = b""
    if not chunk:
        return None
    buffers[sock] = buffers.get(sock, b"") + chunk
    *lines, buffers[sock] = buffers[sock].split(b"\n")
    return [json.loads(line) for line in lines if line.strip()]


class Hub(Child):
    def __init__(self, args):
        super().__init__(args)
        self.server = socket.create_server(("", args.port), reuse_port=False)
        self.peers: dict[socket.socket, int] = {}
        self.heard: dict[int, float] = {}
        self.done: set[int] = set()

    def broadcast_loss(self, p: int, why: str) -> None:
        for sock in self.peers:
            _send(sock, {"lost": p, "why": why})
        self.stop_parent(self.lost(p, why))

    def on_own_failure(self, message: str) -> None:
        for sock in self.peers:
            _send(sock, {"lost": 0, "why": f"failed ({message})"})
        self.finished = True  # the parent exits by itself, with its own error line

    def run(self) -> None:
        buffers: dict = {}
        started = time.monotonic()
        while True:
            ready, _, _ = select.select([sys.stdin, self.server, *self.peers], [], [], BEAT_S)
            now = time.monotonic()
            for r in ready:
                if r is sys.stdin:
                    if not self.read_parent():
                        return  # the parent is gone: the spokes see this hub close
                elif r is self.server:
                    sock, _ = self.server.accept()
                    self.peers[sock] = -1
                else:
                    lines = _lines(r, buffers)
                    p = self.peers[r]
                    if lines is None:
                        del self.peers[r]
                        if p >= 0 and p not in self.done:
                            self.broadcast_loss(p, "was lost")
                        continue
                    for msg in lines:
                        p = self.peers[r] = int(msg["p"])
                        self.heard[p] = now
                        if msg.get("finished"):
                            self.done.add(p)
                        if "failed" in msg:
                            self.done.add(p)
                            self.broadcast_loss(p, f"failed ({msg['failed']})")
            for p, at in self.heard.items():
                if p not in self.done and now - at > self.silence:
                    self.broadcast_loss(p, f"was lost (no heartbeat for {self.silence:.0f} s)")
            missing = set(range(1, self.n)) - set(self.heard)
            if missing and now - started > self.join:  # never connected: its watchdog never started
                self.broadcast_loss(min(missing), "never joined")
            if self.finished and set(range(1, self.n)) <= self.done:
                return


class Spoke(Child):
    def __init__(self, args):
        super().__init__(args)
        deadline = time.monotonic() + args.join
        self.sock = None
        while True:
            try:
                self.sock = socket.create_connection((args.host, args.port), timeout=10)
                break
            except OSError:
                # the parent may be done before the hub was ever reached (a start refused by every process)
                if select.select([sys.stdin], [], [], 0)[0] and (not self.read_parent() or self.finished):
                    sys.exit(0)
                if time.monotonic() > deadline:
                    self.stop_parent(self.lost(0, "(the coordinator's watchdog) could not be reached"))
                time.sleep(0.5)
        self.sock.settimeout(None)

    def on_own_failure(self, message: str) -> None:
        _send(self.sock, {"p": self.me, "failed": message})
        self.finished = True

    def run(self) -> None:
        buffers: dict = {}
        beat, last = 0, 0.0
        while True:
            ready, _, _ = select.select([sys.stdin, self.sock], [], [], BEAT_S)
            if sys.stdin in ready and not self.read_parent():
                return  # the parent is gone: the hub sees this connection close
            if self.finished:
                _send(self.sock, {"p": self.me, "finished": True})
                return
            if self.sock in ready:
                lines = _lines(self.sock, buffers)
                if lines is None:
                    # the hub closed: process 0 is gone, unless it closed because our parent just
                    # finished too (the line may still be on its way)
                    if select.select([sys.stdin], [], [], 2.0)[0] and self.read_parent() and self.finished:
                        return
                    self.stop_parent(self.lost(0, "was lost"))
                for msg in lines:
                    if "lost" in msg and int(msg["lost"]) != self.me:
                        self.stop_parent(self.lost(int(msg["lost"]), msg["why"]))
            if time.monotonic() - last >= BEAT_S:
                beat, last = beat + 1, time.monotonic()
                if not _send(self.sock, {"p": self.me, "beat": beat}):
                    self.stop_parent(self.lost(0, "was lost"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxrag.runtime.watchdog")
    parser.add_argument("--process", type=int, required=True)
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--silence", type=float, default=100.0)
    parser.add_argument("--join", type=float, default=300.0)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    (Hub if args.process == 0 else Spoke)(args).run()


if __name__ == "__main__":
    main()
