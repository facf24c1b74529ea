"""The built-in dashboard: the page at /dashboard (app/static/) and the JSON it polls.

GET /v1/dashboard/series: the timeline's snapshots (app/observe/timeline.py) as columns;
GET /v1/dashboard/now: the current totals, per-instance queues and the sessions likely back next.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import FileResponse

from app.api.deps import (
    ClockDep,
    EngineDep,
    LedgerDep,
    MetricsDep,
    ModelsDep,
    SchedulerDep,
    SettingsDep,
    StoreDep,
    StoreHealthDep,
    StoreThreadDep,
    TimelineDep,
    TokensDep,
)
from app.api.errors import Error, error_response
from app.api.routes.model import comparison, counts
from app.core.config import Settings
from app.core.security import TokenTable
from app.decide.scheduler import Scheduler
from app.observe.ledger import AdviceLedger, AdviceRecord
from app.observe.signals import SignalFollowups
from app.observe.timeline import HISTORY_SECONDS, Timeline, instance_queues, series, top_sessions
from app.predict.slots import ModelSlots
from app.state.base import StateStore

STATIC_DIR = Path(__file__).resolve().parent.parent.parent / "static"
MAX_LIMIT = 1000

# What each query parameter takes, for the error that names it.
_RULES = {
    "since_seconds": f"a number of seconds, more than 0 and at most {HISTORY_SECONDS:g}",
    "limit": f"a whole number from 1 to {MAX_LIMIT}",
    "instances": f"a whole number from 1 to {MAX_LIMIT}",
}


def validation_error(request: Request, error: dict[str, Any]) -> Response:
    """A bad query parameter, named, with what it takes (app/api/errors.py answers with it)."""
    name = str(error["loc"][-1])
    got = request.query_params.get(name)
    rule = _RULES.get(name)
    message = (
        f"the query parameter {name} must be {rule}, not {got!r}"
        if rule is not None
        else f"{name}: {error['msg']}"
    )
    return error_response(422, name, message)


router = APIRouter(prefix="/dashboard", tags=["dashboard"])
page = APIRouter(include_in_schema=False)


_BAD_PARAM: dict[int | str, dict[str, Any]] = {
    422: {"model": Error, "description": "A query parameter is out of range or not a number."}
}


def _json(body: dict[str, Any]) -> Response:
    return Response(
        orjson.dumps(body), media_type="application/json", headers={"Cache-Control": "no-store"}
    )


@page.get("/dashboard")
async def dashboard_page() -> FileResponse:
    """The dashboard (app/static/dashboard.html, which polls the JSON below)."""
    return FileResponse(
        STATIC_DIR / "dashboard.html", media_type="text/html", headers={"Cache-Control": "no-cache"}
    )


@router.get("/series", responses=_BAD_PARAM, summary="The dashboard's time series")
async def dashboard_series(
    timeline: TimelineDep,
    settings: SettingsDep,
    since_seconds: Annotated[
        float, Query(gt=0, le=HISTORY_SECONDS, description="How far back, in seconds")
    ] = 600.0,
) -> Response:
    """The snapshots sampled in the last `since_seconds` (every KVP_DASHBOARD_SAMPLE_SECONDS), as
    columns: `ts` and, under `series`, one list per figure, each as long as `ts`. Running totals
    (hits, bytes, orders) since the process started (the hit counts since the model came in),
    the hit rates (`*_hit_rate` since the model came in, `*_recent_hit_rate` over the last
    `recent_window_seconds`), and the stall saved with its `stall_basis`. No samples yet: empty
    lists."""
    body = series(timeline, since_seconds, gpu_hour_price=settings.gpu_hour_price)
    body["interval_seconds"] = settings.dashboard_sample_seconds
    return _json(body)


def _slot(ledger: AdviceLedger, slot: str, predictor: str, version: str | None) -> dict[str, Any]:
    return {"predictor": predictor, "version": version, **counts(ledger.stats(slot))}


def shadow_comparison(ledger: AdviceLedger, limit: int) -> dict[str, Any] | None:
    """GET /v1/model's `comparison`, with the latest `limit` sessions the two models advised
    differently (newest first); None without a shadow."""
    compared = comparison(ledger)
    found = ledger.comparison()
    if compared is None or found is None:
        return None

    def advice(rec: AdviceRecord) -> dict[str, Any]:
        return {"retention": rec.retention, "prefetch": rec.prefetch, "p_keep": rec.p_keep}

    compared["disagreements"] = [
        {
            "session_id": d.session_id,
            "made_ts": d.made_ts,
            "context_bytes": d.context_bytes,
            "live": advice(d.live),
            "shadow": advice(d.shadow),
        }
        for d in found.latest[:limit]
    ]
    return compared


@router.get("/now", responses=_BAD_PARAM, summary="The dashboard's current figures")
async def dashboard_now(
    request: Request,
    engine: EngineDep,
    timeline: TimelineDep,
    settings: SettingsDep,
    clock: ClockDep,
    ledger: LedgerDep,
    models: ModelsDep,
    scheduler: SchedulerDep,
    store: StoreDep,
    store_thread: StoreThreadDep,
    health: StoreHealthDep,
    tokens: TokensDep,
    metrics: MetricsDep,
    limit: Annotated[
        int,
        Query(
            ge=1,
            le=MAX_LIMIT,
            description="The most sessions in top_sessions and in the models' disagreements",
        ),
    ] = 20,
    instances: Annotated[
        int, Query(ge=1, le=MAX_LIMIT, description="The most instances listed")
    ] = 50,
) -> Response:
    """Now: each model's counts and hit rate, the scheduler's totals, the prefetches landed, the
    stall saved (and its cost at KVP_GPU_HOUR_PRICE dollars per GPU-hour), per instance its open
    orders, the bytes on their way and its link backlog (most bytes first, up to `instances`),
    and the `limit` sessions most likely back soonest by the serving model's latest advice (their
    ids only with KVP_DASHBOARD_SHOW_SESSION_IDS or a valid token; else null). `store`: its last
    probe's health and counts with their age. When the store does not answer within
    KVP_OBSERVABILITY_WAIT_SECONDS, the last figures computed, with `stale_seconds` how old.
    `signals`: the session signals this process accepted, by kind (those seen), and how many were
    followed by a request of their session within `window_seconds`. `retrain`: the retraining
    schedule, as GET /v1/model/retrain answers."""

    def figures() -> dict[str, Any]:
        # On the store thread with the Redis store: it reads what the store thread changes.
        return now_figures(
            timeline, settings, clock.now(), ledger, models, scheduler, store, limit, instances
        )

    wait = settings.observability_wait_seconds
    done, body = (
        (True, figures())
        if not store_thread.offload
        else (False, None)
        if store_thread.stuck_seconds() > wait
        else await store_thread.run_within(wait, figures)
    )
    state = request.app.state
    if done:
        assert body is not None
        state.dashboard_last = (health.monotonic(), limit, instances, body)
    else:
        last = getattr(state, "dashboard_last", None)
        if last is None or last[1:3] != (limit, instances):
            return error_response(
                503,
                "store",
                "the state store is not answering; the dashboard's figures come back when it does",
                {"Retry-After": "1"},
            )
        body = {**last[3], "stale_seconds": health.monotonic() - last[0]}
    known = health.last
    body = {
        **body,
        "store": {
            "ok": known.ok,
            "stats": known.stats,
            "stats_age_seconds": known.stats_age_seconds(health.monotonic()),
        },
        "signals": signal_figures(metrics.signals),
        "retrain": engine.retrainer.status(),
    }
    if not shows_session_ids(request, settings, tokens):
        body["top_sessions"] = [{**row, "session_id": None} for row in body["top_sessions"]]
        compared = body["models"]["comparison"]
        if compared is not None:
            hidden = [{**row, "session_id": None} for row in compared["disagreements"]]
            body["models"] = {**body["models"], "comparison": {**compared, "disagreements": hidden}}
    return _json(body)


def shows_session_ids(request: Request, settings: Settings, tokens: TokenTable) -> bool:
    """Session ids may be user identities: shown when the operator opted in
    (KVP_DASHBOARD_SHOW_SESSION_IDS) or to a caller presenting a valid token."""
    if settings.dashboard_show_session_ids:
        return True
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    return (
        tokens.enabled
        and scheme.lower() == "bearer"
        and tokens.authenticate(credentials.strip()) is not None
    )


def now_figures(
    timeline: Timeline,
    settings: Settings,
    now: float,
    ledger: AdviceLedger,
    models: ModelSlots,
    scheduler: Scheduler,
    store: StateStore,
    limit: int,
    instances: int,
) -> dict[str, Any]:
    serving, shadow = models.serving, models.shadow
    t = scheduler.totals
    open_orders = scheduler.open_orders()
    stall = timeline.stall()
    price = settings.gpu_hour_price
    rows, total = instance_queues(scheduler, store, instances)
    landed = timeline.landed
    return {
        "now": now,
        "sample_interval_seconds": settings.dashboard_sample_seconds,
        "samples": len(timeline),
        "models": {
            "live": _slot(ledger, "live", serving.description, serving.version),
            "shadow": _slot(ledger, "shadow", shadow.description, shadow.version)
            if shadow is not None
            else None,
            "comparison": shadow_comparison(ledger, limit),
        },
        "scheduler": {
            "tracked_sessions": scheduler.tracked_sessions,
            "candidates": scheduler.candidates,
            "open_orders": len(open_orders),
            "inflight_bytes": sum(o.size_bytes for o in open_orders if o.kind == "prefetch"),
            "orders": dict(t.orders),
            "bytes_ordered": t.bytes_ordered,
            "completed": t.completed,
            "failed": t.failed,
            "cancelled": t.cancelled,
            # The landed prefetch bytes' ends (app/decide/order_book.py): used + wasted +
            # waiting = landed; the shares are of the landed bytes (None before any landed).
            "bytes_landed": t.bytes_landed,
            "bytes_used": t.bytes_used,
            "bytes_wasted": t.bytes_wasted,
            "bytes_waiting": t.bytes_waiting,
            "wasted_share": t.bytes_wasted / t.bytes_landed if t.bytes_landed else None,
            "used_share": t.bytes_used / t.bytes_landed if t.bytes_landed else None,
            "pins_held": scheduler.book.pins_held,
        },
        "prefetch": {
            "landed": landed.orders,
            "landed_bytes": landed.bytes,
            "transfer_seconds": landed.transfer_seconds,
        },
        "stall": {
            "seconds_saved": stall.seconds_saved,
            "basis": stall.basis,
            "seconds_incurred": stall.seconds_incurred,
            "expected_seconds_saved": landed.expected_stall_seconds,
            "gpu_hour_price": price,
            "cost_saved": stall.seconds_saved * price / 3600.0,
        },
        "instances": rows,
        "instances_total": total,
        "top_sessions": top_sessions(scheduler, limit, now, scheduler.config.bytes_per_block),
    }


def signal_figures(followups: SignalFollowups) -> dict[str, Any]:
    """Signals by kind (the kinds seen) and their followed share; totals over every kind."""
    kinds = [k for k in followups.totals() if k.signals]
    total = sum(k.signals for k in kinds)
    followed = sum(k.followed for k in kinds)
    return {
        "window_seconds": followups.window_seconds,
        "total": total,
        "followed": followed,
        "followed_share": followed / total if total else None,
        "kinds": [
            {
                "kind": k.kind,
                "signals": k.signals,
                "followed": k.followed,
                "followed_share": k.followed_share,
            }
            for k in kinds
        ],
    }
