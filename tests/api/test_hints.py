"""POST /v1/route-hint: a real app answers from its store (and its scheduler's open orders when
it has one); bad bodies get {"detail", "field"}; an unknown session is answered, not refused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.clock import ManualClock
from app.core.config import Settings
from kvprefetch_client.events import INSTANCE_ID_PATTERN
from kvprefetch_client.orders import Order
from tests.api.conftest import routed, settle

# Settings' defaults: 512-token blocks of 327,680 bytes per token, a 12.5 GB/s pool link.
BLOCK = 512 * 327_680


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, clock=ManualClock(100.0))) as c:
        yield c


def post_events(client: TestClient, *events: dict[str, Any]) -> None:
    r = client.post("/v1/events", json={"events": list(events)})
    assert r.status_code == 200, r.text
    settle(client)


def stored(
    event_id: str, blocks: list[int], instance_id: str | None = "gpu-0", tier: str = "hbm"
) -> dict[str, Any]:
    return {
        "type": "kv_blocks_stored",
        "event_id": event_id,
        "ts": 3.0,
        "tier": tier,
        "instance_id": instance_id,
        "block_hashes": blocks,
    }


def status(event_id: str, instance_id: str, queue: int, running: int) -> dict[str, Any]:
    return {
        "type": "instance_status",
        "event_id": event_id,
        "ts": 4.0,
        "instance_id": instance_id,
        "free_kv_bytes": 10**11,
        "queue_depth": queue,
        "running_requests": running,
    }


def hint(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post("/v1/route-hint", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_context_wins_and_every_candidate_is_explained(client: TestClient) -> None:
    post_events(
        client,
        routed("a", ts=1.0, block_hashes=[1, 2, 3, 4]),
        stored("h0", [1, 2, 3, 4]),
        stored("h1", [1], "gpu-1"),
        stored("p", [1, 2, 3, 4], None, "pool"),
        status("i0", "gpu-0", 0, 9),
        status("i1", "gpu-1", 0, 2),
    )
    body = hint(client, {"session_id": "s1", "candidates": ["gpu-1", "gpu-0", "gpu-7"]})
    assert (body["session_id"], body["context_known"], body["recommended"]) == ("s1", True, "gpu-0")
    assert body["context_bytes"] == 1000 * 327_680
    one, zero, seven = body["candidates"]
    assert zero == {
        "instance_id": "gpu-0",
        "resident_bytes": 4 * BLOCK,
        "inflight_bytes": 0,
        "missing_bytes": 0,
        "source": "none",
        "expected_load_seconds": 0.0,
        "queue_depth": 0,
        "running_requests": 9,
        "expected_wait_seconds": 0.0,
        "expected_seconds": 0.0,
        "recommended": True,
        "reason": "4/4 blocks in HBM, ready in 0.000 s; 0 queued, 9 running, wait 0.000 s",
    }
    assert (one["resident_bytes"], one["missing_bytes"], one["source"]) == (
        BLOCK,
        3 * BLOCK,
        "pool",
    )
    assert one["expected_load_seconds"] == pytest.approx(3 * BLOCK / 12.5e9, abs=1e-6)
    assert (seven["queue_depth"], seven["running_requests"], seven["source"]) == (
        None,
        None,
        "pool",
    )
    assert body["reason"] == "gpu-0: 0.000 s to start against 0.040 s on gpu-1"


def test_a_long_queue_at_home_sends_it_elsewhere(client: TestClient) -> None:
    post_events(
        client,
        routed("a", ts=1.0, block_hashes=[1, 2]),
        stored("h0", [1, 2]),
        stored("p", [1, 2], None, "pool"),
        status("i0", "gpu-0", 8, 16),
        status("i1", "gpu-1", 0, 3),
    )
    body = hint(client, {"session_id": "s1", "candidates": ["gpu-0", "gpu-1"]})
    assert body["recommended"] == "gpu-1"
    assert body["candidates"][0]["expected_wait_seconds"] == pytest.approx(5.0)  # 8 x 10 s / 16


def test_open_orders_of_the_apps_scheduler_count_as_on_their_way(client: TestClient) -> None:
    post_events(client, routed("a", ts=1.0, block_hashes=[1, 2]), stored("p", [1, 2], None, "pool"))
    order = Order(
        order_id="o1",
        kind="prefetch",
        instance_id="gpu-1",
        source_tier="pool",
        block_hashes=[1, 2],
        size_bytes=2 * BLOCK,
        created_ts=99.0,
        start_by_ts=99.0,
        needed_by_ts=100.02,
    )

    class Scheduler:
        def open_orders(self) -> list[Order]:
            return [order]

    client.app.state.engine.scheduler = Scheduler()  # type: ignore[attr-defined]
    body = hint(client, {"session_id": "s1", "candidates": ["gpu-0", "gpu-1"]})
    zero, one = body["candidates"]
    assert (one["inflight_bytes"], one["missing_bytes"], one["expected_load_seconds"]) == (
        2 * BLOCK,
        0,
        pytest.approx(0.02),
    )
    assert zero["inflight_bytes"] == 0 and body["recommended"] == "gpu-1"


def test_an_unknown_session_is_answered_with_the_least_loaded(client: TestClient) -> None:
    post_events(client, status("i0", "gpu-0", 0, 5), status("i1", "gpu-1", 0, 1))
    body = hint(client, {"session_id": "nobody", "candidates": ["gpu-0", "gpu-1"]})
    assert (body["context_known"], body["context_bytes"], body["recommended"]) == (
        False,
        0,
        "gpu-1",
    )
    assert body["reason"] == "gpu-1: no context known; ties gpu-0 at 0.000 s, less loaded"
    assert [c["expected_load_seconds"] for c in body["candidates"]] == [0.0, 0.0]


@pytest.mark.parametrize(
    ("body", "field", "detail"),
    [
        (
            {"session_id": "s1", "candidates": []},
            "candidates",
            "candidates: List should have at least 1 item after validation, not 0",
        ),
        (
            {"session_id": "s1", "candidates": ["gpu-0", "gpu-1", "gpu-0"]},
            "candidates",
            "candidates: 'gpu-0' is listed twice; candidates must be distinct",
        ),
        (
            {"session_id": "s1", "candidates": [f"gpu-{i}" for i in range(65)]},
            "candidates",
            "candidates: List should have at most 64 items after validation, not 65",
        ),
        (
            {"session_id": "s1", "candidates": ["gpu-0", ""]},
            "candidates",
            "candidates.1: String should have at least 1 character",
        ),
        (
            {"session_id": "s1", "candidates": ["gpu-0", "gpu\x1b[1m"]},
            "candidates",
            f"candidates.1: String should match pattern '{INSTANCE_ID_PATTERN}'",
        ),
        ({"candidates": ["gpu-0"]}, "session_id", "session_id is required"),
        (
            {"session_id": "", "candidates": ["gpu-0"]},
            "session_id",
            "session_id: String should have at least 1 character",
        ),
        ({"session_id": "s1"}, "candidates", "candidates is required"),
        (
            {"session_id": "s1", "candidates": ["gpu-0"], "extra": 1},
            "extra",
            "extra: Extra inputs are not permitted",
        ),
    ],
)
def test_bad_bodies_name_their_field(
    client: TestClient, body: dict[str, Any], field: str, detail: str
) -> None:
    r = client.post("/v1/route-hint", json=body)
    assert r.status_code == 422
    assert r.json() == {"detail": detail, "field": field}


def test_a_body_that_is_not_json(client: TestClient) -> None:
    r = client.post(
        "/v1/route-hint", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert r.json() == {
        "detail": "the body is not JSON: Expecting property name enclosed in double quotes",
        "field": "body",
    }


def test_a_body_that_is_not_utf8_is_not_json_either(client: TestClient) -> None:
    r = client.post(
        "/v1/route-hint",
        content=b'{"session_id": "\xff"}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json() == {
        "detail": "the body is not JSON: 'utf-8' codec can't decode byte 0xff in position 16: "
        "invalid start byte",
        "field": "body",
    }


def test_openapi_documents_the_hint_with_examples(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    post = schema["paths"]["/v1/route-hint"]["post"]
    assert set(post["responses"]) == {
        "200",
        "400",
        "401",
        "403",
        "408",
        "413",
        "415",
        "422",
        "429",
        "503",
    }
    components = schema["components"]["schemas"]
    assert components["RouteHintRequest"]["examples"][0]["candidates"] == [
        "gpu-0",
        "gpu-1",
        "gpu-2",
    ]
    assert components["RouteHintResponse"]["examples"][0]["recommended"] == "gpu-0"
