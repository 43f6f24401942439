"""Work split between the processes of a run: each computes its share, every one reads all of it.

The generation stages (the datastore, eval) run on every process (`jaxrag.pipeline.run`): their
work is a list of chunks (batches of questions) mapped by a function, and `map_shared` gives
process p of P the p-th contiguous block of the chunks. Each process spools its results to a
file of the workdir (which every process sees), meets the others at a barrier and reads every
process's file, so all of them go on with the whole result, as a single process would; process 0
alone writes the stage's outputs. A chunk's result does not depend on which process computes it:
a batch is the batch a single process would run (on any placement, `tests/test_placement.py`).

A stage whose work falls into units of unequal cost, each with its own programs (eval: one
model's paths and methods), places the units on the processes instead (`groups`): each unit on a
group of processes that share its chunks, so that a process traces and compiles its own units'
programs only.

A process's spool file is written whole (renamed into place), and a rerun of an interrupted
stage reads it instead of computing its chunks again. In a single-process run nothing is
spooled: the chunks are mapped in place.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import jax
from tqdm.auto import tqdm

from jaxrag.errors import JaxragError
from jaxrag.runtime import multihost

T = TypeVar("T")
R = TypeVar("R")
_calls: dict[tuple[int, ...], int] = {}  # map_shared calls per group of processes, made in the same order by each


def share(n: int, process: int, processes: int) -> range:
    """Process `process`'s contiguous block of `n` chunks (block sizes differ by at most one)."""
    return range(process * n // processes, (process + 1) * n // processes)


def groups(costs: Sequence[float], processes: int) -> list[range]:
    """The processes that run each of the units of work with these relative costs. With fewer
    processes than units, one process each: the costliest unit first, each to the least loaded
    process (LPT). Otherwise contiguous groups, one per unit, their sizes in proportion to the
    costs (largest remainders; at least one process each)."""
    n = len(costs)
    if processes < n:
        load, out = [0.0] * processes, [range(0)] * n
        for u in sorted(range(n), key=lambda u: -costs[u]):
            p = min(range(processes), key=lambda p: load[p])
            load[p] += costs[u]
            out[u] = range(p, p + 1)
        return out
    extra = processes - n
    quota = [extra * c / sum(costs) for c in costs]
    sizes = [1 + int(q) for q in quota]
    for u in sorted(range(n), key=lambda u: int(quota[u]) - quota[u])[:processes - sum(sizes)]:
        sizes[u] += 1
    starts = [sum(sizes[:u]) for u in range(n)]
    return [range(a, a + k) for a, k in zip(starts, sizes)]


def map_shared(fn: Callable[[T], R], chunks: Sequence[T], spool: Path, name: str, desc: str = "",
               group: Sequence[int] | None = None) -> list[R]:
    """[fn(c) for c in chunks], each process of `group` (every process by default) computing its
    `share`, the results of every process in chunk order. `spool/<name>.<I>-of-<P>.pkl` holds the
    results of the group's I-th process (`name` unique in the stage); every process of the group
    calls this with the same chunks, in the same order as its other calls with that group."""
    members = tuple(range(jax.process_count()) if group is None else group)
    me = jax.process_index()
    rank, n_proc = members.index(me), len(members)
    mine = share(len(chunks), rank, n_proc)
    bar = dict(desc=desc or name, unit="batch", leave=False)
    if n_proc == 1:
        return [fn(chunks[i]) for i in tqdm(mine, **bar)]
    _calls[members] = _calls.get(members, 0) + 1
    spool, stem = Path(spool), re.sub(r"[^\w.-]+", "_", name).strip("_")
    files = [spool / f"{stem}.{r}-of-{n_proc}.pkl" for r in range(n_proc)]
    path = files[rank]
    with_ = "" if n_proc == jax.process_count() else f" (its group: processes {', '.join(map(str, members))})"
    print(f"  {name}: process {me} of {jax.process_count()} computes batches {mine.start + 1}-{mine.stop} of "
          f"{len(chunks)}{with_}" + (" (done before: read from its spool)" if path.is_file() else ""), flush=True)
    if not path.is_file():  # else this process's share is done, from an interrupted run
        out = [fn(chunks[i]) for i in tqdm(mine, **bar)]
        spool.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(pickle.dumps(out))
        os.replace(tmp, path)
    barrier = f"shares/{'-'.join(map(str, members))}/{_calls[members]}/{name}"
    multihost.barrier(barrier, members)  # every process's share is on disk
    results: list[R] = []
    for r, file in enumerate(files):
        part = pickle.loads(file.read_bytes())
        if len(part) != len(share(len(chunks), r, n_proc)):
            raise JaxragError(f"{file}: {len(part)} results for process {members[r]}'s "
                              f"{len(share(len(chunks), r, n_proc))} chunks: a spool of another run; remove {spool} "
                              "and rerun")
        results += part
    multihost.barrier(f"{barrier}/read", members)  # before a process removes the spool
    return results


def chunk_starts(n: int, size: int) -> list[int]:
    """The start of each batch of `size` over `n` items."""
    return list(range(0, n, size))
