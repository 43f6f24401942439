"""The process's host memory under the allocator the pipeline sets up on CPU
(`jaxrag.pipeline.cli.reuse_cpu_temporaries`: one glibc arena, no mmap, no trimming, so XLA's
per-step temporaries are reused instead of faulted in afresh each step).

That allocator never gives memory back by itself, and blocks of gigabytes fragment it: a freed
step's temporaries are nibbled by small allocations, the next step's no longer fit the hole, and
the heap grows by a whole block per step (a SmolLM2 DPO step at 256 tokens: +5.5 GB per step, to
21.6 GB after three). `release` gives back every free page; `bound`, called once per iteration
of a long loop, does so only when the process has grown by `slack_gb` since the last time, so a
loop whose temporaries are reused in place (the tiny config's) never pays for re-faulting them.
Both are no-ops off glibc.
"""

from __future__ import annotations

import ctypes
import gc
import os

_floor_gb: float | None = None  # resident size right after the last release


def resident_gb() -> float:
    """This process's resident set, GB (0.0 where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def release() -> None:
    """Frees what only reference cycles hold (a stage's or model's arrays), then returns the
    heap's free pages to the OS. Safe beside running threads (glibc locks the arena)."""
    gc.collect()
    _trim()


def _trim() -> None:
    global _floor_gb
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return
    _floor_gb = resident_gb()


def bound(slack_gb: float = 2.0) -> None:
    """Returns the heap's free pages to the OS when the process has grown by more than
    `slack_gb` since the last time (the first call only records where it stands). No garbage
    collection: what a loop's heap grows by is the allocator's fragments, and full collections
    in a process that has traced many programs are slow (in the real-path smoke eval's loops,
    48 s of its 620)."""
    global _floor_gb
    now = resident_gb()
    if _floor_gb is None:
        _floor_gb = now
    elif now > _floor_gb + slack_gb:
        _trim()
