"""Liveness and readiness for load balancers and orchestrators."""

from __future__ import annotations

from fastapi import APIRouter, Response
from pydantic import BaseModel

from app.api.deps import ClockDep, EngineDep, ModelsDep, SettingsDep, StoreHealthDep

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    status: str
    store: str
    store_ok: bool
    # Always "open" while the service runs; no path is shown (SECURITY.md).
    event_log: str
    predictor: str
    # The shadow model, "none (<why>)" when the configured one did not load, null when none is set.
    shadow: str | None
    # The store's counts at its last answered probe (empty before any), and how old they are.
    stats: dict[str, int]
    stats_age_seconds: float | None
    # The service's clock: now, and how many times faster than real time it runs (KVP_CLOCK_SPEED;
    # a replay over HTTP stamps its events by it).
    clock_ts: float
    clock_speed: float
    # With KVP_VLLM_KV_ENDPOINTS: "running", or "dead (restarting)" while its thread is down
    # (then 503); null without.
    vllm_intake: str | None = None


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process is alive: nothing else is looked at, the store least of all."""
    return Health(status="ok")


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
async def readyz(
    response: Response,
    settings: SettingsDep,
    health: StoreHealthDep,
    models: ModelsDep,
    clock: ClockDep,
    engine: EngineDep,
) -> Readiness:
    """The service can take events: its store answered a probe within KVP_OBSERVABILITY_WAIT_SECONDS
    (probed on a thread of its own, never waited for longer), and its vLLM intake, when it has
    one, runs."""
    fresh = await health.refresh(settings.observability_wait_seconds)
    store_ok = fresh is not None and fresh.ok
    intake = engine.vllm
    intake_ok = intake is None or intake.alive
    if not (store_ok and intake_ok):
        response.status_code = 503
    known = fresh if fresh is not None else health.last
    shadow = (
        models.shadow.description
        if models.shadow is not None
        else f"none ({models.shadow_problem})"
        if models.shadow_problem
        else None
    )
    return Readiness(
        status="ready" if store_ok and intake_ok else "unavailable",
        store=settings.store,
        store_ok=store_ok,
        event_log="open",
        predictor=models.serving.description,
        shadow=shadow,
        stats=known.stats,
        stats_age_seconds=known.stats_age_seconds(health.monotonic()),
        clock_ts=clock.now(),
        clock_speed=settings.clock_speed,
        vllm_intake=None if intake is None else "running" if intake_ok else "dead (restarting)",
    )
