"""How every colorl command ends: the exit codes and the one-line error, in one place that `cli`,
`plan`, `bench` and `doctor` import (none of them imports another command's module for it)."""
from __future__ import annotations

import sys

EXIT_BAD_INPUT = 2
EXIT_RUN_FAILED = 1
EXIT_INTERRUPTED = 130  # the shell's convention for a run stopped by Ctrl-C (128 + SIGINT)


def fail(message: str, code: int = EXIT_BAD_INPUT) -> int:
    """One line on stderr whatever the message quotes (user text may hold line breaks or controls)."""
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
    print(f"colorl: error: {line}", file=sys.stderr)
    return code


def installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("colorl")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"
