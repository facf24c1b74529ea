"""Liveness and readiness for load balancers and orchestrators."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from app.api.deps import ModelsDep, SettingsDep, StoreDep
from app.core.errors import StoreError

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    status: str
    store: str
    store_ok: bool
    event_log: str
    predictor: str
    # The shadow model, "none (<why>)" when the configured one did not load, null when none is set.
    shadow: str | None
    stats: dict[str, int]


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process is alive."""
    return Health(status="ok")


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
async def readyz(request: Request, response: Response, settings: SettingsDep, store: StoreDep,
                 models: ModelsDep) -> Readiness:
    """The service can take events: its store answers and its event log is open."""
    try:
        store.ping()
        stats = store.stats()
        store_ok = True
    except StoreError:
        stats, store_ok = {}, False
    if not store_ok:
        response.status_code = 503
    shadow = (models.shadow.description if models.shadow is not None
              else f"none ({models.shadow_problem})" if models.shadow_problem else None)
    return Readiness(
        status="ready" if store_ok else "unavailable",
        store=settings.store,
        store_ok=store_ok,
        event_log=str(request.app.state.event_log.directory),
        predictor=models.serving.description,
        shadow=shadow,
        stats=stats,
    )
