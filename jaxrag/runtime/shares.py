"""Work split between the processes of a run: each computes its share, every one reads all of it.

The generation stages (the datastore, eval) run on every process (`jaxrag.pipeline.run`): their
work is a list of chunks (batches of questions) mapped by a function, and `map_shared` gives
process p of P the p-th contiguous block of the chunks. Each process spools its results to a
file of the workdir (which every process sees), meets the others at a barrier and reads every
process's file, so all of them go on with the whole result, as a single process would; process 0
alone writes the stage's outputs. A chunk's result does not depend on which process computes it:
a batch is the batch a single process would run (on any placement, `tests/test_placement.py`).

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
_calls = [0]  # map_shared calls in this run: every process makes them in the same order


def share(n: int, process: int, processes: int) -> range:
    """Process `process`'s contiguous block of `n` chunks (block sizes differ by at most one)."""
    return range(process * n // processes, (process + 1) * n // processes)


def map_shared(fn: Callable[[T], R], chunks: Sequence[T], spool: Path, name: str, desc: str = "") -> list[R]:
    """[fn(c) for c in chunks], each process computing its `share`, the results of every process
    in chunk order. `spool/<name>.<I>-of-<P>.pkl` holds process I's results (`name` unique in the
    stage); every process calls this with the same chunks, in the same order as its other calls."""
    me, n_proc = jax.process_index(), jax.process_count()
    mine = share(len(chunks), me, n_proc)
    bar = dict(desc=desc or name, unit="batch", leave=False)
    if n_proc == 1:
        return [fn(chunks[i]) for i in tqdm(mine, **bar)]
    _calls[0] += 1
    spool, stem = Path(spool), re.sub(r"[^\w.-]+", "_", name).strip("_")
    files = [spool / f"{stem}.{p}-of-{n_proc}.pkl" for p in range(n_proc)]
    path = files[me]
    print(f"  {name}: process {me} of {n_proc} computes batches {mine.start + 1}-{mine.stop} of {len(chunks)}"
          + (" (done before: read from its spool)" if path.is_file() else ""), flush=True)
    if not path.is_file():  # else this process's share is done, from an interrupted run
        out = [fn(chunks[i]) for i in tqdm(mine, **bar)]
        spool.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(pickle.dumps(out))
        os.replace(tmp, path)
    multihost.barrier(f"shares/{_calls[0]}/{name}")  # every process's share is on disk
    results: list[R] = []
    for p, file in enumerate(files):
        part = pickle.loads(file.read_bytes())
        if len(part) != len(share(len(chunks), p, n_proc)):
            raise JaxragError(f"{file}: {len(part)} results for process {p}'s {len(share(len(chunks), p, n_proc))} "
                              f"chunks: a spool of another run; remove {spool} and rerun")
        results += part
    multihost.barrier(f"shares/{_calls[0]}/{name}/read")  # before a process removes the spool
    return results


def chunk_starts(n: int, size: int) -> list[int]:
    """The start of each batch of `size` over `n` items."""
    return list(range(0, n, size))
