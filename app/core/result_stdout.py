"""Stdout for a command's result alone (`--json`): everything else written to it goes to stderr.

Libraries write to the process's stdout below Python: LightGBM's native network setup prints
from the Dask workers (processes that inherit the parent's file descriptor 1), C extensions
print, and child processes inherit it. So file descriptor 1 itself is pointed at stderr while
the command runs, and Python's `sys.stdout`, where the command prints its result, at a copy of
the real stdout.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

STDOUT_FD = 1
STDERR_FD = 2


@contextmanager
def result_alone_on_stdout() -> Iterator[None]:
    """Within: descriptor 1 (and what children inherit) is stderr; `sys.stdout` the real
    stdout. Both restored after."""
    sys.stdout.flush()
    sys.stderr.flush()
    result_fd = os.dup(STDOUT_FD)
    original = sys.stdout
    os.dup2(STDERR_FD, STDOUT_FD)
    encoding = getattr(original, "encoding", None) or "utf-8"
    result = io.TextIOWrapper(
        os.fdopen(result_fd, "wb", closefd=False), encoding=encoding, line_buffering=True
    )
    sys.stdout = result
    try:
        yield
    finally:
        result.flush()
        sys.stdout = original
        os.dup2(result_fd, STDOUT_FD)
        os.close(result_fd)


def wants_json(argv: list[str]) -> bool:
    """Whether a command line asks for `--json` (before a `--` that ends the options)."""
    options = argv[: argv.index("--")] if "--" in argv else argv
    return "--json" in options
