"""Dependencies for the routes: the parts the service built at startup, kept on app.state.

Async on purpose: FastAPI runs a plain `def` dependency in a thread pool, a hop per request.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.core.clock import Clock
from app.core.config import Settings
from app.observe.ledger import AdviceLedger
from app.ingest.backlog import Backlog
from app.ingest.ingestor import Ingestor
from app.observe.metrics import Metrics
from app.predict.registry import ModelRegistry
from app.decide.scheduler import Scheduler
from app.deliver import OrderSink
from app.state.base import StateStore
from app.state.storethread import StoreHealth, StoreThread


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_store(request: Request) -> StateStore:
    return request.app.state.store


async def get_ingestor(request: Request) -> Ingestor:
    return request.app.state.ingestor


async def get_models(request: Request) -> ModelRegistry:
    return request.app.state.models


async def get_ledger(request: Request) -> AdviceLedger:
    return request.app.state.ledger


async def get_clock(request: Request) -> Clock:
    return request.app.state.clock


async def get_order_sink(request: Request) -> OrderSink:
    return request.app.state.order_sink


async def get_scheduler(request: Request) -> Scheduler:
    return request.app.state.scheduler


async def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


async def get_backlog(request: Request) -> Backlog:
    return request.app.state.backlog


async def drain_backlog(request: Request) -> None:
    """For routes reading what the planning side derives from events (app/ingest/backlog.py)."""
    await request.app.state.store_thread.run(request.app.state.backlog.drain, fail_fast=False)


async def drain_backlog_briefly(request: Request) -> None:
    """drain_backlog for /metrics and the dashboard, which must not wait on the store: at most
    KVP_OBSERVABILITY_WAIT_SECONDS, and not at all while the store thread has been held longer
    than that; then they answer with what the planning side has."""
    state = request.app.state
    wait = state.settings.observability_wait_seconds
    if state.backlog.events == 0 or state.store_thread.stuck_seconds() > wait:
        return  # nothing to wait for, or the store thread is held by a store that does not answer
    await state.store_thread.run_within(wait, state.backlog.drain, fail_fast=False)


async def get_store_thread(request: Request) -> StoreThread:
    return request.app.state.store_thread


async def get_store_health(request: Request) -> StoreHealth:
    return request.app.state.store_health


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[StateStore, Depends(get_store)]
IngestorDep = Annotated[Ingestor, Depends(get_ingestor)]
ModelsDep = Annotated[ModelRegistry, Depends(get_models)]
LedgerDep = Annotated[AdviceLedger, Depends(get_ledger)]
ClockDep = Annotated[Clock, Depends(get_clock)]
OrderSinkDep = Annotated[OrderSink, Depends(get_order_sink)]
SchedulerDep = Annotated[Scheduler, Depends(get_scheduler)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
BacklogDep = Annotated[Backlog, Depends(get_backlog)]
StoreThreadDep = Annotated[StoreThread, Depends(get_store_thread)]
StoreHealthDep = Annotated[StoreHealth, Depends(get_store_health)]
