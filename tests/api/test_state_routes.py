"""GET endpoints: sessions, instances, locations, health, readiness, OpenAPI."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.config import Settings
from tests.api.conftest import routed


def test_session_view(client: TestClient) -> None:
    client.post(
        "/v1/events",
        json={"events": [routed("a", ts=10.0, block_hashes=[1, 2]), routed("b", ts=70.0)]},
    )
    r = client.get("/v1/sessions/s1")
    assert r.status_code == 200
    body = r.json()
    assert body["session_id"] == "s1"
    assert body["turns"] == 2
    assert body["inter_turn_gaps_seconds"] == [60.0]
    assert body["context_bytes"] == 1000 * 327_680
    assert body["block_hashes"] == [1, 2]


def test_unknown_session_is_404(client: TestClient) -> None:
    r = client.get("/v1/sessions/nobody")
    assert r.status_code == 404
    assert r.json() == {"detail": "session 'nobody' is not known", "field": "session_id"}


def test_a_session_id_over_256_characters_is_refused_by_name(client: TestClient) -> None:
    r = client.get("/v1/sessions/" + "s" * 257)
    assert (r.status_code, r.json()) == (
        422,
        {
            "detail": "the path parameter session_id: String should have at most 256 characters",
            "field": "session_id",
        },
    )


def test_instances_and_locations(client: TestClient) -> None:
    client.post(
        "/v1/events",
        json={
            "events": [
                routed("a"),
                {
                    "type": "kv_blocks_stored",
                    "event_id": "k",
                    "ts": 2.0,
                    "instance_id": "gpu-0",
                    "block_hashes": [1, 2],
                },
                {
                    "type": "kv_blocks_stored",
                    "event_id": "p",
                    "ts": 2.0,
                    "tier": "pool",
                    "block_hashes": [1],
                },
            ]
        },
    )
    instances = client.get("/v1/instances").json()["instances"]
    assert [i["instance_id"] for i in instances] == ["gpu-0"]
    assert instances[0]["resident_blocks"] == {"hbm": 2}
    locations = client.get("/v1/locations").json()["locations"]
    assert [(loc["location"], loc["blocks"]) for loc in locations] == [
        ("hbm@gpu-0", 2),
        ("pool", 1),
    ]


def test_instances_come_in_pages_by_id(client: TestClient) -> None:
    client.post(
        "/v1/events",
        json={
            "events": [
                {
                    "type": "instance_status",
                    "event_id": f"i{k}",
                    "ts": 1.0,
                    "instance_id": f"gpu-{k}",
                    "free_kv_bytes": k,
                }
                for k in (4, 0, 3, 1, 2)
            ]
        },
    )
    seen, cursor, pages = [], None, 0
    while True:
        body = client.get(
            "/v1/instances", params={"limit": 2, **({"cursor": cursor} if cursor else {})}
        ).json()
        pages += 1
        seen += [i["instance_id"] for i in body["instances"]]
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert (seen, pages) == ([f"gpu-{k}" for k in range(5)], 3)
    assert client.get("/v1/instances").json()["next_cursor"] is None  # 100 by default: one page
    r = client.get("/v1/instances", params={"limit": 1001})
    assert (r.status_code, r.json()) == (
        422,
        {
            "detail": "the query parameter limit: Input should be less than or equal to 1000",
            "field": "limit",
        },
    )
    paged = client.get("/openapi.json").json()["paths"]["/v1/instances"]["get"]
    assert {p["name"] for p in paged["parameters"]} == {"limit", "cursor"}


def test_locations_come_in_pages_by_name(client: TestClient) -> None:
    events: list[dict[str, object]] = [
        {
            "type": "kv_blocks_stored",
            "event_id": f"k{k}{tier}",
            "ts": 1.0,
            "instance_id": f"gpu-{k}",
            "tier": tier,
            "block_hashes": [k],
        }
        for k in (2, 0, 1)
        for tier in ("hbm", "host")
    ]
    events.append(
        {
            "type": "kv_blocks_stored",
            "event_id": "p",
            "ts": 1.0,
            "tier": "pool",
            "block_hashes": [9],
        }
    )
    assert client.post("/v1/events", json={"events": events}).status_code == 200
    seen, cursor, pages = [], None, 0
    while True:
        body = client.get(
            "/v1/locations", params={"limit": 3, **({"cursor": cursor} if cursor else {})}
        ).json()
        pages += 1
        seen += [loc["location"] for loc in body["locations"]]
        cursor = body["next_cursor"]
        if cursor is None:
            break
    want = [f"{tier}@gpu-{k}" for tier in ("hbm", "host") for k in range(3)] + ["pool"]
    assert (seen, pages) == (want, 3)
    assert client.get("/v1/locations").json()["next_cursor"] is None  # 100 by default: one page
    for params, field in (({"limit": 1001}, "limit"), ({"cursor": ""}, "cursor")):
        r = client.get("/v1/locations", params=params)
        assert (r.status_code, r.json()["field"]) == (422, field)
    paged = client.get("/openapi.json").json()["paths"]["/v1/locations"]["get"]
    assert {p["name"] for p in paged["parameters"]} == {"limit", "cursor"}


def test_health_and_readiness(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    body = ready.json()
    assert (body["status"], body["store"], body["store_ok"]) == ("ready", "memory", True)
    assert body["predictor"] == "learned (default)"  # the bundled model


def test_openapi_documents_the_event_batch(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    body = schema["paths"]["/v1/events"]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]
    assert body == {"$ref": "#/components/schemas/EventBatch"}
    components = schema["components"]["schemas"]
    assert "RequestRouted" in components and "VllmKvEvents" in components
    assert client.get("/docs").status_code == 200


def test_readiness_names_the_clock(settings: Settings) -> None:
    """A replay over HTTP stamps its events by the service's clock: /readyz says what it reads and
    how fast it runs (KVP_CLOCK_SPEED)."""
    with TestClient(create_app(settings)) as plain:
        before = time.time()
        body = plain.get("/readyz").json()
        after = time.time()
    assert body["clock_speed"] == 1.0
    assert before <= body["clock_ts"] <= after  # the wall clock
    fast = settings.model_copy(update={"clock_speed": 1000.0})
    with TestClient(create_app(fast)) as c:
        first = c.get("/readyz").json()
        time.sleep(0.01)
        second = c.get("/readyz").json()
    assert first["clock_speed"] == 1000.0
    # 10 ms of wall time or more is at least 10 s of its clock.
    assert second["clock_ts"] - first["clock_ts"] >= 10.0
