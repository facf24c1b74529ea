"""The FastAPI service: the HTTP driver of an Engine (app/engine.py), kept on app.state.engine."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.staticfiles import StaticFiles

from app import __version__
from app.api.auth import (
    AUTH_RESPONSES,
    AdminScope,
    AgentScope,
    IngestScope,
    ObservabilityScope,
    ReadScope,
)
from app.api.batch import BatchParser
from app.api.bodylimit import BodyLimitMiddleware
from app.api.deps import drain_backlog, drain_backlog_briefly
from app.api.errors import Error, install_error_handlers
from app.api.routes import (
    config,
    dashboard,
    events,
    health,
    hints,
    metrics,
    model,
    orders,
    scheduler,
    state,
    tools,
)
from app.api.timeouts import TimeoutMiddleware
from app.core.clock import Clock
from app.core.config import Settings
from app.core.errors import ConfigError
from app.core.fleet_ratelimit import FleetRateLimiter
from app.core.ratelimit import Limiter, RateLimiter
from app.core.redact import mask_url
from app.core.security import check_bind, load_tokens
from app.deliver import OrderSink
from app.engine import Engine
from app.state import StateStore
from kvprefetch_client.events import batch_adapter

log = logging.getLogger("kvprefetch")

# What any route may answer besides its own codes: the store or the event log failing, the limits
# answering for it (app/api/bodylimit.py, timeouts.py). A route's own `responses=` wins.
SERVICE_RESPONSES: dict[int | str, dict[str, Any]] = {
    408: {"model": Error, "description": "The body stopped arriving (KVP_BODY_TIMEOUT_SECONDS)."},
    413: {"model": Error, "description": "The body is over KVP_MAX_BODY_BYTES."},
    415: {
        "model": Error,
        "description": "The body was sent compressed (a Content-Encoding other than identity).",
    },
    503: {
        "model": Error,
        "description": "The store or the event log failed, or the request ran over "
        "KVP_REQUEST_TIMEOUT_SECONDS; retry after Retry-After.",
    },
}
SCOPED_RESPONSES = {**SERVICE_RESPONSES, **AUTH_RESPONSES}


def limiters(settings: Settings) -> tuple[Limiter, Limiter]:
    """The requests' and the events' rate limits: this replica's, or with
    KVP_RATE_LIMIT_SCOPE=fleet shared by every replica in Redis (decisions.md, 23)."""
    rates = (
        ("requests", settings.rate_limit_requests_per_second),
        ("events", settings.rate_limit_events_per_second),
    )
    if settings.rate_limit_scope == "replica":
        local = [RateLimiter(rate, settings.rate_limit_burst_seconds) for _, rate in rates]
        return local[0], local[1]
    if settings.store != "redis":
        raise ConfigError("KVP_RATE_LIMIT_SCOPE=fleet needs KVP_STORE=redis")
    fleet = [
        FleetRateLimiter.from_url(
            settings.redis_url.get_secret_value(),
            settings.redis_prefix,
            what,
            rate,
            settings.rate_limit_burst_seconds,
            timeout_seconds=settings.redis_timeout_seconds,
        )
        for what, rate in rates
    ]
    return fleet[0], fleet[1]


def create_app(
    engine: Engine | Settings | None = None,
    *,
    store: StateStore | None = None,
    clock: Clock | None = None,
    order_sink: OrderSink | None = None,
) -> FastAPI:
    """The HTTP driver of an Engine (app/engine.py): routes over its parts. Given an Engine, the
    app runs its loops while it serves and closes it at shutdown; given Settings (or nothing), it
    builds one at startup from them and the injected `store`, `clock` and `order_sink` (tests
    inject those; an injected one is theirs to close); `kvprefetch serve` injects nothing."""
    given = engine if isinstance(engine, Engine) else None
    if given is not None and (store is not None or clock is not None or order_sink is not None):
        raise ValueError("store, clock and order_sink are an engine's parts: pass them to Engine()")
    settings = (
        given.settings
        if given is not None
        else (engine if isinstance(engine, Settings) else Settings())
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # What belongs to HTTP callers: tokens, rate limits, the batch parser. First of all: an
        # unauthenticated service on a public address must not start.
        app.state.settings = settings
        app.state.tokens = load_tokens(settings)
        access = check_bind(settings.host, app.state.tokens)
        app.state.request_limiter, app.state.event_limiter = limiters(settings)
        app.state.batch_parser = BatchParser(settings.max_batch_events, settings.max_event_bytes)
        built = given or Engine(settings, store=store, clock=clock, order_sink=order_sink)
        app.state.engine = built
        try:
            await built.start()
            store_name = (
                settings.store
                if settings.store == "memory"
                else f"{settings.store} at {mask_url(settings.redis_url.get_secret_value())}"
            )
            log.info(
                "kvprefetch %s ready: store=%s, log=%s, %d events replayed; %s",
                __version__,
                store_name,
                settings.event_log_dir,
                built.replayed,
                access,
            )
            yield
        finally:
            await built.close()
            for limiter in (app.state.request_limiter, app.state.event_limiter):
                if isinstance(limiter, FleetRateLimiter):
                    await limiter.close()

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
    app.include_router(
        metrics.router, dependencies=[ObservabilityScope, brief], responses=SCOPED_RESPONSES
    )
    app.include_router(events.router, prefix="/v1", responses=SCOPED_RESPONSES)
    app.include_router(
        state.router, prefix="/v1", dependencies=[ReadScope], responses=SCOPED_RESPONSES
    )
    app.include_router(model.router, prefix="/v1", dependencies=[fresh], responses=SCOPED_RESPONSES)
    app.include_router(
        orders.router, prefix="/v1", dependencies=[AgentScope, fresh], responses=SCOPED_RESPONSES
    )
    app.include_router(
        scheduler.router, prefix="/v1", dependencies=[ReadScope, fresh], responses=SCOPED_RESPONSES
    )
    app.include_router(
        hints.router, prefix="/v1", dependencies=[IngestScope], responses=SCOPED_RESPONSES
    )
    app.include_router(
        config.router, prefix="/v1", dependencies=[AdminScope], responses=SCOPED_RESPONSES
    )
    app.include_router(
        dashboard.router,
        prefix="/v1",
        dependencies=[ObservabilityScope, brief],
        responses=SCOPED_RESPONSES,
    )
    app.include_router(
        dashboard.page, dependencies=[ObservabilityScope], responses=SCOPED_RESPONSES
    )
    # The dashboard's Tools table reads it: observability, as the dashboard's own JSON.
    app.include_router(
        tools.router,
        prefix="/v1",
        dependencies=[ObservabilityScope, brief],
        responses=SCOPED_RESPONSES,
    )
    # The page's script and styles: nothing in them is private.
    app.mount("/static", StaticFiles(directory=dashboard.STATIC_DIR), name="static")
    app.add_middleware(
        TimeoutMiddleware,
        body_seconds=settings.body_timeout_seconds,
        request_seconds=settings.request_timeout_seconds,
        min_body_bytes_per_second=settings.min_body_bytes_per_second,
    )
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)

    install_error_handlers(app)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, plus the event batch body that POST /v1/events parses by hand."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title, version=app.version, summary=app.summary, routes=app.routes
    )
    batch = batch_adapter.json_schema(ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(batch.pop("$defs", {}))
    components["EventBatch"] = batch
    app.openapi_schema = schema
    return schema
