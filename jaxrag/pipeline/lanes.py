"""Independent pieces of the pipeline side by side on one host (`pipeline.workers` threads).

One tiny-config XLA program at a time leaves part of a small CPU idle (kernels too small to
split over every core, host work between steps): two training loops in two threads of one
process do 1.29x the steps of one after the other on 2 cores. JAX releases the GIL while XLA
runs, and a program's result does not depend on what runs beside it, so results are the same as
one at a time. Accelerator configs keep one worker: a device runs one program at a time anyway,
and a 7B model per piece would not fit twice. Latency is never measured beside other work (the
eval stage depends on every stage before it, so it runs alone).

With more than one device (several CPU devices in one process, or several processes) the pieces
run one at a time: two pieces' programs would reach their collectives in another order on each
device, each device waiting in one program for a peer that runs the other, for ever (seen: a
2-device tiny run's pretraining hung beside the index build).

When a piece fails or the user presses Ctrl-C, the others stop at their next `check()` (every
training step, encoded batch or routed batch), keeping what they have saved, so a rerun resumes
them; the first failure is what the caller sees. The state they share (the orbax lock, the stop
flag, `check()`) is `jaxrag.runtime.concurrency`.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import jax

from jaxrag.runtime.concurrency import STOP, Stopped, enter_graph, leave_graph


def run_graph(tasks: dict[str, tuple[Callable[[], object], tuple[str, ...]]], workers: int) -> None:
    """Runs each task `name: (fn, names it depends on)` once those have finished, the ready ones
    in dict order, at most `workers` at once (1: exactly the dict order, in this thread). The
    first failure, or KeyboardInterrupt, stops the others at their next `check()` and is raised
    once they have stopped."""
    unknown = {d for _, deps in tasks.values() for d in deps} - set(tasks)
    if unknown:
        raise ValueError(f"dependencies {sorted(unknown)} are not tasks")
    if workers <= 1 or jax.device_count() > 1:  # several devices: one at a time (module docstring)
        for fn, _ in tasks.values():
            fn()
        return
    todo, finished, running = dict(tasks), set(), {}
    interrupted = threading.Event()
    previous = _catch_ctrl_c(interrupted)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lane")
    enter_graph()
    try:
        while todo or running:
            for name in [n for n, (_, deps) in todo.items() if set(deps) <= finished][: workers - len(running)]:
                running[pool.submit(todo.pop(name)[0])] = name
            if not running:
                raise ValueError(f"tasks {sorted(todo)} wait on each other")
            done, _ = wait(running, timeout=0.2, return_when=FIRST_COMPLETED)
            if interrupted.is_set():
                raise KeyboardInterrupt
            for future in done:
                if future.exception() is not None:
                    raise _first_failure(running)
                finished.add(running.pop(future))
    except BaseException:
        STOP.set()
        raise
    finally:
        pool.shutdown(wait=True)  # every piece has returned or reached a check()
        if leave_graph():  # a nested graph leaves the flag set: the outer one's pieces may not have seen it
            STOP.clear()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _catch_ctrl_c(interrupted: threading.Event):
    """In the main thread, Ctrl-C only sets flags while pieces run (the previous handler is
    returned): a KeyboardInterrupt raised inside the futures' lock bookkeeping could leave a lock
    held and hang the shutdown. The main loop raises it at a safe point instead."""
    if threading.current_thread() is not threading.main_thread():
        return None  # a nested graph: the outer one handles Ctrl-C and sets the stop flag

    def on_ctrl_c(signum, frame):
        interrupted.set()
        STOP.set()
    return signal.signal(signal.SIGINT, on_ctrl_c)


def _first_failure(running: dict[Future, str]) -> BaseException:
    """Stops the other pieces and returns the failure that is the news: not a `Stopped` of a
    piece that only noticed another's failure (a nested graph's pieces set the same flag)."""
    STOP.set()
    wait(running)
    errors = [e for f in running if (e := f.exception()) is not None]
    return next((e for e in errors if not isinstance(e, Stopped)), errors[0])
