"""Turning a POST body into events: the fast path for good batches, per-event errors for bad ones.

A batch whose every event is valid is parsed in one pydantic pass straight from the bytes. Only
when that fails do we parse the JSON and validate event by event, so that the caller learns
exactly which events were rejected and why, and the valid ones still go in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from app.engine.events import Event, batch_adapter, event_adapter

_TAGS = frozenset({
    "request_routed", "request_started", "request_finished", "session_closed",
    "kv_blocks_stored", "kv_blocks_removed", "kv_blocks_cleared", "vllm_kv_events",
    "instance_status", "order_progress", "BlockStored", "BlockRemoved", "AllBlocksCleared",
})
# Names pydantic puts in an error's location for the member of a union that failed.
_UNION_MEMBERS = frozenset({"int", "str", "constrained-int", "constrained-str", "list[str]"})


class Rejection(BaseModel):
    index: int
    event_id: str | None
    field: str
    message: str


class IngestResponse(BaseModel):
    """What POST /v1/events answers: every event of the batch is in exactly one list."""

    accepted: list[str]
    duplicates: list[str]
    rejected: list[Rejection]


class BatchError(Exception):
    """The body as a whole is unusable (not JSON, wrong shape, too many events)."""

    def __init__(self, status_code: int, field: str, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.field = field
        self.message = message


@dataclass(slots=True)
class ParsedBatch:
    events: list[Event] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    # Each event's index in the posted batch; None: 0, 1, ... (nothing was rejected).
    indices: list[int] | None = None


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


def parse_batch(body: bytes, max_events: int) -> ParsedBatch:
    try:
        batch = batch_adapter.validate_json(body)
    except ValidationError:
        return _parse_slowly(body, max_events)
    if not batch.events:
        raise BatchError(422, "events", "a batch holds at least one event")
    if len(batch.events) > max_events:
        raise BatchError(413, "events", f"a batch holds at most {max_events} events, got {len(batch.events)}")
    return ParsedBatch(events=batch.events)


def _parse_slowly(body: bytes, max_events: int) -> ParsedBatch:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BatchError(400, "body", f"the body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BatchError(422, "body", 'the body must be a JSON object: {"events": [...]}')
    extra = sorted(set(doc) - {"events"})
    if extra:
        raise BatchError(422, extra[0], "unknown field: a batch has only 'events'")
    raw_events = doc.get("events")
    if not isinstance(raw_events, list):
        raise BatchError(422, "events", "'events' must be a list of events" if "events" in doc else "'events' is required")
    if not raw_events:
        raise BatchError(422, "events", "a batch holds at least one event")
    if len(raw_events) > max_events:
        raise BatchError(413, "events", f"a batch holds at most {max_events} events, got {len(raw_events)}")
    parsed = ParsedBatch(indices=[])
    for i, raw in enumerate(raw_events):
        try:
            parsed.events.append(event_adapter.validate_python(raw))
            parsed.indices.append(i)  # type: ignore[union-attr]
        except ValidationError as exc:
            event_id = raw.get("event_id") if isinstance(raw, dict) else None
            fields_named: set[str] = set()
            for err in exc.errors(include_url=False):
                path = field_path(f"events[{i}]", tuple(err["loc"]))
                if path in fields_named:
                    continue  # a union reports each member's failure; the first one is enough
                fields_named.add(path)
                parsed.rejected.append(Rejection(
                    index=i,
                    event_id=event_id if isinstance(event_id, str) else None,
                    field=path,
                    message=clean_message(err["msg"]),
                ))
    return parsed
