"""Mooncake-format traces: one JSON object a line, timestamps in milliseconds.

    {"timestamp": 27000, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

`hash_ids` holds one id per `block_tokens`-token block of the prompt, prefix-chained: two
requests share id k at position i only if their first i+1 blocks are identical.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from app.core.errors import KvpError


class TraceError(KvpError):
    """A trace line that is not a valid request; names the file and line."""

    def __init__(self, path: Path | str, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path = str(path)
        self.line = line


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    arrival_seconds: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


_FIELDS = {"timestamp", "input_length", "output_length", "hash_ids"}


def _int(doc: dict, key: str, path: Path, line: int, minimum: int = 0) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(path, line, f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(path, line, f"{key} must be >= {minimum}, got {value}")
    return value


def iter_trace(path: Path | str) -> Iterator[TraceRequest]:
    """Requests in file order. A malformed line stops the read with its file and line number."""
    path = Path(path)
    try:
        f = open(path, "rb")  # noqa: SIM115
    except OSError as exc:
        raise TraceError(path, 0, f"cannot open: {exc.strerror}") from exc
    with f:
        index = 0
        last_ts = -1
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                doc = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise TraceError(path, line_no, f"not JSON: {exc}") from None
            if not isinstance(doc, dict):
                raise TraceError(path, line_no, "a line must be a JSON object")
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
            yield TraceRequest(
                index=index,
                arrival_seconds=ts / 1000.0,
                input_tokens=_int(doc, "input_length", path, line_no),
                output_tokens=_int(doc, "output_length", path, line_no),
                hash_ids=tuple(hash_ids),
            )
            index += 1


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
