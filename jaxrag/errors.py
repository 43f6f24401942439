"""The one error type users see, and how every CLI reports it: one `error:` line on stderr and exit
code 2, never a traceback."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable


class JaxragError(Exception):
    """A user-facing error: one clear message naming the file/field and what is wrong."""


# Called with the failure's one line before a CLI exits on it (`jaxrag.runtime.multihost` adds the one that
# tells the other processes of a multi-process run).
FAILURE_HOOKS: list[Callable[[str], None]] = []


# Called before a CLI reports an unexpected error (not a JaxragError): `jaxrag.runtime.multihost`
# adds one that leaves time for a lost peer to be reported instead (a collective fails at once).
SETTLE_HOOKS: list[Callable[[], None]] = []


def _report(message: str) -> None:
    for hook in FAILURE_HOOKS:
        hook(message)


def exit_code(main: Callable[[], object]) -> int:
    """Runs `main`; 0 on success, 2 with one `error:` line for a JaxragError, 130 on Ctrl-C."""
    try:
        main()
    except JaxragError as e:
        _report(str(e))
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _report("interrupted")
        print("interrupted: nothing half-written was kept", file=sys.stderr)
        return 130
    except Exception as e:
        for hook in SETTLE_HOOKS:
            hook()
        _report(f"{type(e).__name__}: {e}")
        raise
    return 0


def run(main: Callable[[], object]) -> None:
    """`exit_code`, exiting the process on failure. A process of a multi-process run (one with
    failure hooks) exits at once: JAX's exit would wait for peers that are stopping or gone."""
    try:
        code = exit_code(main)
    except Exception:
        if not FAILURE_HOOKS:
            raise
        traceback.print_exc()
        code = 1
    if code and FAILURE_HOOKS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)
