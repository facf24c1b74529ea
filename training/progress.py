"""Progress of the long training steps: the library reports, the command line draws.

A library function never prints. Given `progress`, it calls `progress(task, done, total)` as it
goes (`total` None while unknown); without one it is silent. `rich_bars` is the command line's
drawing of those calls, on stderr, so that stdout stays machine-readable.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from training.dataset import Progress


@contextmanager
def rich_bars(console: Any = None) -> Iterator[Progress]:
    """A `Progress` drawn as rich progress bars (one per task) on `console` (default: stderr)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TaskID,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.progress import (
        Progress as Bars,
    )

    console = console if console is not None else Console(stderr=True)
    # Transient, as the replay command's bars (sim/commands.py): the result line is what stays.
    with Bars(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bars:
        tasks: dict[str, TaskID] = {}

        def report(task: str, done: int, total: int | None) -> None:
            if task not in tasks:
                tasks[task] = bars.add_task(task, total=total)
            bars.update(tasks[task], completed=done, total=total)

        yield report


def stderr_is_terminal() -> bool:
    """Whether bars on stderr would be seen (rich's test: a TTY, or TTY_COMPATIBLE=1 /
    FORCE_COLOR)."""
    from rich.console import Console

    return Console(stderr=True).is_terminal


__all__ = ["Progress", "rich_bars", "stderr_is_terminal"]
