"""One exception tree, one exception handler (app/api/errors.py), checked on a bare app and on the
service's own routes."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path
from typing import Annotated

import pytest
from fastapi import APIRouter, FastAPI, Query
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from app.api.auth import Refused
from app.api.batch import BatchError
from app.api.errors import install_error_handlers
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
)
from app.core.errors import ConfigError, CorruptLogError, KvpError, StoreError, StoreUnavailable
from kvprefetch_client.agent.buffer import BufferFull

ROOT = Path(__file__).resolve().parent.parent.parent
ROUTE_MODULES = (config, dashboard, events, health, hints, metrics, model, orders, scheduler, state)
SOURCES = [
    ROOT / "app",
    ROOT / "sim",
    ROOT / "bench",
    ROOT / "training",
    ROOT / "client" / "kvprefetch_client",
]


def bare_app() -> FastAPI:
    app = FastAPI()

    @app.get("/raise/{what}")
    async def raise_(what: str) -> None:
        raise {
            "unavailable": StoreUnavailable("connection refused"),
            "store": StoreError("a script failed"),
            "log": CorruptLogError("events.jsonl", 3, "not an event"),
            "refused": Refused(429, "over the rate", {"Retry-After": "2"}),
            "batch": BatchError(413, "events", "too many"),
            "config": ConfigError("not answered by the handler"),
        }[what]

    @app.get("/query")
    async def query(limit: Annotated[int, Query(ge=1)] = 1) -> dict[str, int]:
        return {"limit": limit}

    install_error_handlers(app)
    return app


@pytest.mark.parametrize(
    ("what", "status", "body", "header"),
    [
        (
            "unavailable",
            503,
            {"detail": "the state store is unavailable: connection refused", "field": "store"},
            ("retry-after", "1"),
        ),
        (
            "store",
            503,
            {"detail": "the state store failed: a script failed", "field": "store"},
            ("retry-after", "1"),
        ),
        (
            "log",
            503,
            {"detail": "events.jsonl:3: not an event", "field": "event_log"},
            ("retry-after", "5"),
        ),
        ("refused", 429, {"detail": "over the rate", "field": "rate_limit"}, ("retry-after", "2")),
        ("batch", 413, {"detail": "too many", "field": "events"}, None),
    ],
)
def test_the_handler_answers_each_error_it_knows_in_one_shape(
    what: str, status: int, body: dict[str, str], header: tuple[str, str] | None
) -> None:
    r = TestClient(bare_app()).get(f"/raise/{what}")
    assert (r.status_code, r.json()) == (status, body)
    if header is not None:
        assert r.headers[header[0]] == header[1]


def test_an_error_it_does_not_know_is_the_servers_500() -> None:
    r = TestClient(bare_app(), raise_server_exceptions=False).get("/raise/config")
    assert r.status_code == 500


def test_validation_and_http_errors_keep_their_shapes() -> None:
    client = TestClient(bare_app())
    # A module with no `validation_error` of its own: worded as a body error names its field.
    r = client.get("/query", params={"limit": "0"})
    assert (r.status_code, r.json()) == (
        422,
        {"detail": "limit: Input should be greater than or equal to 1", "field": "limit"},
    )
    assert client.get("/nowhere").json() == {"detail": "Not Found"}  # FastAPI's own, as before


def test_the_service_routers_install_no_error_route_class_of_their_own() -> None:
    routers = [
        value
        for module in ROUTE_MODULES
        for value in vars(module).values()
        if isinstance(value, APIRouter)
    ]
    assert len(routers) > len(ROUTE_MODULES)  # the dashboard has two: its API and its page
    assert {r.route_class for r in routers} == {APIRoute}
    assert {type(route) for r in routers for route in r.routes} == {APIRoute}


def test_every_error_class_is_in_the_one_tree() -> None:
    # Statically: no class in the project derives from a built-in exception, but the root.
    builtin_errors = {
        name
        for name, value in vars(builtins).items()
        if isinstance(value, type) and issubclass(value, BaseException)
    }
    outside = []
    for folder in SOURCES:
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef) and node.name != "KvpError":
                    bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                    if bases & builtin_errors:
                        outside.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert not outside, outside
    assert issubclass(BufferFull, KvpError) and issubclass(Refused, KvpError)
    assert KvpError.__module__ == "kvprefetch_client.errors"
