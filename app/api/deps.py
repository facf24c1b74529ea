"""Dependencies for the routes: the Engine the service runs (app/engine.py) and its parts, and
what belongs to HTTP callers alone (the batch parser). The one place that reads app.state.

Async on purpose: FastAPI runs a plain `def` dependency in a thread pool, a hop per request.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.api.batch import BatchParser
from app.core.clock import Clock
from app.core.config import Settings
from app.core.ratelimit import Limiter
from app.core.security import TokenTable
from app.decide.hints import HintConfig
from app.decide.scheduler import Scheduler
from app.deliver import OrderSink
from app.engine import Engine
from app.ingest.backlog import Backlog
from app.ingest.ingestor import Ingestor
from app.observe.ledger import AdviceLedger
from app.observe.metrics import Metrics
from app.observe.timeline import Timeline
from app.predict.slots import ModelSlots
from app.predict.tool_durations import ToolDurations
from app.state.base import StateStore
from app.state.storethread import StoreHealth, StoreThread


async def get_engine(request: Request) -> Engine:
    return request.app.state.engine


EngineDep = Annotated[Engine, Depends(get_engine)]


async def get_settings(engine: EngineDep) -> Settings:
    return engine.settings


async def get_store(engine: EngineDep) -> StateStore:
    return engine.store


async def get_ingestor(engine: EngineDep) -> Ingestor:
    return engine.ingestor


async def get_models(engine: EngineDep) -> ModelSlots:
    return engine.models


async def get_ledger(engine: EngineDep) -> AdviceLedger:
    return engine.ledger


async def get_clock(engine: EngineDep) -> Clock:
    return engine.clock


async def get_order_sink(engine: EngineDep) -> OrderSink:
    return engine.order_sink


async def get_scheduler(engine: EngineDep) -> Scheduler:
    return engine.scheduler


async def get_metrics(engine: EngineDep) -> Metrics:
    return engine.metrics


async def get_backlog(engine: EngineDep) -> Backlog:
    return engine.backlog


async def get_store_thread(engine: EngineDep) -> StoreThread:
    return engine.store_thread


async def get_store_health(engine: EngineDep) -> StoreHealth:
    return engine.store_health


async def get_timeline(engine: EngineDep) -> Timeline:
    return engine.timeline


async def get_tools(engine: EngineDep) -> ToolDurations:
    return engine.tools


async def get_hint_config(engine: EngineDep) -> HintConfig:
    return engine.hint_config


async def get_batch_parser(request: Request) -> BatchParser:
    """The app's parser (its pydantic model is built once, for KVP_MAX_BATCH_EVENTS)."""
    return request.app.state.batch_parser


async def get_tokens(request: Request) -> TokenTable:
    """The API tokens (KVP_TOKENS_FILE): the HTTP layer's, read at startup."""
    return request.app.state.tokens


async def get_event_limiter(request: Request) -> Limiter:
    """KVP_RATE_LIMIT_EVENTS_PER_SECOND's limiter: the HTTP layer's, per caller."""
    return request.app.state.event_limiter


async def drain_backlog(engine: EngineDep) -> None:
    """For routes reading what the planning side derives from events (app/ingest/backlog.py)."""
    await engine.store_thread.run(engine.backlog.drain, fail_fast=False)


async def drain_backlog_briefly(engine: EngineDep) -> None:
    """drain_backlog for /metrics and the dashboard, which must not wait on the store: at most
    KVP_OBSERVABILITY_WAIT_SECONDS, and not at all while the store thread has been held longer
    than that; then they answer with what the planning side has."""
    wait = engine.settings.observability_wait_seconds
    if engine.backlog.events == 0 or engine.store_thread.stuck_seconds() > wait:
        return  # nothing to wait for, or the store thread is held by a store that does not answer
    await engine.store_thread.run_within(wait, engine.backlog.drain, fail_fast=False)


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[StateStore, Depends(get_store)]
IngestorDep = Annotated[Ingestor, Depends(get_ingestor)]
ModelsDep = Annotated[ModelSlots, Depends(get_models)]
LedgerDep = Annotated[AdviceLedger, Depends(get_ledger)]
ClockDep = Annotated[Clock, Depends(get_clock)]
OrderSinkDep = Annotated[OrderSink, Depends(get_order_sink)]
SchedulerDep = Annotated[Scheduler, Depends(get_scheduler)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
BacklogDep = Annotated[Backlog, Depends(get_backlog)]
StoreThreadDep = Annotated[StoreThread, Depends(get_store_thread)]
StoreHealthDep = Annotated[StoreHealth, Depends(get_store_health)]
TimelineDep = Annotated[Timeline, Depends(get_timeline)]
BatchParserDep = Annotated[BatchParser, Depends(get_batch_parser)]
TokensDep = Annotated[TokenTable, Depends(get_tokens)]
EventLimiterDep = Annotated[Limiter, Depends(get_event_limiter)]
HintConfigDep = Annotated[HintConfig, Depends(get_hint_config)]
ToolsDep = Annotated[ToolDurations, Depends(get_tools)]
