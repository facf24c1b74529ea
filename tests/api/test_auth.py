"""Scopes, tokens, rate limits and the planning backlog at the HTTP level."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.clock import ManualClock
from app.core.config import Settings
from app.core.errors import ConfigError
from app.deliver import PullQueue
from kvprefetch_client.orders import Cancel
from tests.api.conftest import routed
from tests.deliver.conftest import order

INGEST = "ingest-token-0123456789"
AGENT = "agent-token-0123456789a"
ADMIN = "admin-token-0123456789ab"

# Open to anyone: probes, and the API's own description.
OPEN = {"/healthz", "/readyz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def progress(event_id: str, order_id: str = "o1") -> dict[str, Any]:
    return {
        "type": "order_progress",
        "event_id": event_id,
        "ts": 2.0,
        "order_id": order_id,
        "status": "accepted",
    }


@pytest.fixture
def secured_settings(tmp_path: Path) -> Settings:
    return Settings(
        data_dir=tmp_path,
        log_fsync=False,
        max_batch_events=50,
        ingest_token=INGEST,
        agent_token=AGENT,
        admin_token=ADMIN,
        score_interval_seconds=0,
        plan_interval_seconds=0,
        dashboard_sample_seconds=0,
    )


@pytest.fixture
def secured(secured_settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(secured_settings)) as c:
        yield c


def post_events(client: TestClient, events: list[dict[str, Any]], token: str | None) -> Any:
    return client.post(
        "/v1/events", json={"events": events}, headers=bearer(token) if token else {}
    )


# -- who may call what --------------------------------------------------------------------------

# (method, path, body) for one endpoint of each scope.
HINT = ("POST", "/v1/route-hint", {"session_id": "s1", "candidates": ["gpu-0"]})
ORDERS = ("GET", "/v1/orders?instance_id=gpu-0", None)
RELOAD = ("POST", "/v1/model/reload", {"model_dir": "/nonexistent"})
SHADOW = ("DELETE", "/v1/model/shadow", None)
CONFIG = ("GET", "/v1/config", None)
READS = [
    ("GET", "/v1/sessions/s1", None),
    ("GET", "/v1/instances", None),
    ("GET", "/v1/locations", None),
    ("GET", "/v1/scheduler", None),
    ("GET", "/v1/model", None),
]


def call(client: TestClient, endpoint: tuple[str, str, Any], token: str | None) -> Any:
    method, path, body = endpoint
    return client.request(method, path, json=body, headers=bearer(token) if token else {})


@pytest.mark.parametrize(
    ("endpoint", "allowed", "refused"),
    [
        (HINT, [INGEST], [AGENT, ADMIN]),
        (ORDERS, [AGENT], [INGEST, ADMIN]),
        (RELOAD, [ADMIN], [INGEST, AGENT]),
        (SHADOW, [ADMIN], [INGEST, AGENT]),
        (CONFIG, [ADMIN], [INGEST, AGENT]),
    ],
)
def test_each_scope_is_refused_elsewhere(
    secured: TestClient, endpoint: tuple[str, str, Any], allowed: list[str], refused: list[str]
) -> None:
    for token in allowed:
        r = call(secured, endpoint, token)
        assert r.status_code not in (401, 403, 429), (token, r.text)
    scope = {HINT[1]: "ingest", ORDERS[1]: "agent"}.get(endpoint[1], "admin")
    for token in refused:
        r = call(secured, endpoint, token)
        assert r.status_code == 403, (token, r.text)
        assert r.json()["field"] == "authorization"
        assert r.json()["detail"].startswith(f"this endpoint needs the {scope} scope; token 'env:")
        assert 'error="insufficient_scope"' in r.headers["www-authenticate"]


@pytest.mark.parametrize("endpoint", [HINT, ORDERS, RELOAD, SHADOW, CONFIG, *READS])
def test_every_scoped_endpoint_wants_a_valid_token(
    secured: TestClient, endpoint: tuple[str, str, Any]
) -> None:
    missing = call(secured, endpoint, None)
    assert missing.status_code == 401
    assert missing.json() == {
        "detail": "a bearer token is required: Authorization: Bearer <token>",
        "field": "authorization",
    }
    assert missing.headers["www-authenticate"] == 'Bearer realm="kvprefetch"'
    wrong = call(secured, endpoint, "not-the-right-token-at-all")
    assert wrong.status_code == 401 and wrong.json()["detail"] == "the bearer token is not valid"
    basic = secured.request(
        endpoint[0], endpoint[1], json=endpoint[2], headers={"authorization": "Basic eDp5"}
    )
    assert basic.status_code == 401


@pytest.mark.parametrize("endpoint", READS)
def test_every_token_may_read(secured: TestClient, endpoint: tuple[str, str, Any]) -> None:
    for token in (INGEST, AGENT, ADMIN):
        assert call(secured, endpoint, token).status_code in (200, 404)


def test_events_take_ingest_tokens_and_agents_only_for_their_own_events(
    secured: TestClient,
) -> None:
    assert post_events(secured, [routed("e1")], INGEST).json()["accepted"] == ["e1"]
    assert post_events(secured, [progress("p1")], AGENT).json()["accepted"] == ["p1"]
    refused = post_events(secured, [progress("p2"), routed("e2")], AGENT)
    assert refused.status_code == 403
    assert refused.json()["field"] == "events[1].type"
    assert "not request_routed; nothing of the batch was accepted" in refused.json()["detail"]
    # Nothing of the refused batch went in: resending it with the right token accepts both.
    assert post_events(secured, [progress("p2"), routed("e2")], INGEST).json()["accepted"] == [
        "p2",
        "e2",
    ]
    assert post_events(secured, [routed("e3")], ADMIN).status_code == 403
    assert post_events(secured, [routed("e3")], None).status_code == 401
    # A refusal names the event where it was posted, past events rejected as invalid.
    invalid = {**progress("p3"), "ts": "soon"}
    refused = post_events(secured, [invalid, progress("p4"), routed("e4")], AGENT)
    assert (refused.status_code, refused.json()["field"]) == (403, "events[2].type")


def test_health_metrics_and_the_dashboard_are_open_by_default(secured: TestClient) -> None:
    for path in (
        "/healthz",
        "/readyz",
        "/metrics",
        "/dashboard",
        "/v1/dashboard/now",
        "/v1/tools",
        "/openapi.json",
    ):
        assert secured.get(path).status_code == 200, path


def test_observability_can_be_protected(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path,
        log_fsync=False,
        agent_token=AGENT,
        protect_observability=True,
        score_interval_seconds=0,
        plan_interval_seconds=0,
        dashboard_sample_seconds=0,
    )
    with TestClient(create_app(settings)) as c:
        for path in (
            "/metrics",
            "/dashboard",
            "/v1/dashboard/now",
            "/v1/dashboard/series",
            "/v1/tools",
        ):
            assert c.get(path).status_code == 401, path
            assert c.get(path, headers=bearer(AGENT)).status_code == 200, path
        assert c.get("/healthz").status_code == 200


def test_every_route_declares_a_scope_or_is_open(secured: TestClient) -> None:
    undeclared = []
    for route in secured.app.routes:  # type: ignore[attr-defined]
        if not isinstance(route, APIRoute) or route.path in OPEN:
            continue
        scopes = [getattr(d.call, "scopes", None) for d in route.dependant.dependencies]
        if not any(scopes):
            undeclared.append(route.path)
    assert undeclared == []


def test_the_openapi_schema_names_the_bearer_scheme(secured: TestClient) -> None:
    schema = secured.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert schema["paths"]["/v1/events"]["post"]["security"] == [{"HTTPBearer": []}]
    assert "security" not in schema["paths"]["/healthz"]["get"]


def test_config_shows_settings_and_token_names_never_tokens(secured: TestClient) -> None:
    body = secured.get("/v1/config", headers=bearer(ADMIN)).json()
    assert body["settings"]["admin_token"] == "**********"
    assert body["settings"]["max_batch_events"] == 50
    assert body["tokens"] == {
        "env:ingest": ["ingest", "read"],
        "env:agent": ["agent", "read"],
        "env:admin": ["admin", "read"],
    }
    text = str(body)
    assert all(t not in text for t in (INGEST, AGENT, ADMIN))


def test_tokens_are_never_logged(
    secured_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG), TestClient(create_app(secured_settings)) as c:
        post_events(c, [routed("e1")], INGEST)
        post_events(c, [routed("e2")], "a-wrong-token-xxxxxxxx")
        c.get("/v1/config", headers=bearer(AGENT))
    assert "authentication on: 3 token(s)" in caplog.text
    assert all(t not in caplog.text for t in (INGEST, AGENT, ADMIN, "a-wrong-token-xxxxxxxx"))


def test_without_tokens_the_service_says_so_and_refuses_a_public_address(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.INFO),
        TestClient(create_app(Settings(data_dir=tmp_path, log_fsync=False))) as c,
    ):
        assert c.post("/v1/model/reload", json={"model_dir": "/nonexistent"}).status_code == 422
    assert "authentication off (no tokens configured): listening on 127.0.0.1 only" in caplog.text
    with (
        pytest.raises(ConfigError, match=r"may listen on 127\.0\.0\.1 only, not 0\.0\.0\.0"),
        TestClient(create_app(Settings(data_dir=tmp_path, host="0.0.0.0"))),
    ):
        pass


# -- limits -------------------------------------------------------------------------------------


def test_a_client_over_its_request_rate_gets_429_with_retry_after(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path,
        log_fsync=False,
        ingest_token=INGEST,
        agent_token=AGENT,
        admin_token=ADMIN,
        rate_limit_requests_per_second=0.01,
        rate_limit_burst_seconds=100,
        score_interval_seconds=0,
        plan_interval_seconds=0,
        dashboard_sample_seconds=0,
    )
    with TestClient(create_app(settings)) as c:
        assert post_events(c, [routed("e1")], INGEST).status_code == 200
        r = post_events(c, [routed("e2")], INGEST)
        assert r.status_code == 429
        assert r.json()["field"] == "rate_limit"
        assert "KVP_RATE_LIMIT_REQUESTS_PER_SECOND" in r.json()["detail"]
        assert int(r.headers["retry-after"]) >= 1
        # Another client (token) has its own bucket; open endpoints are not limited.
        assert c.get("/v1/orders?instance_id=gpu-0", headers=bearer(AGENT)).status_code == 200
        assert all(c.get("/healthz").status_code == 200 for _ in range(3))
        # Nothing of the refused batch was taken.
        assert c.get("/v1/sessions/s1", headers=bearer(ADMIN)).json()["turns"] == 1


def test_a_client_over_its_event_rate_gets_429_and_nothing_of_the_batch_is_taken(
    tmp_path: Path,
) -> None:
    settings = Settings(
        data_dir=tmp_path,
        log_fsync=False,
        rate_limit_events_per_second=0.01,
        rate_limit_burst_seconds=150,
        score_interval_seconds=0,
        plan_interval_seconds=0,
        dashboard_sample_seconds=0,
    )
    with TestClient(create_app(settings)) as c:  # no tokens: the address is the client
        assert post_events(c, [routed("e1"), routed("e2", ts=2.0)], None).status_code == 200
        r = post_events(c, [routed("e3", "s2")], None)
        assert r.status_code == 429 and "KVP_RATE_LIMIT_EVENTS_PER_SECOND" in r.json()["detail"]
        assert c.get("/v1/sessions/s2").status_code == 404
        assert 'kvprefetch_event_batches_refused_total{code="429"} 1.0' in c.get("/metrics").text


def test_a_full_backlog_refuses_with_503_before_logging_and_a_read_drains_it(
    tmp_path: Path,
) -> None:
    settings = Settings(
        data_dir=tmp_path,
        log_fsync=False,
        backlog_max_events=3,
        max_batch_events=3,
        score_interval_seconds=0,
        plan_interval_seconds=0,
        dashboard_sample_seconds=0,
    )
    with TestClient(create_app(settings)) as c:
        app = c.app
        c.portal.call(_stop_draining, app)  # type: ignore[union-attr]
        assert post_events(c, [routed("e1"), routed("e2", ts=2.0)], None).status_code == 200
        r = post_events(c, [routed("e3", "s2"), routed("e4", "s2")], None)
        assert r.status_code == 503
        assert r.json() == {
            "detail": "the planning side is behind: 2 events wait (KVP_BACKLOG_MAX_EVENTS 3); "
            "retry later",
            "field": "backlog",
        }
        assert r.headers["retry-after"] == "1"
        assert c.get("/v1/sessions/s2").status_code == 404  # refused before the log and the store
        assert app.state.engine.backlog.events == 2  # type: ignore[attr-defined]
        assert c.get("/v1/scheduler").status_code == 200  # a derived read drains first
        assert app.state.engine.backlog.events == 0  # type: ignore[attr-defined]
        assert post_events(c, [routed("e3", "s2"), routed("e4", "s2")], None).status_code == 200
        assert 'kvprefetch_event_batches_refused_total{code="503"} 1.0' in c.get("/metrics").text


async def _stop_draining(app: Any) -> None:
    app.state.engine.backlog_task.cancel()
    await asyncio.sleep(0)


def test_a_batch_limit_over_the_backlog_is_a_settings_error() -> None:
    with pytest.raises(
        ValueError, match=r"max_batch_events \(10\) must not exceed backlog_max_events \(5\)"
    ):
        Settings(max_batch_events=10, backlog_max_events=5)


# -- secrets and paths on what is shown -------------------------------------------------------

REDIS_PASSWORD = "redis-pass-3f9c"
HOOK_SECRET = "T000/B000/hook-secret-77aa"


def test_config_logs_and_the_settings_repr_mask_urls_secrets(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    redis_url = f"redis://app:{REDIS_PASSWORD}@cache.internal:6380/2?password={REDIS_PASSWORD}"
    webhook_url = f"https://hooks.example.com/services/{HOOK_SECRET}?key={HOOK_SECRET}"
    settings = Settings(
        data_dir=tmp_path,
        log_fsync=False,
        admin_token=ADMIN,
        redis_url=redis_url,
        order_webhook_url=webhook_url,
    )
    with caplog.at_level(logging.DEBUG), TestClient(create_app(settings)) as c:
        shown = c.get("/v1/config", headers=bearer(ADMIN)).json()["settings"]
    assert shown["redis_url"] == "redis://app:****@cache.internal:6380/2?****"
    assert shown["order_webhook_url"] == "https://hooks.example.com/****?****"
    for text in (str(shown), repr(settings), str(settings), caplog.text):
        assert REDIS_PASSWORD not in text and "hook-secret" not in text


def test_readyz_shows_no_path(tmp_path: Path) -> None:
    for protect in (False, True):
        settings = Settings(
            data_dir=tmp_path / "data",
            log_fsync=False,
            admin_token=ADMIN,
            protect_observability=protect,
            shadow_model_dir=tmp_path / "absent",
        )
        with TestClient(create_app(settings)) as c:
            ready = c.get("/readyz")
        assert ready.status_code == 200
        assert str(tmp_path) not in ready.text and "/events" not in ready.text, ready.text
        assert ready.json()["event_log"] == "open"


def test_the_startup_line_names_the_redis_store_without_its_password(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from app.state import MemoryStore

    settings = Settings(
        data_dir=tmp_path,
        log_fsync=False,
        store="redis",
        redis_url=f"redis://:{REDIS_PASSWORD}@cache.internal:6380/2",
    )
    # A store injected in its place: the line is what a Redis deployment logs, no Redis needed.
    with (
        caplog.at_level(logging.INFO),
        TestClient(create_app(settings, store=MemoryStore(bytes_per_token=1, block_tokens=512))),
    ):
        pass
    assert "store=redis at redis://:****@cache.internal:6380/2" in caplog.text
    assert REDIS_PASSWORD not in caplog.text


# -- tokens bound to instances and agents -------------------------------------------------------

FLEET_A = "fleet-a-token-0123456789"
FLEET_B = "fleet-b-token-0123456789"


@pytest.fixture
def bound(tmp_path: Path) -> Iterator[TestClient]:
    """Two fleets' agent tokens, each bound to its instances and agent names; the env's agent
    token unbound, as before bindings existed."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f"""
[[tokens]]
name = "fleet-a"
scopes = ["agent"]
token = "{FLEET_A}"
instances = ["gpu-a-*"]
agents = ["agent-a*"]

[[tokens]]
name = "fleet-b"
scopes = ["agent"]
token = "{FLEET_B}"
instances = ["gpu-b-*"]
agents = ["agent-b"]
"""
    )
    settings = Settings(
        data_dir=tmp_path,
        log_fsync=False,
        agent_token=AGENT,
        admin_token=ADMIN,
        tokens_file=tokens,
        score_interval_seconds=0,
        plan_interval_seconds=0,
        dashboard_sample_seconds=0,
    )
    with TestClient(create_app(settings, clock=ManualClock(11.0))) as c:
        yield c


def blocks(kind: str, event_id: str, instance_id: str | None, **kw: Any) -> dict[str, Any]:
    event: dict[str, Any] = {"type": kind, "event_id": event_id, "ts": 11.0, **kw}
    if instance_id is None:
        event["tier"] = "pool"
    else:
        event["instance_id"] = instance_id
    if kind != "kv_blocks_cleared":
        event["block_hashes"] = [1, 2]
    return event


def refused(response: Any, field: str, *words: str) -> None:
    assert response.status_code == 403, response.text
    body = response.json()
    assert body["field"] == field, body
    assert all(w in body["detail"] for w in words), body


def pull_queue(client: TestClient) -> PullQueue:
    sink = client.app.state.engine.order_sink  # type: ignore[attr-defined]
    assert isinstance(sink, PullQueue)
    return sink


@pytest.mark.parametrize("kind", ["kv_blocks_stored", "kv_blocks_removed", "kv_blocks_cleared"])
def test_a_bound_token_posts_block_events_only_for_its_instances(
    bound: TestClient, kind: str
) -> None:
    ok = [blocks(kind, "e0", "gpu-a-0")]
    assert post_events(bound, ok, FLEET_A).status_code == 200
    # Fleet b's instance, second in the batch: refused by its index, nothing of it taken.
    batch = [blocks(kind, "e1", "gpu-a-1"), blocks(kind, "e2", "gpu-b-0")]
    refused(post_events(bound, batch, FLEET_A), "events[1].instance_id", "gpu-b-0", "fleet-a")
    # The shared pool is no instance's: a bound token does not speak for it.
    refused(post_events(bound, [blocks(kind, "e3", None)], FLEET_A), "events[0].instance_id")
    answer = post_events(bound, batch, FLEET_B)
    refused(answer, "events[0].instance_id", "gpu-a-1")
    # Unbound, as before: anything.
    batch = [*batch, blocks(kind, "e3", None)]
    assert post_events(bound, batch, AGENT).json()["accepted"] == ["e1", "e2", "e3"]


def test_a_bound_token_may_not_report_progress_of_another_agents_order(bound: TestClient) -> None:
    queue = pull_queue(bound)
    queue.submit_nowait([order("oa", "gpu-a-0"), order("ob", "gpu-b-0")])
    got = bound.get("/v1/orders?instance_id=gpu-a-0&agent=agent-a1", headers=bearer(FLEET_A))
    assert [o["order_id"] for o in got.json()["orders"]] == ["oa"]
    # Fleet b marks a's leased order failed: refused, and a's renewal still holds it.
    failed = {**progress("p1", "oa"), "status": "failed", "reason": "no"}
    refused(post_events(bound, [failed], FLEET_B), "events[0].order_id", "oa", "gpu-a-0")
    # Within fleet a, another agent name than the one it is leased to: refused too.
    fleet_a_too = bound.get(
        "/v1/orders?instance_id=gpu-a-0&agent=agent-a2", headers=bearer(FLEET_A)
    )
    assert fleet_a_too.json()["orders"] == []
    renew = {"instance_id": "gpu-a-0", "agent": "agent-a1", "order_ids": ["oa"]}
    answer = bound.post("/v1/orders/renew", json=renew, headers=bearer(FLEET_A))
    assert answer.json()["renewed"] == ["oa"]
    # Its own agent reports it; an order of b's instance it may not.
    assert post_events(bound, [progress("p2", "oa")], FLEET_A).status_code == 200
    refused(post_events(bound, [progress("p3", "ob")], FLEET_A), "events[0].order_id", "gpu-b-0")
    # An order leased to an agent name the token does not have.
    got = bound.get("/v1/orders?instance_id=gpu-b-0&agent=agent-x", headers=bearer(AGENT))
    assert [o["order_id"] for o in got.json()["orders"]] == ["ob"]
    refused(
        post_events(bound, [progress("p4", "ob")], FLEET_B),
        "events[0].order_id",
        "agent-x",
        "fleet-b",
    )
    # The unbound agent token may, as before.
    assert post_events(bound, [progress("p5", "ob")], AGENT).status_code == 200


def test_a_bound_token_pulls_and_renews_only_for_its_instances_and_agents(
    bound: TestClient,
) -> None:
    queue = pull_queue(bound)
    queue.submit_nowait([order("oa", "gpu-a-0")])
    queue.cancel_nowait([Cancel(order_id="oa", reason="closed")])
    # Fleet b pulling gpu-a-0 would take its orders and consume its pending cancels.
    answer = bound.get("/v1/orders?instance_id=gpu-a-0&agent=agent-b", headers=bearer(FLEET_B))
    refused(answer, "instance_id", "gpu-a-0", "fleet-b")
    answer = bound.get("/v1/orders?instance_id=gpu-b-0&agent=agent-a1", headers=bearer(FLEET_B))
    refused(answer, "agent", "agent-a1")
    # A token that names agents leases under one of them only.
    refused(bound.get("/v1/orders?instance_id=gpu-b-0", headers=bearer(FLEET_B)), "agent")
    renew = {"instance_id": "gpu-a-0", "agent": "agent-b", "order_ids": ["oa"]}
    answer = bound.post("/v1/orders/renew", json=renew, headers=bearer(FLEET_B))
    refused(answer, "instance_id", "gpu-a-0")
    # The cancel is still there for fleet a's own pull.
    answer = bound.get("/v1/orders?instance_id=gpu-a-0&agent=agent-a1", headers=bearer(FLEET_A))
    assert answer.json()["cancelled"] == ["oa"]
    # The unbound agent token pulls any instance, as before.
    assert bound.get("/v1/orders?instance_id=gpu-z", headers=bearer(AGENT)).status_code == 200


def test_config_shows_the_bindings(bound: TestClient) -> None:
    body = bound.get("/v1/config", headers=bearer(ADMIN)).json()
    assert body["bindings"] == {
        "fleet-a": {"instances": ["gpu-a-*"], "agents": ["agent-a*"]},
        "fleet-b": {"instances": ["gpu-b-*"], "agents": ["agent-b"]},
    }
