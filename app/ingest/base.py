"""The one interface an event log implements, and the log that keeps nothing.

The Ingestor appends each accepted batch to an `EventLog` before the batch is acknowledged, and
a service replays it past the store's checkpoint on start (app/ingest/eventlog.py,
`FileEventLog`, is the durable one). A replay's events are the trace's and must not land in the
user's data dir: `NullEventLog`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from app.state.base import LogPosition


class EventLog(Protocol):
    """Where accepted batches are appended, in order, before they are acknowledged."""

    # Where its segments lie (what recovery and retraining read); None: it keeps nothing.
    directory: Path | None
    # False: `append` is never read back, so the Ingestor need not encode what it appends.
    keeps_events: bool

    def append(self, data: bytes) -> LogPosition:
        """Append one batch's bytes durably; its position (segment, line) in the log."""
        ...

    def close(self) -> None:
        """Flush and release the log; idempotent."""
        ...


class NullEventLog(EventLog):
    """An event log that keeps nothing: for a replay. Nothing is logged, so there is nothing to
    recover."""

    directory: Path | None = None
    keeps_events = False

    def __init__(self) -> None:
        self._lines = 0

    def append(self, data: bytes) -> LogPosition:
        self._lines += 1
        return LogPosition(0, self._lines)

    def close(self) -> None:
        pass


__all__ = ["EventLog", "NullEventLog"]
