"""GET /v1/orders: agents lease their instance's orders from the pull sink; progress events
reach the queue; the sink is built from settings at startup and closed at shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.clock import ManualClock
from app.core.config import Settings
from app.core.errors import ConfigError
from app.deliver import (
    InProcessSink,
    PullQueue,
    RedisStreamSink,
    SinkClosed,
    WebhookSink,
)
from kvprefetch_client.agent import StreamSource
from kvprefetch_client.events import INSTANCE_ID_PATTERN
from kvprefetch_client.orders import Cancel, Order
from tests.api.conftest import routed
from tests.deliver.conftest import _receiver_server, order, receiver  # noqa: F401 (fixtures)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(11.0)


@pytest.fixture
def client(settings: Settings, clock: ManualClock) -> Iterator[TestClient]:
    with TestClient(create_app(settings, clock=clock)) as c:
        yield c


def queue_of(client: TestClient) -> PullQueue:
    sink = client.app.state.engine.order_sink  # type: ignore[attr-defined]
    assert isinstance(sink, PullQueue)
    return sink


def pull(client: TestClient, **params: Any) -> tuple[list[Order], list[str]]:
    r = client.get("/v1/orders", params=params)
    assert r.status_code == 200, r.text
    body = r.json()
    return [Order.model_validate(o) for o in body["orders"]], body["cancelled"]


def progress(event_id: str, order_id: str, status: str, **kw: Any) -> dict[str, Any]:
    return {
        "type": "order_progress",
        "event_id": event_id,
        "ts": 11.0,
        "order_id": order_id,
        "status": status,
        **kw,
    }


def test_the_pull_sink_is_the_default_and_leases_an_instances_orders(client: TestClient) -> None:
    sent = [order("a", priority=2.0, block_hashes=[2**63, "ab"]), order("b"), order("c", "gpu-1")]
    queue_of(client).submit_nowait(sent)
    assert pull(client, instance_id="gpu-0", limit=1) == ([sent[0]], [])
    assert pull(client, instance_id="gpu-0") == ([sent[1]], [])
    assert pull(client, instance_id="gpu-0") == ([], [])
    assert pull(client, instance_id="gpu-1") == ([sent[2]], [])


def test_cancels_come_with_the_next_pull(client: TestClient) -> None:
    queue_of(client).submit_nowait([order("a"), order("b")])
    queue_of(client).cancel_nowait([Cancel(order_id="a")])
    assert pull(client, instance_id="gpu-0") == ([order("b")], ["a"])
    assert pull(client, instance_id="gpu-0") == ([], [])


def test_progress_events_reach_the_queue_and_the_ledger_still_counts(
    client: TestClient, clock: ManualClock, settings: Settings
) -> None:
    queue_of(client).submit_nowait(
        [order("a", needed_by_ts=1000.0), order("b", needed_by_ts=1000.0)]
    )
    assert len(pull(client, instance_id="gpu-0")[0]) == 2
    r = client.post(
        "/v1/events",
        json={
            "events": [
                progress("p1", "a", "accepted"),
                progress("p2", "b", "completed", bytes=2048, seconds=0.1),
                progress("p3", "unknown", "accepted"),
                routed("r1"),
            ]
        },
    )
    assert r.status_code == 200, r.text
    clock.advance(settings.order_lease_seconds)
    assert pull(client, instance_id="gpu-0") == ([], [])  # "a" started: not handed out again
    assert queue_of(client).held() == 1
    assert client.get("/v1/model").json()["live"]["unscored"] == 1  # the advice ledger saw r1


def test_an_unaccepted_order_is_handed_out_again_after_its_lease(
    client: TestClient, clock: ManualClock, settings: Settings
) -> None:
    queue_of(client).submit_nowait([order("a", needed_by_ts=1000.0)])
    assert pull(client, instance_id="gpu-0")[0] == [order("a", needed_by_ts=1000.0)]
    clock.advance(settings.order_lease_seconds)
    assert pull(client, instance_id="gpu-0")[0] == [order("a", needed_by_ts=1000.0)]


@pytest.mark.parametrize(
    ("params", "field", "detail"),
    [
        ({}, "instance_id", "the query parameter instance_id is required"),
        (
            {"instance_id": ""},
            "instance_id",
            "instance_id: String should have at least 1 character",
        ),
        (
            {"instance_id": "x" * 257},
            "instance_id",
            "instance_id: String should have at most 256 characters",
        ),
        (
            {"instance_id": "gpu\x1b[2J0"},
            "instance_id",
            f"instance_id: String should match pattern '{INSTANCE_ID_PATTERN}'",
        ),
        (
            {"instance_id": "gpu-0", "limit": "0"},
            "limit",
            "limit: Input should be greater than or equal to 1",
        ),
        (
            {"instance_id": "gpu-0", "limit": "1001"},
            "limit",
            "limit: Input should be less than or equal to 1000",
        ),
        (
            {"instance_id": "gpu-0", "limit": "ten"},
            "limit",
            "limit: Input should be a valid integer, unable to parse string as an integer",
        ),
    ],
)
def test_bad_parameters_are_422_naming_the_field(
    client: TestClient, params: dict[str, str], field: str, detail: str
) -> None:
    r = client.get("/v1/orders", params=params)
    assert (r.status_code, r.json()) == (422, {"detail": detail, "field": field})


def test_another_sink_is_409(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, log_fsync=False, order_sink="memory")
    with TestClient(create_app(settings)) as c:
        engine = c.app.state.engine  # type: ignore[attr-defined]
        assert isinstance(engine.order_sink, InProcessSink)
        r = c.get("/v1/orders", params={"instance_id": "gpu-0"})
    assert (r.status_code, r.json()) == (
        409,
        {
            "detail": "orders go to the memory sink (KVP_ORDER_SINK); "
            "GET /v1/orders serves only the pull sink (KVP_ORDER_SINK=pull)",
            "field": "order_sink",
        },
    )


def test_a_webhook_sink_without_a_url_stops_startup(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, log_fsync=False, order_sink="webhook")
    with (
        pytest.raises(
            ConfigError, match=r"^KVP_ORDER_SINK=webhook needs KVP_ORDER_WEBHOOK_URL, the URL"
        ),
        TestClient(create_app(settings)),
    ):
        pass


def test_the_sink_is_closed_at_shutdown_unless_it_was_injected(settings: Settings) -> None:
    with TestClient(create_app(settings)) as c:
        built = queue_of(c)
    with pytest.raises(SinkClosed):
        built.submit_nowait([order("a")])
    injected = PullQueue()
    with TestClient(create_app(settings, order_sink=injected)) as c:
        assert c.app.state.engine.order_sink is injected  # type: ignore[attr-defined]
    assert injected.submit_nowait([order("a")]) == ["a"]


def test_the_endpoint_is_in_the_openapi_schema(client: TestClient) -> None:
    op = client.get("/openapi.json").json()["paths"]["/v1/orders"]["get"]
    assert {p["name"] for p in op["parameters"]} == {"instance_id", "limit", "agent"}
    assert set(op["responses"]) == {
        "200",
        "401",
        "403",
        "408",
        "409",
        "413",
        "415",
        "422",
        "429",
        "503",
    }
    renew = client.get("/openapi.json").json()["paths"]["/v1/orders/renew"]["post"]
    assert set(renew["responses"]) == {
        "200",
        "400",
        "401",
        "403",
        "408",
        "409",
        "413",
        "415",
        "422",
        "429",
        "503",
    }


def renew(client: TestClient, agent: str, *order_ids: str) -> tuple[list[str], list[str]]:
    r = client.post(
        "/v1/orders/renew",
        json={"instance_id": "gpu-0", "agent": agent, "order_ids": list(order_ids)},
    )
    assert r.status_code == 200, r.text
    assert r.json()["lease_seconds"] == 30.0
    return r.json()["renewed"], r.json()["lost"]


def test_an_agent_renewing_its_leases_keeps_its_orders_from_a_second_agent(
    client: TestClient, clock: ManualClock, settings: Settings
) -> None:
    queue_of(client).submit_nowait(
        [order("a", needed_by_ts=1000.0), order("b", needed_by_ts=1000.0)]
    )
    r = client.get("/v1/orders", params={"instance_id": "gpu-0", "agent": "A"})
    assert (
        r.json()["lease_seconds"] == settings.order_lease_seconds and len(r.json()["orders"]) == 2
    )
    for _ in range(5):  # three leases' time, renewed every half lease
        clock.advance(settings.order_lease_seconds / 2)
        assert renew(client, "A", "a", "b") == (["a", "b"], [])
        assert (
            client.get("/v1/orders", params={"instance_id": "gpu-0", "agent": "B"}).json()["orders"]
            == []
        )
    # A stops renewing: once its lease has run out, B gets them, and A's renewal finds them lost.
    clock.advance(settings.order_lease_seconds)
    assert (
        len(
            client.get("/v1/orders", params={"instance_id": "gpu-0", "agent": "B"}).json()["orders"]
        )
        == 2
    )
    assert renew(client, "A", "a", "b", "never") == ([], ["a", "b", "never"])
    assert renew(client, "B", "a") == (["a"], [])


def test_a_renewal_is_422_naming_a_bad_field(client: TestClient) -> None:
    r = client.post("/v1/orders/renew", json={"instance_id": "gpu-0", "order_ids": ["a"]})
    assert (r.status_code, r.json()) == (422, {"detail": "agent is required", "field": "agent"})


@pytest.mark.parametrize("kind", ["memory", "webhook", "redis"])
def test_the_sink_is_built_from_settings_on_the_apps_loop(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    extra: dict[str, Any] = {}
    if kind == "webhook":
        receiver, extra["order_webhook_url"] = request.getfixturevalue("receiver")
    if kind == "redis":
        extra.update(
            redis_url=request.getfixturevalue("redis_url"),
            redis_prefix=request.getfixturevalue("clean_redis"),
        )
    settings = Settings(data_dir=tmp_path, log_fsync=False, order_sink=kind, **extra)
    with TestClient(create_app(settings)) as c:
        sink = c.app.state.engine.order_sink  # type: ignore[attr-defined]
        assert (
            type(sink)
            is {"memory": InProcessSink, "webhook": WebhookSink, "redis": RedisStreamSink}[kind]
        )
        assert c.portal.call(sink.submit, [order("a")]) == ["a"]  # type: ignore[union-attr]
    if kind == "webhook":
        assert receiver.take() == [order("a")]
    if kind == "redis":
        consumer = StreamSource.from_url(
            settings.redis_url.get_secret_value(),
            prefix=settings.stream_prefix,
            consumer="agent",
            instance_id="gpu-0",
        )
        assert [d.message for d in consumer.poll(0)] == [order("a")]
        consumer.close()
    with pytest.raises(SinkClosed):
        asyncio.run(sink.submit([order("b")]))


@pytest.mark.parametrize("instance_id", ["gpu\n0", "gpu\r0", "gpu\x1b0"])
def test_a_renewal_for_an_instance_id_with_control_characters_is_422(
    client: TestClient, instance_id: str
) -> None:
    r = client.post(
        "/v1/orders/renew", json={"instance_id": instance_id, "agent": "A", "order_ids": []}
    )
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "instance_id"
