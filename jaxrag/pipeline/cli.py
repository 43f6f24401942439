"""What the pipeline's CLIs share (`python -m jaxrag.train`, `jaxrag.plan`): the `--config` flag,
whose every mistake is one `error:` line and exit code 2, and, before jax is imported, glibc's
allocator set up for XLA's CPU temporaries and XLA's CPU collective timeouts raised. How any CLI
reports a `JaxragError`: `jaxrag.errors.run`."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from importlib.metadata import entry_points

from absl import flags

from jaxrag.errors import JaxragError
from jaxrag.pipeline import config_check

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def reuse_cpu_temporaries() -> bool:
    """Makes glibc keep freed memory for reuse when JAX will run on the CPU; True if it did.

    XLA's CPU client allocates each program's temporaries (330 MB for a tiny-config pretraining
    step) from its worker threads. glibc serves a block that large from a thread's arena by
    mmap and unmaps it on free, so every step faults all of it in again: ~84k page faults and a
    quarter of the step's CPU time in the kernel. One arena that never maps or trims keeps the
    pages: that step 0.60 -> 0.45 s on a 2-core Xeon, bit-identical results. Such a heap gives
    nothing back by itself: `jaxrag.runtime.host_memory` returns freed memory between stages and models
    and whenever a long loop has grown by 2 GB. Must run before
    jax is imported (threads keep the arena they first used). Skipped where an accelerator
    plugin is installed (its host side does not need it, and a never-trimmed heap would hold
    on to the host copies of a 7B checkpoint) and off glibc."""
    if "jax" in sys.modules or not jax_runs_on_cpu():
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in
               ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1)))


# XLA's CPU runtime ends a program whose collective waits more than 40 s for one of its
# participants. CPU devices share the machine's cores (fake devices, or several processes on one
# machine): a participant can be that late while a peer thread or process compiles, and the run
# would abort with a stack trace. A lost process is the watchdog's to report (`jaxrag.runtime.watchdog`).
PATIENT_CPU_COLLECTIVES = ("--xla_cpu_collective_call_terminate_timeout_seconds=1800",
                           "--xla_cpu_collective_timeout_seconds=1800")


def patient_cpu_collectives() -> bool:
    """Adds `PATIENT_CPU_COLLECTIVES` to XLA_FLAGS when JAX will run on the CPU (a value the user
    set for either flag is kept); True if it did. Must run before jax creates its CPU client."""
    if not jax_runs_on_cpu():
        return False
    flags_now = os.environ.get("XLA_FLAGS", "")
    added = [f for f in PATIENT_CPU_COLLECTIVES if f.split("=")[0] + "=" not in flags_now]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([flags_now, *added]).strip()
    return bool(added)


def jax_runs_on_cpu() -> bool:
    """JAX_PLATFORMS when set; else no accelerator plugin (CUDA / ROCm via `jax_plugins`, TPU)."""
    if platforms := os.environ.get("JAX_PLATFORMS"):
        return platforms == "cpu"
    return not (entry_points(group="jax_plugins") or importlib.util.find_spec("jax_plugins")
                or importlib.util.find_spec("libtpu"))


class ConfigFlag:
    """`--config configs/X.py[:size]` and its `--config.a.b=v` overrides, parsed by
    `jaxrag.pipeline.config_check` (not absl), so that every config mistake is one `error:` line, exit 2:

        _CONFIG = ConfigFlag()
        def main(argv): cfg = _CONFIG.value ...
        app.run(main, flags_parser=_CONFIG.parse)

    `.user_set` names the fields set on the command line (`config_check.check_config` refuses
    those the chosen mode does not read)."""

    def __init__(self, name: str = "config", help_text: str = "configs/<model>.py[:tiny]; override "
                 "any field with --config.FIELD=VALUE"):
        self.name = name
        self.value = None
        self.user_set: set[str] = set()
        flags.DEFINE_string(name, None, help_text)
        flags.mark_flag_as_required(name)

    def parse(self, argv: list[str]) -> list[str]:
        """absl `flags_parser`: the flags, then the config; one `error:` line and exit 2 on any
        mistake (unknown flag or field, missing value, wrong type, unknown size or file)."""
        rest, overrides = config_check.split_argv(argv, self.name)
        try:
            rest = flags.FLAGS(rest)
            self.value, self.user_set = config_check.load_config(flags.FLAGS[self.name].value, overrides)
            config_check.check_config(self.value, self.user_set)
        except (flags.Error, JaxragError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        return rest
