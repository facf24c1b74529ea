"""POST /v1/events: the one door for routers, engines and transfer agents."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response

from app.api.auth import EventsCaller, Refused, charge
from app.api.batch import BatchError, IngestResponse
from app.api.bindings import check_bound_events
from app.api.deps import (
    BacklogDep,
    BatchParserDep,
    EngineDep,
    EventLimiterDep,
    MetricsDep,
    SettingsDep,
)
from app.api.errors import Error, error_response
from app.core.errors import EventLogError, StoreError
from app.core.security import Principal, Scope
from kvprefetch_client.events import RECORD_EVENT_TYPES, Event

router = APIRouter(tags=["events"])

# What a token with the agent scope alone may post: its orders' progress and what it moved.
AGENT_EVENT_TYPES = frozenset(
    {"order_progress", "kv_blocks_stored", "kv_blocks_removed", "kv_blocks_cleared"}
)

_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": IngestResponse, "description": "Every event was accepted or was a duplicate."},
    400: {"model": Error, "description": "The body is not JSON."},
    403: {
        "model": Error,
        "description": "An agent-scope token posted an event type only the ingest scope may "
        "post, or a bound token an event of an instance or agent it does not act for.",
    },
    413: {"model": Error, "description": "The body or the batch is too large."},
    415: {
        "model": Error,
        "description": "The body is not application/json, or is compressed (Content-Encoding).",
    },
    # Two shapes (docs/decisions.md, 2): a batch with bad events lists them, and its valid ones
    # were accepted; a body that is no batch at all (not an object, no events) is an Error.
    422: {
        "model": IngestResponse | Error,
        "description": "Some events were rejected and the valid ones of the batch were accepted "
        "(IngestResponse); or the body is not a batch of events, and nothing was (Error).",
    },
    503: {
        "model": Error,
        "description": "The store, the event log or the planning backlog is unavailable or "
        "full; retry later.",
    },
}


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BatchError(413, "body", f"the body is {declared} bytes; the limit is {limit}")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BatchError(413, "body", f"the body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


@router.post(
    "/events",
    responses=_RESPONSES,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/EventBatch"}}
            },
        }
    },
    summary="Post a batch of events",
)
async def post_events(
    request: Request,
    caller: EventsCaller,
    engine: EngineDep,
    settings: SettingsDep,
    metrics: MetricsDep,
    backlog: BacklogDep,
    parser: BatchParserDep,
    limiter: EventLimiterDep,
) -> Response:
    """Accept a batch of events. Valid events are logged durably and applied before the answer.

    A batch with some invalid events is answered 422, and its valid events are still accepted:
    resending the whole batch is safe, since accepted ids come back as duplicates.
    """
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        metrics.batch_refused(415)
        return error_response(415, "content-type", "send the batch as application/json")
    try:
        body = await read_body(request, settings.max_body_bytes)
        parsed = await parser.parse_async(body)
        check_agent_events(caller, parsed.events, parsed.indices)
        check_no_records(parsed.events, parsed.indices)
        check_bound_events(caller, parsed.events, parsed.indices, engine.order_owner)
    except BatchError as exc:
        metrics.batch_refused(exc.status_code)
        return error_response(exc.status_code, exc.field, exc.message)
    try:
        await charge(request, caller, limiter, "events", len(parsed.events))
    except Refused:
        metrics.batch_refused(429)
        raise

    try:
        result = await engine.ingest_async(
            parsed.events, body if not parsed.rejected else None, check_room=True
        )
    except (StoreError, EventLogError):  # answered 503 by the app's handlers; nothing was accepted
        metrics.batch_refused(503)
        raise
    if result is None:
        metrics.batch_refused(503)
        return error_response(
            503,
            "backlog",
            f"the planning side is behind: {backlog.events} events wait "
            f"(KVP_BACKLOG_MAX_EVENTS {backlog.max_events}); retry later",
            {"Retry-After": "1"},
        )
    for refused in result.rejected:  # the ingestor's refusals, indexed as posted
        index = parsed.indices[refused.index] if parsed.indices is not None else refused.index
        parsed.reject(index, refused.event_id, f"events[{index}].{refused.field}", refused.message)
    if result.rejected:
        parsed.rejected.sort(key=lambda r: r.index)
        parsed.rejected_first.sort()
    metrics.batch_answered(duplicates=len(result.duplicates), rejected_fields=parsed.rejected_first)
    payload: dict[str, object] = {
        "accepted": result.accepted,
        "duplicates": result.duplicates,
        "rejected": [r.model_dump() for r in parsed.rejected],
    }
    if parsed.rejected_first:
        payload["rejected_events"] = len(parsed.rejected_first)
        payload["rejections_omitted"] = parsed.rejections_omitted
    return Response(
        orjson.dumps(payload),
        status_code=422 if parsed.rejected_first else 200,
        media_type="application/json",
    )


def check_no_records(events: Sequence[Event], indices: Sequence[int] | None) -> None:
    """BatchError 422 at the first of the service's own records (model_changed): written by the
    service at each model change, never posted, so the log's lineage is the service's word."""
    for n, event in enumerate(events):
        if event.type in RECORD_EVENT_TYPES:
            i = indices[n] if indices is not None else n
            raise BatchError(
                422,
                f"events[{i}].type",
                f"{event.type} is written by the service itself at each model change; "
                "it is not posted; nothing accepted",
            )


def check_agent_events(
    caller: Principal, events: list[Event], indices: Sequence[int] | None
) -> None:
    """BatchError 403 at the first event an agent-scope token may not post (`indices`: each
    event's position in the posted batch, when some were rejected before)."""
    if Scope.INGEST in caller.scopes:
        return
    for n, event in enumerate(events):
        if event.type not in AGENT_EVENT_TYPES:
            i = indices[n] if indices is not None else n
            raise BatchError(
                403,
                f"events[{i}].type",
                "a token with the agent scope alone may post only "
                f"{', '.join(sorted(AGENT_EVENT_TYPES))} events, not {event.type}; "
                "nothing of the batch was accepted",
            )
