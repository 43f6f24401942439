"""The one error type users see, and how every CLI reports it: one `error:` line on stderr and exit
code 2, never a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable


class JaxragError(Exception):
    """A user-facing error: one clear message naming the file/field and what is wrong."""


def exit_code(main: Callable[[], object]) -> int:
    """Runs `main`; 0 on success, 2 with one `error:` line for a JaxragError, 130 on Ctrl-C."""
    try:
        main()
    except JaxragError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing half-written was kept", file=sys.stderr)
        return 130
    return 0


def run(main: Callable[[], object]) -> None:
    """`exit_code`, exiting the process on failure."""
    code = exit_code(main)
    if code:
        sys.exit(code)
