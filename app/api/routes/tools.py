"""GET /v1/tools: each tool's run times and its calls in flight (app/predict/tool_durations.py),
for operators and the dashboard."""

from __future__ import annotations

import statistics
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, Field

from app.api.deps import ClockDep, SettingsDep, TokensDep, ToolsDep
from app.api.errors import Error, error_response
from app.api.routes.dashboard import shows_session_ids
from app.predict.tool_durations import RunningTool, ToolReturn

MAX_LIMIT = 1000


def validation_error(request: Request, error: dict[str, Any]) -> Response:
    """A bad query parameter, named (app/api/errors.py answers with it)."""
    name = str(error["loc"][-1])
    got = request.query_params.get(name)
    return error_response(
        422,
        name,
        f"the query parameter {name} must be a whole number from 1 to {MAX_LIMIT}, not {got!r}",
    )


router = APIRouter(tags=["tools"])


class ToolCall(BaseModel):
    session_id: str | None = Field(
        description="Null unless KVP_DASHBOARD_SHOW_SESSION_IDS or the caller presents a token"
    )
    tool: str | None = Field(description="The tool as posted (under `other`: its own name)")
    started_at: float
    running_seconds: float
    predicted_return_at: float | None = Field(
        description="The start plus the tool's median run given how long this one has run; "
        "null when it outlasted every run seen (or none was seen)"
    )


class ToolReturned(BaseModel):
    started_at: float
    predicted_return_at: float | None = Field(
        description="As predicted at the start: the start plus the tool's median then"
    )
    returned_at: float
    error_seconds: float | None = Field(description="returned_at - predicted_return_at")


class ToolFigures(BaseModel):
    tool: str = Field(description="A tracked tool's name, or `other` for the rest pooled")
    calls: int = Field(description="Runs measured (returned)")
    p50_seconds: float | None
    p90_seconds: float | None
    in_flight: int
    running: list[ToolCall] = Field(description="The longest-running calls, oldest first")
    returns: list[ToolReturned] = Field(description="The latest returns, oldest first")
    return_error_p50_seconds: float | None = Field(
        description="The median of |error_seconds| over `returns`"
    )


class ToolsStatus(BaseModel):
    now: float
    tracked_max: int = Field(description="KVP_TOOLS_TRACKED")
    in_flight: int
    expired: int = Field(description="Calls never seen returning (KVP_TOOL_MAX_RUN_SECONDS)")
    tools: list[ToolFigures]


@router.get(
    "/tools",
    response_model=ToolsStatus,
    summary="Each tool's run times and its calls in flight",
    responses={422: {"model": Error, "description": "`limit` is not a number from 1 to 1000."}},
)
async def tools_status(
    request: Request,
    tools: ToolsDep,
    clock: ClockDep,
    settings: SettingsDep,
    tokens: TokensDep,
    limit: Annotated[
        int, Query(ge=1, le=MAX_LIMIT, description="The most calls in flight listed per tool")
    ] = 20,
) -> ToolsStatus:
    """Per tool (the KVP_TOOLS_TRACKED most frequent, then `other`): calls measured, p50 and
    p90 run time, calls in flight, the `limit` longest-running of them with their predicted
    return, and the latest returns, each against the return predicted at its start. Times are
    event times (seconds since the epoch, as the signals' `ts`); `now` is the service clock."""
    now = clock.now()
    show_ids = shows_session_ids(request, settings, tokens)
    running = tools.oldest_running(now, limit)
    return ToolsStatus(
        now=now,
        tracked_max=tools.tracked,
        in_flight=tools.in_flight,
        expired=tools.expired,
        tools=[
            ToolFigures(
                tool=s.tool,
                calls=s.calls,
                p50_seconds=s.p50_seconds,
                p90_seconds=s.p90_seconds,
                in_flight=s.in_flight,
                running=[_call(r, show_ids) for r in running.get(s.tool, [])],
                returns=[_returned(r) for r in s.returns],
                return_error_p50_seconds=_error_p50(s.returns),
            )
            for s in tools.summaries()
            if s.calls or s.in_flight
        ],
    )


def _call(r: RunningTool, show_ids: bool) -> ToolCall:
    return ToolCall(
        session_id=r.session_id if show_ids else None,
        tool=r.tool,
        started_at=r.started_at,
        running_seconds=r.running_seconds,
        predicted_return_at=r.predicted_return_at,
    )


def _returned(r: ToolReturn) -> ToolReturned:
    predicted = r.predicted_return_at
    return ToolReturned(
        started_at=r.started_at,
        predicted_return_at=predicted,
        returned_at=r.returned_at,
        error_seconds=None if predicted is None else r.returned_at - predicted,
    )


def _error_p50(returns: tuple[ToolReturn, ...]) -> float | None:
    errors = [
        abs(r.returned_at - r.predicted_return_at)
        for r in returns
        if r.predicted_return_at is not None
    ]
    return statistics.median(errors) if errors else None
