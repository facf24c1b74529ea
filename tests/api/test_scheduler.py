"""The service's planning loop: events in, advice from the serving model, orders out through the
configured sink, progress back; GET /v1/scheduler reports it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.clock import ManualClock
from app.core.config import Settings
from kvprefetch_client.orders import Order
from tests.api.conftest import settle

BLOCKS = list(range(100, 120))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


@pytest.fixture
def client(settings: Settings, clock: ManualClock) -> Iterator[TestClient]:
    quiet = settings.model_copy(
        update={"score_interval_seconds": 0.0, "plan_interval_seconds": 0.0}
    )
    with TestClient(create_app(quiet, clock=clock)) as c:
        yield c


def turn(n: int, ts: float) -> list[dict[str, object]]:
    common = {"session_id": "s1", "request_id": f"r{n}", "instance_id": "gpu-0"}
    return [
        {
            "type": "request_routed",
            "event_id": f"q{n}",
            "ts": ts,
            **common,
            "prompt_tokens": 9000,
            "block_hashes": BLOCKS,
        },
        {
            "type": "request_finished",
            "event_id": f"f{n}",
            "ts": ts + 5.0,
            **common,
            "output_tokens": 200,
            "context_tokens": 10_240,
            "block_hashes": BLOCKS,
        },
    ]


def post(client: TestClient, events: list[dict[str, object]]) -> None:
    r = client.post("/v1/events", json={"events": events})
    assert r.status_code == 200, r.text
    settle(client)


def tick(client: TestClient) -> None:
    state = client.app.state.engine  # type: ignore[attr-defined]
    state.scorer.tick()
    asyncio.run(state.dispatcher.tick())


def test_a_likely_return_gets_its_context_pinned_and_the_agent_reports_back(
    client: TestClient,
) -> None:
    # A session with a steady 20 s rhythm, its context in HBM on gpu-0: the model expects it back.
    events = (
        # Six turns 20 s apart: a rhythm the bundled model is sure of.
        [e for n in range(6) for e in turn(n, 860.0 + 20.0 * n)]
        + [
            {
                "type": "kv_blocks_stored",
                "event_id": "hbm",
                "ts": 965.0,
                "tier": "hbm",
                "instance_id": "gpu-0",
                "block_hashes": BLOCKS,
            },
            {
                "type": "instance_status",
                "event_id": "st",
                "ts": 990.0,
                "instance_id": "gpu-0",
                "free_kv_bytes": 10**12,
            },
        ]
    )
    post(client, events)
    tick(client)
    status = client.get("/v1/scheduler").json()
    assert status["tracked_sessions"] == 1
    r = client.get("/v1/orders", params={"instance_id": "gpu-0"})
    orders = [Order.model_validate(o) for o in r.json()["orders"]]
    assert [(o.kind, o.block_hashes, o.session_ids) for o in orders] == [("pin", BLOCKS, ["s1"])]
    assert status["orders"]["pin"] == 1
    # The session comes back: its advice is void; the next tick plans nothing for it.
    post(
        client,
        [
            {
                "type": "request_routed",
                "event_id": "q6",
                "ts": 1001.0,
                "session_id": "s1",
                "request_id": "r6",
                "instance_id": "gpu-0",
                "prompt_tokens": 9500,
            }
        ],
    )
    assert client.get("/v1/scheduler").json()["tracked_sessions"] == 0


def test_order_progress_reaches_the_scheduler(client: TestClient) -> None:
    scheduler = client.app.state.engine.scheduler  # type: ignore[attr-defined]
    post(
        client,
        [
            {
                "type": "kv_blocks_stored",
                "event_id": "pool",
                "ts": 900.0,
                "tier": "pool",
                "instance_id": None,
                "block_hashes": BLOCKS,
            },
            {
                "type": "instance_status",
                "event_id": "st",
                "ts": 900.0,
                "instance_id": "gpu-0",
                "free_kv_bytes": 10**12,
            },
        ],
    )
    from app.decide.advisor import SessionAdvice

    scheduler.advise(
        [SessionAdvice("s9", "gpu-0", tuple(BLOCKS), "lru", 0.0, 0.9, 0.9, 0.9, True)], 1000.0
    )
    asyncio.run(client.app.state.engine.dispatcher.tick())  # type: ignore[attr-defined]
    (order,) = client.get("/v1/orders", params={"instance_id": "gpu-0"}).json()["orders"]
    assert order["kind"] == "prefetch" and order["source_tier"] == "pool"
    post(
        client,
        [
            {
                "type": "order_progress",
                "event_id": "p1",
                "ts": 1001.0,
                "order_id": order["order_id"],
                "status": "completed",
                "bytes": order["size_bytes"],
                "seconds": 0.4,
            }
        ],
    )
    status = client.get("/v1/scheduler").json()
    assert (status["open_orders"], status["completed"], status["inflight_bytes"]) == (0, 1, 0)
    # Landed, and waiting for a request until used, evicted, demoted or past its hold.
    landed = order["size_bytes"]
    assert (status["bytes_landed"], status["bytes_waiting"], status["bytes_wasted"]) == (
        landed,
        landed,
        0,
    )


def test_an_empty_service_reports_an_idle_scheduler(client: TestClient) -> None:
    assert client.get("/v1/scheduler").json() == {
        "planning": True,
        "tracked_sessions": 0,
        "candidates": 0,
        "open_orders": 0,
        "inflight_bytes": 0,
        "orders": {"prefetch": 0, "pin": 0, "demote": 0},
        "bytes_ordered": 0,
        "completed": 0,
        "failed": 0,
        "cancelled": 0,
        "bytes_landed": 0,
        "bytes_used": 0,
        "bytes_wasted": 0,
        "bytes_waiting": 0,
        "bytes_unused": 0,
        "pins_held": 0,
        "pins_pending": 0,
    }
