"""Shared CLI behaviour: a user error is one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable

from jaxrag.errors import JaxragError


def run(main: Callable[[], object]) -> None:
    try:
        main()
    except JaxragError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted: nothing was written at the output path", file=sys.stderr)
        sys.exit(130)
