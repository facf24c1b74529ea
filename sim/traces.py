"""Mooncake-format traces: one JSON object a line, timestamps in milliseconds.

    {"timestamp": 27000, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

`hash_ids` holds one id per `block_tokens`-token block of the prompt, prefix-chained: two
requests share id k at position i only if their first i+1 blocks are identical.

An agent trace adds optional fields (docs/data-science/agent-traces.md):

    {..., "session_id": "task-7", "after_seconds": 2.41, "tool": "bash"}

`session_id` names the request's session (every request of a trace carries one, or none does:
then the replay derives sessions, sim/sessions.py); `after_seconds` is how long after its
session's previous request finished this one arrives (a tool's run or a human's think time;
never on a session's first request); `tool` is the tool whose result the request carries
(absent on a human turn). Other fields are ignored.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from app.core.errors import KvpError


class TraceError(KvpError):
    """A trace line that is not a valid request; names the file and line."""

    def __init__(self, path: Path | str, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path = str(path)
        self.line = line
        self.message = message

    def __reduce__(self) -> tuple[type[TraceError], tuple[str, int, str]]:
        # Pickled by its own arguments: a replay's worker process hands it back whole (from
        # `args`, the one formatted message, it would not rebuild: a BrokenProcessPool instead).
        return (type(self), (self.path, self.line, self.message))


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    arrival_seconds: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    session_id: str | None = None
    after_seconds: float | None = None
    tool: str | None = None


_FIELDS = {"timestamp", "input_length", "output_length", "hash_ids"}


def _int(doc: dict, key: str, path: Path, line: int, minimum: int = 0) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(path, line, f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(path, line, f"{key} must be >= {minimum}, got {value}")
    return value


def _text(doc: dict, key: str, path: Path, line: int) -> str | None:
    value = doc.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise TraceError(path, line, f"{key} must be a non-empty string, got {value!r}")
    return value


def _after_seconds(doc: dict, path: Path, line: int) -> float | None:
    value = doc.get("after_seconds")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TraceError(path, line, f"after_seconds must be a number, got {value!r}")
    if value < 0:
        raise TraceError(path, line, f"after_seconds must be >= 0, got {value}")
    return float(value)


def json_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of each non-blank line of a JSON Lines file; a file that cannot be
    opened, or a line that is not a JSON object, is a TraceError naming the file and line."""
    try:
        f = open(path, "rb")  # noqa: SIM115
    except OSError as exc:
        raise TraceError(path, 0, f"cannot open: {exc.strerror}") from exc
    with f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                doc = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise TraceError(path, line_no, f"not JSON: {exc}") from None
            if not isinstance(doc, dict):
                raise TraceError(path, line_no, "a line must be a JSON object")
            yield line_no, doc


def iter_trace(path: Path | str) -> Iterator[TraceRequest]:
    """Requests in file order. A malformed line stops the read with its file and line number."""
    path = Path(path)
    last_ts = -1
    labelled: bool | None = None  # whether the trace's requests carry session_id
    seen_sessions: set[str] = set()
    for index, (line_no, doc) in enumerate(json_lines(path)):
        missing = sorted(_FIELDS - set(doc))
        if missing:
            raise TraceError(path, line_no, f"missing field {missing[0]!r}")
        ts = _int(doc, "timestamp", path, line_no)
        if ts < last_ts:
            raise TraceError(path, line_no, f"timestamp goes back in time ({ts} < {last_ts})")
        last_ts = ts
        hash_ids = doc["hash_ids"]
        if not isinstance(hash_ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
        ):
            raise TraceError(path, line_no, "hash_ids must be a list of integers")
        session_id = _text(doc, "session_id", path, line_no)
        if labelled is None:
            labelled = session_id is not None
        elif labelled != (session_id is not None):
            # Half-labelled traces would mix trace sessions with derived ones.
            raise TraceError(
                path,
                line_no,
                "session_id must be on every request or on none"
                + (" (missing here)" if labelled else " (absent on earlier requests)"),
            )
        after_seconds = _after_seconds(doc, path, line_no)
        if after_seconds is not None:
            if session_id is None:
                raise TraceError(path, line_no, "after_seconds needs a session_id")
            if session_id not in seen_sessions:
                raise TraceError(
                    path,
                    line_no,
                    f"after_seconds on the first request of session {session_id!r}",
                )
        if session_id is not None:
            seen_sessions.add(session_id)
        yield TraceRequest(
            index=index,
            arrival_seconds=ts / 1000.0,
            input_tokens=_int(doc, "input_length", path, line_no),
            output_tokens=_int(doc, "output_length", path, line_no),
            hash_ids=tuple(hash_ids),
            session_id=session_id,
            after_seconds=after_seconds,
            tool=_text(doc, "tool", path, line_no),
        )


def load_trace(path: Path | str) -> list[TraceRequest]:
    trace = list(iter_trace(path))
    if not trace:
        raise TraceError(path, 0, "the trace holds no requests")
    return trace


def judged_from_seconds(trace: Sequence[TraceRequest], train_fraction: float) -> float:
    """The time that splits a trace for judging: models train on what came before it (the first
    `train_fraction` of its time span), replays count what comes after."""
    start, end = trace[0].arrival_seconds, trace[-1].arrival_seconds
    return start + train_fraction * (end - start)
