"""Turning a POST body into events: the fast path for good batches, per-event errors for bad ones.

A batch whose every event is valid is parsed in one pydantic pass straight from the bytes. Only
when that fails do we parse the JSON and validate event by event, so that the caller learns
exactly which events were rejected and why, and the valid ones still go in.

The work per request is bounded by the limits, not by what was sent (docs/decisions.md, 14):
the batch's events are counted, and each event's bytes measured, in one pass before anything is
parsed into objects whenever the body's commas allow more than `COMMAS_PER_EVENT` per allowed
event or the body is longer than one event may be (KVP_MAX_EVENT_BYTES); the fast pass stops at
the first bad event or at the limit; and the answer lists a bounded number of rejections.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from app.api.errors import HttpError
from app.core.config import Settings
from kvprefetch_client.events import EVENT_TYPES, Event, event_adapter

# The discriminator tags pydantic puts in an error's location: skipped in field paths.
_TAGS = frozenset(EVENT_TYPES) | {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
# Names pydantic puts in an error's location for the member of a union that failed.
_UNION_MEMBERS = frozenset({"int", "str", "constrained-int", "constrained-str", "list[str]"})

# A body with at most this many commas per allowed event goes straight to pydantic: parsing it
# costs at most that many JSON values per event. Real events have about 15 (a prompt's block
# hashes); a body with more is counted first (count_events).
COMMAS_PER_EVENT = 64
DEFAULT_MAX_EVENT_BYTES: int = Settings.model_fields["max_event_bytes"].default
# What one answer lists: rejections per event, rejections in all, and the longest echoed strings.
MAX_REJECTIONS_PER_EVENT = 3
MAX_REJECTIONS_PER_ANSWER = 100
MAX_ECHOED_ID_CHARS = 128  # an event id's own limit (client/kvprefetch_client/events.py, EventId)
MAX_FIELD_PATH_CHARS = 160
MAX_MESSAGE_CHARS = 400  # pydantic's messages may quote what was sent (an unknown type's tag)


class Rejection(BaseModel):
    index: int
    event_id: str | None = Field(
        description="The event's id when it is a valid id (a string of 1 to 128 "
        "characters); otherwise null."
    )
    field: str
    message: str


class IngestResponse(BaseModel):
    """
    What POST /v1/events answers: every event of the batch is accepted, a duplicate, or rejected.
    """

    model_config = ConfigDict(
        json_schema_extra={
            "description": (
                "Every event of the batch is in `accepted`, in `duplicates`, or rejected. "
                f"`rejected` lists at most {MAX_REJECTIONS_PER_EVENT} rejections per event and "
                f"{MAX_REJECTIONS_PER_ANSWER} in all; "
                "a 422 also counts the rejected events and the rejections left out."
            )
        }
    )

    accepted: list[str]
    duplicates: list[str]
    rejected: list[Rejection]
    rejected_events: int | None = Field(
        None, description="In a 422: how many events were rejected, listed in `rejected` or not."
    )
    rejections_omitted: int | None = Field(
        None, description="In a 422: how many rejections the caps left out of `rejected`."
    )


class BatchError(HttpError):
    """The body as a whole is unusable (not JSON, wrong shape, too many events)."""


@dataclass(slots=True)
class ParsedBatch:
    events: list[Event] = field(default_factory=list)
    # Listed in the answer: bounded per event and in all.
    rejected: list[Rejection] = field(default_factory=list)
    # Every rejected event's index and first field (for the metrics), listed or not.
    rejected_first: list[tuple[int, str]] = field(default_factory=list)
    rejections_omitted: int = 0
    # Each event's index in the posted batch; None: 0, 1, ... (nothing was rejected).
    indices: list[int] | None = None

    def merge(self, part: ParsedBatch, offset: int) -> None:
        """Appends what a later slice of the batch (its events from `offset` on) parsed to."""
        assert self.indices is not None
        self.events += part.events
        if part.indices is None:
            self.indices += range(offset, offset + len(part.events))
        else:
            self.indices += part.indices
        self.rejected_first += part.rejected_first
        self.rejections_omitted += part.rejections_omitted
        for rejection in part.rejected:
            if len(self.rejected) < MAX_REJECTIONS_PER_ANSWER:
                self.rejected.append(rejection)
            else:
                self.rejections_omitted += 1

    def reject(self, index: int, event_id: str, field: str, message: str) -> None:
        """One more event rejected after parsing (the ingestor's refusals of `ts`), listed while
        the answer has room."""
        self.rejected_first.append((index, field))
        if len(self.rejected) < MAX_REJECTIONS_PER_ANSWER:
            self.rejected.append(
                Rejection(index=index, event_id=event_id, field=field, message=message)
            )
        else:
            self.rejections_omitted += 1


def field_path(prefix: str, loc: tuple[Any, ...]) -> str:
    """('events', 3, 'request_routed', 'prompt_tokens') -> 'events[3].prompt_tokens'."""
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _TAGS or part in _UNION_MEMBERS or part.startswith("function-"):
            continue
        else:
            path += f".{part}" if path else part
    return path


def clean_message(msg: str) -> str:
    return msg.removeprefix("Value error, ")


def _too_many(max_events: int, got: str) -> BatchError:
    return BatchError(413, "events", f"a batch holds at most {max_events} events, got {got}")


def _too_long(max_event_bytes: int, index: int) -> BatchError:
    if index < 0:
        return BatchError(
            413,
            "body",
            f"a value outside the batch's events is over {max_event_bytes} bytes "
            "(KVP_MAX_EVENT_BYTES)",
        )
    return BatchError(
        413,
        f"events[{index}]",
        f"an event holds at most {max_event_bytes} bytes (KVP_MAX_EVENT_BYTES); "
        f"events[{index}] is longer",
    )


# The JSON structure's bytes for scan_batch: +1 opens, -1 (255) closes; and every structural byte.
_DEPTH_STEP = bytes(1 if b in b"{[" else 255 if b in b"}]" else 0 for b in range(256))
_STRUCTURE = bytes(1 if b in b",{}[]" else 0 for b in range(256))
_QUOTE = bytes(1 if b == ord('"') else 0 for b in range(256))
_COUNT_CHUNK_BYTES = 1 << 16


@dataclass(frozen=True, slots=True)
class BatchScan:
    """What scan_batch found: the events counted (past `stop_above`, a lower bound), and the
    first value longer than `max_value_bytes`: an event's index, or -1 for a value outside the
    batch's array (its key, or a top-level value of another shape)."""

    events: int
    oversized: int | None = None
    # With `separators`: the offsets of the events' array's brackets and of the commas between
    # its events, when the body is `{"events": [...]}` alone; else None.
    separators: list[int] | None = None


def scan_batch(
    body: bytes, stop_above: int, max_value_bytes: int, separators: bool = False
) -> BatchScan:
    """One pass over the body's bytes with numpy, before anything is parsed: it counts the values
    of the arrays nested one level in the top-level value (for a batch, its events; an upper bound
    for other shapes), and measures the bytes between the structural characters (commas,
    brackets) at depth 2 or less, outside strings: no event, and no value around the events, is
    longer than the longest such run. It stops once past `stop_above` events or at the first run
    over `max_value_bytes`, so a flood, or one huge event, costs no more than the limits."""
    # The structural bytes at depth 1 or less, the events' array's opening and its commas
    # (at most stop_above of them are kept: more, and the body is refused anyway).
    seps: list[int] | None = [] if separators else None
    escapes = b"\\" in body
    escaped_first = False  # the chunk's first byte is escaped (the last one ended in a backslash)
    inside_string = depth = commas = 0
    # The last structural byte at depth 2 or less: its offset, its depth, the events before it.
    mark, mark_depth, mark_commas = -1, 0, 0
    for start in range(0, len(body), _COUNT_CHUNK_BYTES):
        chunk = body[start : start + _COUNT_CHUNK_BYTES]
        if escapes:
            # Escaped characters blanked in place (offsets kept), chunk by chunk so that a pass
            # that stops early copies no more: no quote left is escaped.
            if escaped_first:
                chunk = b"_" + chunk[1:]
            chunk = chunk.replace(b"\\\\", b"__").replace(b'\\"', b"__")
            escaped_first = chunk.endswith(b"\\")
        raw = np.frombuffer(chunk, dtype=np.uint8)
        # The low bit of the running quote count: 1 inside a string (uint8 wraps, keeping it).
        outside = np.cumsum(np.frombuffer(chunk.translate(_QUOTE), dtype=np.uint8), dtype=np.uint8)
        outside += inside_string + 1
        outside &= 1
        inside_string = 1 - int(outside[-1])
        # int32: no nesting a body can hold wraps it, so a deep value never looks shallow.
        steps = np.frombuffer(chunk.translate(_DEPTH_STEP), dtype=np.int8).astype(np.int32)
        steps *= outside
        at = np.cumsum(steps, dtype=np.int32)
        at += depth
        depth = int(at[-1])
        counted = raw == ord(",")
        counted &= at == 2
        counted &= outside.view(bool)
        marks = np.frombuffer(chunk.translate(_STRUCTURE), dtype=bool) & outside.view(bool)
        marks &= at <= 2
        where = np.flatnonzero(marks)
        if len(where):
            # A run ends with its mark: an object's or array's closing bracket counts.
            runs = np.diff(where, prepend=mark - start)
            over = np.flatnonzero(runs > max_value_bytes)
            if len(over):
                j = int(over[0])
                if j > 0:
                    before = int(where[j - 1])
                    mark_depth = int(at[before])
                    mark_commas = commas + int(np.count_nonzero(counted[: before + 1]))
                return BatchScan(commas + 1, mark_commas if mark_depth == 2 else -1)
            last = int(where[-1])
            mark, mark_depth = start + last, int(at[last])
            mark_commas = commas + int(np.count_nonzero(counted[: last + 1]))
        if seps is not None:
            # Every mark but an event's own closing bracket.
            ends = steps == -1
            ends &= at == 2
            seps.extend((np.flatnonzero(marks & ~ends) + start).tolist())
            if len(seps) > stop_above + 4:
                seps = None
        commas += int(np.count_nonzero(counted))
        if commas + 1 > stop_above:
            break
        if start + len(chunk) - mark > max_value_bytes:
            return BatchScan(commas + 1, mark_commas if mark_depth == 2 else -1)
    return BatchScan(commas + 1, None, _batch_separators(body, seps))


_BATCH_HEAD = re.compile(rb'\s*\{\s*"events"\s*:\s*')
_SPACE = re.compile(rb"\s*")


def _batch_separators(body: bytes, seps: list[int] | None) -> list[int] | None:
    """`seps` from `[` to `]` when they are a `{"events": [...]}` body's alone."""
    if seps is None or len(seps) < 4:
        return None
    first, opening, closing, last = seps[0], seps[1], seps[-2], seps[-1]
    if (body[opening], body[closing], body[last]) != (ord("["), ord("]"), ord("}")):
        return None
    if not _BATCH_HEAD.fullmatch(body, 0, opening) or body[first] != ord("{"):
        return None
    if not (_SPACE.fullmatch(body, closing + 1, last) and _SPACE.fullmatch(body, last + 1)):
        return None
    inner = seps[1:-1]
    if any(body[i] != ord(",") for i in inner[1:-1]):
        return None  # a second array, or a value beside the events
    return inner


def count_events(body: bytes, stop_above: int) -> int:
    """How many values the body's arrays nested one level in its top-level value hold together
    (for a batch, its events); it stops once past `stop_above`. An upper bound for other shapes."""
    return scan_batch(body, stop_above, len(body)).events


class BatchParser:
    """Parses POST /v1/events bodies for one limit of events per batch."""

    def __init__(self, max_events: int, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self.max_events = max_events
        self.max_event_bytes = max_event_bytes
        self._long_bodies = asyncio.Lock()

        class _Batch(BaseModel):
            model_config = ConfigDict(extra="forbid")
            # fail_fast: a bad event ends the pass (the slow path names it); max_length: so does
            # one event past the limit.
            events: Annotated[list[Event], Field(max_length=max_events, fail_fast=True)]

        self._adapter: TypeAdapter[Any] = TypeAdapter(_Batch)

    def parse(self, body: bytes) -> ParsedBatch:
        """The whole body in one pass (the service uses parse_async)."""
        counted, _ = self._bound(body)
        return self._parse(body, counted)

    async def parse_async(self, body: bytes) -> ParsedBatch:
        """As parse; but a body longer than one event may be is parsed a slice of whole events
        at a time, each at most KVP_MAX_EVENT_BYTES, one such body at a time, and after each
        step the event loop is left to the rest for as long as the step took: long bodies hold
        it for one slice's parse at a time, and for at most half of its time."""
        if len(body) <= self.max_event_bytes:
            counted, _ = self._bound(body)
            return self._parse(body, counted)
        async with self._long_bodies:
            started = time.perf_counter()
            _, seps = self._bound(body)
            assert seps is not None  # a long body is refused unless it has them
            await asyncio.sleep(time.perf_counter() - started)
            parsed = ParsedBatch(indices=[])
            first, n = 0, len(seps) - 1
            while first < n:
                end = first + 1
                while end < n and seps[end + 1] - seps[first] <= self.max_event_bytes:
                    end += 1
                started = time.perf_counter()
                part = b'{"events":[' + body[seps[first] + 1 : seps[end]] + b"]}"
                parsed.merge(self._parse(part, True, first), first)
                first = end
                await asyncio.sleep(time.perf_counter() - started)
        if not parsed.rejected_first:
            parsed.indices = None
        return parsed

    def _bound(self, body: bytes) -> tuple[bool, list[int] | None]:
        """Refuses a body past the limits before anything is parsed: (whether its events are
        known to fit, and for a body longer than one event may be, its events' separators)."""
        max_events = self.max_events
        bound = body.count(b",") + 1  # no array in the body holds more values
        long = len(body) > self.max_event_bytes  # a shorter body holds no event over the limit
        if bound <= COMMAS_PER_EVENT * max_events and not long:
            return bound <= max_events, None
        scan = scan_batch(body, max_events, self.max_event_bytes, separators=long)
        if scan.events > max_events:
            raise _too_many(max_events, f"more than {max_events}")
        if scan.oversized is not None:
            raise _too_long(self.max_event_bytes, scan.oversized)
        if long and scan.separators is None:
            raise BatchError(
                422,
                "body",
                f"a body longer than {self.max_event_bytes} bytes (KVP_MAX_EVENT_BYTES) must be "
                '{"events": [...]} alone',
            )
        return True, scan.separators

    def _parse(self, body: bytes, counted: bool, offset: int = 0) -> ParsedBatch:
        """`body`, within the limits, parsed; its events numbered from `offset`."""
        max_events = self.max_events
        try:
            batch = self._adapter.validate_json(body)
        except ValidationError as exc:
            for err in exc.errors(include_url=False, include_input=False):
                if err["type"] == "too_long" and tuple(err["loc"]) == ("events",):
                    actual = (err.get("ctx") or {}).get("actual_length")
                    raise _too_many(
                        max_events, str(actual) if actual else f"more than {max_events}"
                    ) from None
            if not counted and count_events(body, max_events) > max_events:
                raise _too_many(max_events, f"more than {max_events}") from None
            return _parse_slowly(body, max_events, offset)
        if not batch.events:
            raise BatchError(422, "events", "a batch holds at least one event")
        return ParsedBatch(events=batch.events)


def parse_batch(
    body: bytes, max_events: int, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES
) -> ParsedBatch:
    """One body through a parser of its own (the service keeps one: app/api/deps.py
    BatchParserDep)."""
    return BatchParser(max_events, max_event_bytes).parse(body)


def _parse_slowly(body: bytes, max_events: int, offset: int = 0) -> ParsedBatch:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BatchError(400, "body", f"the body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BatchError(422, "body", 'the body must be a JSON object: {"events": [...]}')
    extra = sorted(set(doc) - {"events"})
    if extra:
        raise BatchError(
            422, _clip(extra[0], MAX_FIELD_PATH_CHARS), "unknown field: a batch has only 'events'"
        )
    raw_events = doc.get("events")
    if not isinstance(raw_events, list):
        raise BatchError(
            422,
            "events",
            "'events' must be a list of events" if "events" in doc else "'events' is required",
        )
    if not raw_events:
        raise BatchError(422, "events", "a batch holds at least one event")
    if len(raw_events) > max_events:
        raise _too_many(max_events, str(len(raw_events)))
    parsed = ParsedBatch(indices=[])
    for i, raw in enumerate(raw_events, offset):
        try:
            parsed.events.append(event_adapter.validate_python(raw))
            parsed.indices.append(i)  # type: ignore[union-attr]
        except ValidationError as exc:
            _reject(parsed, i, raw, exc)
    return parsed


def _reject(parsed: ParsedBatch, index: int, raw: object, exc: ValidationError) -> None:
    """Lists at most MAX_REJECTIONS_PER_EVENT of an event's errors while the answer has room, and
    counts the rest: an answer stays a small multiple of its request (docs/decisions.md, 14)."""
    event_id = raw.get("event_id") if isinstance(raw, dict) else None
    if not (isinstance(event_id, str) and 0 < len(event_id) <= MAX_ECHOED_ID_CHARS):
        event_id = None  # only a valid id is echoed: whatever else was sent is not repeated
    fields_named: set[str] = set()
    listed = 0
    for err in exc.errors(include_url=False, include_input=False, include_context=False):
        path = _clip(field_path(f"events[{index}]", tuple(err["loc"])), MAX_FIELD_PATH_CHARS)
        if path in fields_named:
            continue  # a union reports each member's failure; the first one is enough
        if not fields_named:
            parsed.rejected_first.append((index, path))
        fields_named.add(path)
        if listed < MAX_REJECTIONS_PER_EVENT and len(parsed.rejected) < MAX_REJECTIONS_PER_ANSWER:
            parsed.rejected.append(
                Rejection(
                    index=index,
                    event_id=event_id,
                    field=path,
                    message=_clip(clean_message(err["msg"]), MAX_MESSAGE_CHARS),
                )
            )
            listed += 1
        else:
            parsed.rejections_omitted += 1


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
