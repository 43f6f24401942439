"""Independent work side by side (`jaxrag.pipeline.lanes`, `jaxrag.runtime.concurrency`): order,
concurrency, stopping, same results."""

import os
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx
from train_fixtures import tiny_model, train_config

from jaxrag.runtime import concurrency
from jaxrag.pipeline import lanes
from jaxrag.train import stages

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Self routing lets a model verbalize what it knows."] * 6


def test_one_worker_runs_in_dict_order_and_several_respect_dependencies():
    seen = []
    tasks = {n: (lambda n=n: seen.append(n), deps) for n, deps in
             [("world", ()), ("index", ("world",)), ("base", ("world",)), ("construct", ("base", "index"))]}
    lanes.run_graph(tasks, 1)
    assert seen == ["world", "index", "base", "construct"]
    seen.clear()
    lanes.run_graph(tasks, 3)
    assert seen[0] == "world" and seen[-1] == "construct" and set(seen[1:3]) == {"index", "base"}
    with pytest.raises(ValueError, match="not tasks"):
        lanes.run_graph({"a": (lambda: None, ("b",))}, 2)


def test_independent_tasks_run_at_the_same_time():
    meet = threading.Barrier(2, timeout=10)  # passes only if both tasks are running at once
    lanes.run_graph({"a": (meet.wait, ()), "b": (meet.wait, ())}, 2)
    alone = threading.Barrier(2, timeout=0.5)
    with pytest.raises(threading.BrokenBarrierError):  # one worker: one at a time
        lanes.run_graph({"a": (alone.wait, ()), "b": (alone.wait, ())}, 1)


def test_a_failure_stops_the_work_beside_it_and_is_what_the_caller_sees():
    stopped = threading.Event()

    def long_loop():
        try:
            for _ in range(1000):
                concurrency.check()
                time.sleep(0.01)
        except concurrency.Stopped:
            stopped.set()
            raise

    def fails():
        time.sleep(0.05)
        raise ValueError("bad input in piece b")

    start = time.perf_counter()
    with pytest.raises(ValueError, match="bad input in piece b"):
        lanes.run_graph({"a": (long_loop, ()), "b": (fails, ()), "after": (lambda: None, ("a",))}, 2)
    assert stopped.is_set() and time.perf_counter() - start < 5
    # nested: the inner failure is the news, not the outer sibling's Stopped
    with pytest.raises(ValueError, match="bad input"):
        lanes.run_graph({"a": (long_loop, ()), "inner": (lambda: lanes.run_graph({"b": (fails, ())}, 2), ())}, 2)
    lanes.run_graph({"a": (concurrency.check, ())}, 2)  # the flag is cleared for the next run


def test_trainings_side_by_side_give_the_same_parameters_as_one_after_the_other(tmp_path):
    cfg = train_config(pretrain=dict(steps=6))

    def train(name):
        model = stages.train_lm(tiny_model(), TEXTS, cfg, tmp_path / name)
        return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model.decoder)))

    alone = train("alone")
    out = {}
    lanes.run_graph({n: (lambda n=n: out.__setitem__(n, train(n)), ()) for n in ("x", "y")}, 2)
    for name in ("x", "y"):
        jax.tree.map(np.testing.assert_array_equal, out[name], alone)


def _held_by_another_thread(lock) -> bool:
    got = []

    def attempt():
        got.append(lock.acquire(blocking=False))
        if got[0]:
            lock.release()
    t = threading.Thread(target=attempt)
    t.start()
    t.join()
    return not got[0]


def test_models_saved_side_by_side_hold_the_orbax_lock_and_load_back(tmp_path, monkeypatch):
    """Orbax is process-wide: two unguarded saves at once can fail (FileExistsError in its temp
    directory, seen in a pipeline's baselines stage), so every orbax call of save_model /
    load_model holds `concurrency.ORBAX`; models saved from two lanes at once all load back."""
    import orbax.checkpoint as ocp

    from jaxrag.models.model import load_model, save_model

    held = []
    for name in ("save", "restore"):
        original = getattr(ocp.StandardCheckpointer, name)

        def call(self, *a, _original=original, **k):
            held.append(_held_by_another_thread(concurrency.ORBAX))
            return _original(self, *a, **k)
        monkeypatch.setattr(ocp.StandardCheckpointer, name, call)
    model = tiny_model()
    want = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model.decoder)))
    lanes.run_graph({n: (lambda n=n: [save_model(model, tmp_path / f"{n}{i}") for i in range(3)], ())
                     for n in ("x", "y")}, 2)
    for name in ("x0", "x2", "y0", "y2"):
        got = nnx.to_pure_dict(nnx.state(load_model(tmp_path / name).decoder))
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, got), want)
    assert len(held) == 10 and all(held)


CTRL_C = r"""
import sys, time
from jaxrag.runtime import concurrency
from jaxrag.errors import run
from jaxrag.pipeline import lanes

def loop(name):
    def go():
        sys.stdout.write(f"running {name}\n")  # one write: print's pieces can interleave
        sys.stdout.flush()
        try:
            while True:
                concurrency.check()
                time.sleep(0.01)
        except concurrency.Stopped:
            sys.stdout.write(f"stopped {name}\n")
            sys.stdout.flush()
            raise
    return go

run(lambda: lanes.run_graph({"a": (loop("a"), ()), "b": (loop("b"), ())}, 2))
"""


def test_ctrl_c_stops_every_piece_and_exits_130():
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", CTRL_C], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert sorted(proc.stdout.readline().strip() for _ in "ab") == ["running a", "running b"]  # both at once
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=20)
    assert (proc.returncode, err.strip()) == (130, "interrupted: nothing half-written was kept")
    assert sorted(out.split()) == sorted("stopped a stopped b".split())


_TWO_DEVICES = """
import threading
import jax
from jaxrag.pipeline import lanes
assert jax.device_count() == 2
alone = threading.Barrier(2, timeout=0.5)  # breaks unless both tasks run at once
try:
    lanes.run_graph({"a": (alone.wait, ()), "b": (alone.wait, ())}, 2)
except threading.BrokenBarrierError:
    print("one at a time")
"""


def test_several_devices_run_one_task_at_a_time():
    """With 2 CPU devices, workers=2 still runs the tasks one after the other: two programs'
    collectives must not interleave across devices."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-c", _TWO_DEVICES], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split("\n")[0] == "one at a time", proc.stderr[-2000:]
