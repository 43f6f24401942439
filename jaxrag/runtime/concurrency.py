"""What pieces of work running side by side in one process share: the orbax lock, the stop flag
that long loops `check()`, and whether a graph of pieces runs now. The graph itself is
`jaxrag.pipeline.lanes.run_graph`; models and training only read this state, so it lives below them.
"""

from __future__ import annotations

import threading

# Orbax's async machinery is process-wide: two savers at once (trainings side by side, a model
# saved beside a training's checkpoint) collide in its temp directories and commit signals. Every
# orbax call holds this lock, and a save completes before it is released.
ORBAX = threading.RLock()
# Set when a piece fails or the user interrupts; cleared when the outermost graph has stopped.
STOP = threading.Event()
_graphs = 0  # multi-worker graphs running now (`side_by_side`)
_graphs_lock = threading.Lock()


def side_by_side() -> bool:
    """Whether pieces may be running beside each other now (a graph with workers > 1 runs)."""
    return _graphs > 0


class Stopped(Exception):
    """Raised inside a piece of work because another piece failed or the user interrupted."""


def check() -> None:
    """Called by long loops: raises `Stopped` once the work beside them has failed."""
    if STOP.is_set():
        raise Stopped("stopped because work running beside this one failed or was interrupted")


def enter_graph() -> None:
    """A multi-worker graph starts (`side_by_side` is true until it leaves)."""
    global _graphs
    with _graphs_lock:
        _graphs += 1


def leave_graph() -> bool:
    """A multi-worker graph has stopped; True when it was the outermost one."""
    global _graphs
    with _graphs_lock:
        _graphs -= 1
        return _graphs == 0
