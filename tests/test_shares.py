"""Work split between processes (`jaxrag.runtime.shares`): the units placed on the processes by
their cost, and a loop's chunks mapped by a group of processes that is not all of them, on 3
real processes (jax.distributed over a 127.0.0.1 coordinator, the key-value store's barriers)."""

import pickle
import subprocess
import sys

from multihost_fixtures import free_ports, process_env

from jaxrag.runtime.shares import groups, share

EVAL_COSTS = (3, 3, 9, 1, 1)  # jaxrag.pipeline.eval.UNIT_COST, in UNITS order


def test_fewer_processes_than_units_take_the_costliest_unit_first_to_the_least_loaded():
    # by hand: 9 -> p0; 3 -> p1; 3 -> p1 (3 < 9); 1 -> p1 (6); 1 -> p1 (7)
    assert groups(EVAL_COSTS, 2) == [range(1, 2), range(1, 2), range(0, 1), range(1, 2), range(1, 2)]
    # 9 -> p0; 3 -> p1; 3 -> p2; 1 -> p1 (3, 3: the first); 1 -> p2
    assert groups(EVAL_COSTS, 3) == [range(1, 2), range(2, 3), range(0, 1), range(1, 2), range(2, 3)]
    assert groups(EVAL_COSTS, 1) == [range(0, 1)] * 5


def test_more_processes_than_units_give_every_process_a_unit_in_proportion_to_cost():
    # 3 extra processes over costs summing to 17: quotas 0.53, 0.53, 1.59, 0.18, 0.18 -> 0, 0, 1, 0, 0
    # whole, and the two largest remainders (0.59, then 0.53 of the first) take the 2 left
    assert groups(EVAL_COSTS, 8) == [range(0, 2), range(2, 3), range(3, 6), range(6, 7), range(7, 8)]
    for p in (5, 16, 64):
        g = groups(EVAL_COSTS, p)
        assert [x for r in g for x in r] == list(range(p)), p  # contiguous, each process once
        assert len(g[2]) == max(len(r) for r in g), p


PROGRAM = """
import pickle, sys
from pathlib import Path
from jaxrag.runtime.join import initialize_distributed
initialize_distributed()
import jax
from jaxrag.runtime import shares
me, spool = jax.process_index(), Path(sys.argv[1])
out = {}
if me in (0, 1):  # a group of two: process 2 is not at its barriers
    out["pair"] = shares.map_shared(lambda c: (c, jax.process_index()), list(range(5)), spool, "pair", group=(0, 1))
    out["pair again"] = shares.map_shared(lambda c: -c, list(range(3)), spool, "pair again", group=(0, 1))
else:  # a group of one maps in place, spooling nothing
    out["alone"] = shares.map_shared(lambda c: (c, jax.process_index()), list(range(2)), spool, "alone", group=(2,))
out["all"] = shares.map_shared(lambda c: (c, jax.process_index()), list(range(4)), spool, "all")
Path(sys.argv[2]).write_bytes(pickle.dumps(out))
"""


def test_a_group_of_processes_maps_a_loop_while_the_others_run_their_own(tmp_path):
    port = free_ports()
    procs = []
    for i in range(3):
        env = process_env(port, i, 3, XLA_FLAGS="--xla_force_host_platform_device_count=1")
        procs.append(subprocess.Popen([sys.executable, "-c", PROGRAM, str(tmp_path / "spool"), str(tmp_path / f"{i}.pkl")],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], logs
    out = [pickle.loads((tmp_path / f"{i}.pkl").read_bytes()) for i in range(3)]
    # chunks 0-1 on process 0 and 2-4 on process 1 (`share`), both processes reading all of them
    assert list(share(5, 0, 2)) == [0, 1] and list(share(5, 1, 2)) == [2, 3, 4]
    pair = [(0, 0), (1, 0), (2, 1), (3, 1), (4, 1)]
    assert out[0]["pair"] == out[1]["pair"] == pair
    assert out[0]["pair again"] == out[1]["pair again"] == [0, -1, -2]
    assert out[2]["alone"] == [(0, 2), (1, 2)]
    assert out[0]["all"] == out[1]["all"] == out[2]["all"] == [(0, 0), (1, 1), (2, 2), (3, 2)]
    assert "pair: process 1 of 3 computes batches 3-5 of 5 (its group: processes 0, 1)" in logs[1]
    assert "alone: process" not in logs[2]  # mapped in place: no share named, nothing spooled
    assert sorted(p.name for p in (tmp_path / "spool").iterdir()) == [
        "all.0-of-3.pkl", "all.1-of-3.pkl", "all.2-of-3.pkl", "pair.0-of-2.pkl", "pair.1-of-2.pkl",
        "pair_again.0-of-2.pkl", "pair_again.1-of-2.pkl"]
