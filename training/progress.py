"""Progress of the long training steps: the library reports, the command line draws.

A library function never prints. Given `progress`, it calls `progress(task, done, total)` as it
goes (`total` None while unknown); without one it is silent. `rich_bars` is the command line's
drawing of those calls, on stderr, so that stdout stays machine-readable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, overload

import pandas as pd

from app.core.errors import EventLogError
from app.engine.events import Event
from training.dataset import build_dataset, load_events, rows_from_events

Progress = Callable[[str, int, "int | None"], None]

# A replay reports at most this many times per log: a bar needs no finer steps, and each report
# takes a lock in rich.
_REPORTS_PER_LOG = 200


class _TrackedEvents(Sequence[Event]):
    """A log's events, reporting how far a replay has got. rows_from_events walks the log by
    index, so reading events[i] means the replay has applied i events; a reader that only
    iterates reports nothing until the caller's final report, which is still correct."""

    def __init__(self, events: list[Event], report: Callable[[int], None]) -> None:
        self._events = events
        self._report = report
        self._step = max(len(events) // _REPORTS_PER_LOG, 1)
        self._next = self._step

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self._events)

    @overload
    def __getitem__(self, i: int) -> Event: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Event]: ...

    def __getitem__(self, i: int | slice) -> Event | Sequence[Event]:
        if isinstance(i, int) and i >= self._next:
            self._next = i + self._step
            self._report(i)
        return self._events[i]


def build_dataset_reporting(logs: Iterable[Path | str], progress: Progress | None = None,
                            **kwargs: Any) -> pd.DataFrame:
    """training.dataset.build_dataset, reporting each log's replay (events applied) to `progress`.

    Without `progress` it is build_dataset itself. With one, it repeats build_dataset's loop,
    one log at a time (tests/training/test_progress.py checks the rows are the same).
    """
    if progress is None:
        return build_dataset(logs, **kwargs)
    frames = []
    for log in logs:
        path = Path(log)
        task = f"replaying {path.name}"
        progress(task, 0, None)  # reading: the event count is not known yet
        events = load_events(path)
        total = len(events)
        tracked = _TrackedEvents(events, lambda done: progress(task, done, total))
        frames.append(rows_from_events(tracked, log_name=path.name, **kwargs))
        progress(task, total, total)
    if not frames:
        raise ValueError("no event logs given")
    data = pd.concat(frames, ignore_index=True)
    if data.empty:
        raise EventLogError("the logs hold no finished request to learn from")
    return data


@contextmanager
def rich_bars(console: Any = None) -> Iterator[Progress]:
    """A `Progress` drawn as rich progress bars (one per task) on `console` (default: stderr)."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress as Bars, TaskID, TextColumn,
                               TimeElapsedColumn)

    console = console if console is not None else Console(stderr=True)
    # Transient, as the replay command's bars (sim/commands.py): the result line is what stays.
    with Bars(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
              console=console, transient=True) as bars:
        tasks: dict[str, TaskID] = {}

        def report(task: str, done: int, total: int | None) -> None:
            if task not in tasks:
                tasks[task] = bars.add_task(task, total=total)
            bars.update(tasks[task], completed=done, total=total)

        yield report


def stderr_is_terminal() -> bool:
    """Whether bars on stderr would be seen (rich's test: a TTY, or TTY_COMPATIBLE=1 / FORCE_COLOR)."""
    from rich.console import Console

    return Console(stderr=True).is_terminal


__all__ = ["Progress", "build_dataset_reporting", "rich_bars", "stderr_is_terminal"]
