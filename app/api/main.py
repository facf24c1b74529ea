"""The FastAPI service: builds its parts at startup and keeps them on app.state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.staticfiles import StaticFiles

from app import __version__
from app.api.auth import AUTH_RESPONSES, AdminScope, AgentScope, IngestScope, ObservabilityScope, ReadScope
from app.api.deps import drain_backlog, drain_backlog_briefly
from app.api.errors import Error, install_error_handlers
from app.api.routes import config, dashboard, events, health, hints, metrics, model, orders, scheduler, state
from app.api.bodylimit import BodyLimitMiddleware
from app.api.timeouts import TimeoutMiddleware
from app.core.clock import Clock, SystemClock
from app.core.config import Settings
from app.core.errors import StoreError
from app.core.ratelimit import RateLimiter
from app.core.redact import mask_url
from app.core.security import check_bind, load_tokens
from app.observe.ledger import AdviceLedger
from app.ingest.backlog import Backlog
from app.ingest.eventlog import EventLog
from kvprefetch_client.events import Event, batch_adapter
from app.ingest.ingestor import Ingestor, Observer
from app.observe.metrics import Metrics, multiprocess_dir
from app.predict.registry import ModelRegistry
from app.observe.outcomes import OutcomeConfig, RequestOutcome, outcome_observer
from app.decide.plan_loop import Dispatcher, feedback_observer
from app.decide.routing import RouteTracker
from app.decide.scheduler import Scheduler, SchedulerConfig
from app.decide.score_loop import Scorer
from app.deliver import OrderSink, PullQueue, build_sink
from app.observe.timeline import LandedPrefetches, MeasuredStall, Timeline, capacity_for
from app.state import MemoryStore, StateStore, build_store
from app.state.storethread import StoreHealth, StoreThread

log = logging.getLogger("kvprefetch")

# What any route may answer besides its own codes: the store or the event log failing, the limits
# answering for it (app/api/bodylimit.py, timeouts.py). A route's own `responses=` wins.
SERVICE_RESPONSES: dict[int | str, dict[str, Any]] = {
    408: {"model": Error, "description": "The body stopped arriving (KVP_BODY_TIMEOUT_SECONDS)."},
    413: {"model": Error, "description": "The body is over KVP_MAX_BODY_BYTES."},
    415: {"model": Error, "description": "The body was sent compressed (a Content-Encoding other than "
                                         "identity)."},
    503: {"model": Error, "description": "The store or the event log failed, or the request ran over "
                                         "KVP_REQUEST_TIMEOUT_SECONDS; retry after Retry-After."},
}
SCOPED_RESPONSES = {**SERVICE_RESPONSES, **AUTH_RESPONSES}


def create_app(settings: Settings | None = None, *, store: StateStore | None = None,
               clock: Clock | None = None, order_sink: OrderSink | None = None) -> FastAPI:
    """Build the service. Tests inject a store, a clock and an order sink (an injected one is
    theirs to close); `kvprefetch serve` injects nothing."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.settings = settings
        # First of all: an unauthenticated service on a public address must not start.
        app.state.tokens = load_tokens(settings)
        access = check_bind(settings.host, app.state.tokens)
        app.state.request_limiter = RateLimiter(settings.rate_limit_requests_per_second,
                                                settings.rate_limit_burst_seconds)
        app.state.event_limiter = RateLimiter(settings.rate_limit_events_per_second,
                                              settings.rate_limit_burst_seconds)
        app.state.clock = clock or SystemClock()
        # First: a sink misconfigured (webhook without a URL) stops startup before anything opens.
        app.state.order_sink = order_sink if order_sink is not None else build_sink(settings)
        app.state.store = store if store is not None else build_store(settings)
        # A blocking store (Redis) is called off the loop, one job at a time (decisions.md, 16).
        offload = not isinstance(app.state.store, MemoryStore)
        store_thread = app.state.store_thread = StoreThread(offload=offload)
        app.state.store_health = StoreHealth(app.state.store, offload=offload)
        app.state.event_log = EventLog(settings.event_log_dir, segment_bytes=settings.log_segment_bytes,
                                       fsync=settings.log_fsync)
        # Both keep per-session maps, forgotten with the store's sessions (by event time).
        app.state.ledger = AdviceLedger(retention_seconds=settings.session_retention_seconds)
        app.state.scheduler = Scheduler(app.state.store, SchedulerConfig(
            bytes_per_block=settings.bytes_per_token * settings.block_tokens, block_tokens=settings.block_tokens,
            link_share=settings.prefetch_link_share, pool_link_bytes_per_second=settings.pool_link_bytes_per_second,
            host_link_bytes_per_second=settings.host_link_bytes_per_second,
            prefill_tokens_per_second=settings.prefill_tokens_per_second))
        app.state.routes = RouteTracker(retention_seconds=settings.session_retention_seconds)
        app.state.models = ModelRegistry(settings.model_dir, settings.shadow_model_dir,
                                         ledger=app.state.ledger,
                                         models_root=settings.models_root_dir)
        app.state.metrics = Metrics(gpu_hour_price_dollars=settings.gpu_hour_price, multiprocess=multiprocess_dir())
        app.state.metrics.bind(scheduler=app.state.scheduler, ledger=app.state.ledger, models=app.state.models)
        app.state.scorer = Scorer(app.state.store, app.state.models, app.state.ledger, app.state.clock,
                                  sessions_per_tick=settings.score_sessions_per_tick,
                                  scheduler=app.state.scheduler, routes=app.state.routes.estimate,
                                  observe_seconds=app.state.metrics.scored)
        app.state.dispatcher = Dispatcher(app.state.scheduler, app.state.order_sink, app.state.clock,
                                          observe_seconds=app.state.metrics.planned,
                                          offload=store_thread.run)
        landed, measured = LandedPrefetches(app.state.scheduler), MeasuredStall()
        app.state.timeline = Timeline(app.state.ledger, app.state.scheduler, app.state.models, app.state.clock,
                                      landed=landed, stall=measured.stall,
                                      capacity=capacity_for(settings.dashboard_sample_seconds))
        # landed before the scheduler's feedback, which forgets a completed order.
        observers: list[Observer] = [app.state.ledger.observe, app.state.scorer.observe, landed.observe,
                                     feedback_observer(app.state.scheduler, app.state.routes)]
        if isinstance(app.state.order_sink, PullQueue):
            # order_progress: started, done. The queue is the loop's (GET /v1/orders, the
            # planning loop's delivery), so a store thread's drain hands it over there.
            pulled = app.state.order_sink.observe
            observers.append(on_loop(pulled, asyncio.get_running_loop()) if offload else pulled)

        def record_outcomes(outcomes: Sequence[RequestOutcome]) -> None:  # for /metrics and the dashboard
            app.state.metrics.record_outcomes(outcomes)
            measured.record_outcomes(outcomes)

        observers.append(outcome_observer(app.state.store, OutcomeConfig(
            bytes_per_token=settings.bytes_per_token, block_tokens=settings.block_tokens,
            pool_link_bytes_per_second=settings.pool_link_bytes_per_second,
            host_link_bytes_per_second=settings.host_link_bytes_per_second,
            prefill_tokens_per_second=settings.prefill_tokens_per_second), record_outcomes))
        # Last: it syncs the counters with what the ledger and the scheduler counted just now.
        observers.append(app.state.metrics.observe)
        app.state.backlog = Backlog(compose_observers(observers), settings.backlog_max_events)
        app.state.ingestor = Ingestor(app.state.store, app.state.event_log, replica_id=settings.replica_id,
                                      clock=app.state.clock,
                                      max_clock_skew_seconds=settings.max_clock_skew_seconds,
                                      observer=app.state.backlog.put, refused=app.state.metrics.events_refused)
        replayed = app.state.ingestor.recover()
        try:
            ahead = app.state.ingestor.newest_ahead_of_clock()
        except StoreError:  # a diagnostic: the store's health is reported by the probe below
            ahead = None
        if ahead is not None:
            log.error("the store has taken an event stamped %r, more than KVP_MAX_CLOCK_SKEW_SECONDS "
                      "ahead of the clock, before such events were refused: its session retention "
                      "and reorder windows count from there. Clear the store (its keys under "
                      "KVP_REDIS_PREFIX) and restart: the log is replayed without such events.", ahead)
        await app.state.store_health.refresh(settings.redis_timeout_seconds)
        store_name = (settings.store if settings.store == "memory"
                      else f"{settings.store} at {mask_url(settings.redis_url.get_secret_value())}")
        log.info("kvprefetch %s ready: store=%s, log=%s, %d events replayed; %s", __version__,
                 store_name, settings.event_log_dir, replayed, access)
        probing = app.state.probe_task = asyncio.create_task(
            app.state.store_health.run(settings.store_probe_interval_seconds))
        observing = app.state.backlog_task = asyncio.create_task(
            app.state.backlog.run(store_thread.run))
        scoring = app.state.scoring_task = (
            asyncio.create_task(
                app.state.scorer.run(settings.score_interval_seconds, store_thread.run))
            if settings.score_interval_seconds > 0 else None)
        planning = app.state.planning_task = (
            asyncio.create_task(app.state.dispatcher.run(settings.plan_interval_seconds))
            if settings.plan_interval_seconds > 0 else None)
        sampling = app.state.sampling_task = (
            asyncio.create_task(app.state.timeline.run(settings.dashboard_sample_seconds))
            if settings.dashboard_sample_seconds > 0 else None)
        try:
            yield
        finally:
            for task in (scoring, planning, sampling, observing, probing):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await store_thread.run(app.state.backlog.drain, fail_fast=False)
            store_thread.close()
            app.state.store_health.close()
            await asyncio.sleep(0)  # what the drain handed to the loop (on_loop)
            app.state.event_log.close()
            app.state.metrics.close()
            if store is None:
                app.state.store.close()
            if order_sink is None:
                await app.state.order_sink.close()

    app = FastAPI(
        title="kvprefetch",
        version=__version__,
        summary="Predictive KV-cache prefetching for LLM serving fleets.",
        lifespan=lifespan,
    )
    # Each router's scope (app/api/auth.py); the events and model routes declare theirs per route.
    # Readers of what the planning side derives drain its backlog first: read-your-writes.
    fresh = Depends(drain_backlog)
    # /metrics and the dashboard wait for that only briefly: they never wait on the store.
    brief = Depends(drain_backlog_briefly)
    app.include_router(health.router, responses=SERVICE_RESPONSES)
    app.include_router(metrics.router, dependencies=[ObservabilityScope, brief],
                       responses=SCOPED_RESPONSES)
    app.include_router(events.router, prefix="/v1", responses=SCOPED_RESPONSES)
    app.include_router(state.router, prefix="/v1", dependencies=[ReadScope], responses=SCOPED_RESPONSES)
    app.include_router(model.router, prefix="/v1", dependencies=[fresh], responses=SCOPED_RESPONSES)
    app.include_router(orders.router, prefix="/v1", dependencies=[AgentScope, fresh], responses=SCOPED_RESPONSES)
    app.include_router(scheduler.router, prefix="/v1", dependencies=[ReadScope, fresh], responses=SCOPED_RESPONSES)
    app.include_router(hints.router, prefix="/v1", dependencies=[IngestScope], responses=SCOPED_RESPONSES)
    app.include_router(config.router, prefix="/v1", dependencies=[AdminScope], responses=SCOPED_RESPONSES)
    app.include_router(dashboard.router, prefix="/v1", dependencies=[ObservabilityScope, brief],
                       responses=SCOPED_RESPONSES)
    app.include_router(dashboard.page, dependencies=[ObservabilityScope], responses=SCOPED_RESPONSES)
    # The page's script and styles: nothing in them is private.
    app.mount("/static", StaticFiles(directory=dashboard.STATIC_DIR), name="static")
    app.add_middleware(TimeoutMiddleware, body_seconds=settings.body_timeout_seconds,
                       request_seconds=settings.request_timeout_seconds)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)

    install_error_handlers(app)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def on_loop(observer: Observer, loop: asyncio.AbstractEventLoop) -> Observer:
    """`observer`, told on `loop` (in order) when it is told on another thread."""
    def observe(events: Sequence[Event]) -> None:
        loop.call_soon_threadsafe(observer, events)

    return observe


def compose_observers(observers: Sequence[Observer]) -> Observer:
    """One ingest observer telling each of `observers` in turn; one failing does not keep the
    events from the others."""
    if len(observers) == 1:
        return observers[0]

    def observe(events: Sequence[Event]) -> None:
        for observer in observers:
            try:
                observer(events)
            except Exception:
                log.exception("ingest observer %r failed on %d events", observer, len(events))

    return observe


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, plus the event batch body that POST /v1/events parses by hand."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    batch = batch_adapter.json_schema(ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(batch.pop("$defs", {}))
    components["EventBatch"] = batch
    app.openapi_schema = schema
    return schema
