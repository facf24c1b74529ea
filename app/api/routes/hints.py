"""POST /v1/route-hint: where a session's context is among a router's candidate instances, and
which one to send its next request to (app/decide/hints.py does the work)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.api.deps import ClockDep, HintConfigDep, SchedulerDep, StoreDep, StoreThreadDep
from app.api.errors import Error
from app.decide.hints import route_hint
from kvprefetch_client.events import Ident, InstanceId

# A router asks about the instances it could pick; a fleet larger than this is asked in parts.
# A hint costs about log2(context blocks) residency lookups per candidate (app/decide/hints.py),
# so this bounds the time one hint holds the event loop.
MAX_CANDIDATES = 64

router = APIRouter(tags=["routing"])


class RouteHintRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [{"session_id": "chat-42", "candidates": ["gpu-0", "gpu-1", "gpu-2"]}]
        },
    )

    session_id: Ident = Field(description="The session whose next request is being routed")
    candidates: list[InstanceId] = Field(
        min_length=1,
        max_length=MAX_CANDIDATES,
        description="Instance ids the router could send it to, distinct",
    )

    @field_validator("candidates")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        seen: set[str] = set()
        for c in v:
            if c in seen:
                raise ValueError(f"{c!r} is listed twice; candidates must be distinct")
            seen.add(c)
        return v


class CandidateHintModel(BaseModel):
    instance_id: str
    resident_bytes: int = Field(description="The context's bytes in this instance's HBM now")
    inflight_bytes: int = Field(
        description="Bytes not there yet but in an open prefetch order to it"
    )
    missing_bytes: int = Field(description="The rest: to load or recompute")
    source: str = Field(
        description="Where the missing bytes come from: none, host, pool, host+pool, recompute"
    )
    expected_load_seconds: float = Field(description="Until the whole context is in HBM here")
    queue_depth: int | None = Field(
        description="Requests queued (last instance_status); null: never said"
    )
    running_requests: int | None
    expected_wait_seconds: float = Field(description="Queue wait before a slot frees up")
    expected_seconds: float = Field(
        description="expected_load_seconds + expected_wait_seconds: what is ranked"
    )
    recommended: bool
    reason: str


class RouteHintResponse(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "session_id": "chat-42",
                    "context_known": True,
                    "context_bytes": 2296053760,
                    "recommended": "gpu-0",
                    "reason": "gpu-0: 0.000 s to start against 0.188 s on gpu-1",
                    "candidates": [
                        {
                            "instance_id": "gpu-0",
                            "resident_bytes": 2348810240,
                            "inflight_bytes": 0,
                            "missing_bytes": 0,
                            "source": "none",
                            "expected_load_seconds": 0.0,
                            "queue_depth": 0,
                            "running_requests": 9,
                            "expected_wait_seconds": 0.0,
                            "expected_seconds": 0.0,
                            "recommended": True,
                            "reason": (
                                "14/14 blocks in HBM, ready in 0.000 s; 0 queued, 9 running, "
                                "wait 0.000 s"
                            ),
                        },
                        {
                            "instance_id": "gpu-1",
                            "resident_bytes": 0,
                            "inflight_bytes": 0,
                            "missing_bytes": 2348810240,
                            "source": "pool",
                            "expected_load_seconds": 0.187905,
                            "queue_depth": 0,
                            "running_requests": 4,
                            "expected_wait_seconds": 0.0,
                            "expected_seconds": 0.187905,
                            "recommended": False,
                            "reason": (
                                "0/14 blocks in HBM, rest by pool, ready in 0.188 s; 0 queued, "
                                "4 running, wait 0.000 s"
                            ),
                        },
                    ],
                }
            ]
        }
    )

    session_id: str
    context_known: bool = Field(
        description="False: no event named this session's blocks (a new session); "
        "every load is 0 and the least loaded candidate is recommended"
    )
    context_bytes: int
    recommended: str = Field(description="The candidate to send the request to")
    reason: str
    candidates: list[CandidateHintModel] = Field(description="In the order asked for")


@router.post(
    "/route-hint",
    response_model=RouteHintResponse,
    responses={
        400: {"model": Error, "description": "The body is not JSON."},
        422: {
            "model": Error,
            "description": "A field is missing or bad: no candidates, a candidate "
            "twice, more than 64, an id out of bounds.",
        },
    },
    summary="Which candidate instance to route a session's next request to",
)
async def post_route_hint(
    body: RouteHintRequest,
    store: StoreDep,
    config: HintConfigDep,
    clock: ClockDep,
    scheduler: SchedulerDep,
    store_thread: StoreThreadDep,
) -> RouteHintResponse:
    """For each candidate: the session's context bytes resident in its HBM, on their way there
    (open prefetch orders), and missing; where the missing bytes would come from and how long
    until all of it is there; its queue and running requests (last `instance_status`) and the
    wait they mean. The candidate with the least load + wait is recommended, ties to the less
    loaded. A session the service does not know is answered, not refused: `context_known` is
    false and the least loaded candidate is recommended."""
    inflight = scheduler.open_orders()
    # Off the loop with the Redis store (app/state/storethread.py): a hung Redis stalls this alone.
    hint = await store_thread.read(
        lambda: route_hint(
            store, body.session_id, body.candidates, clock.now(), config=config, inflight=inflight
        )
    )
    return RouteHintResponse(
        session_id=hint.session_id,
        context_known=hint.context_known,
        context_bytes=hint.context_bytes,
        recommended=hint.recommended,
        reason=hint.reason,
        candidates=[
            CandidateHintModel(
                instance_id=c.instance_id,
                resident_bytes=c.resident_bytes,
                inflight_bytes=c.inflight_bytes,
                missing_bytes=c.missing_bytes,
                source=c.source,
                expected_load_seconds=round(c.expected_load_seconds, 6),
                queue_depth=c.queue_depth,
                running_requests=c.running_requests,
                expected_wait_seconds=round(c.expected_wait_seconds, 6),
                expected_seconds=round(c.expected_seconds, 6),
                recommended=c.recommended,
                reason=c.reason,
            )
            for c in hint.candidates
        ],
    )
