"""POST /v1/events: acceptance, idempotency, and exact errors for bad input."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from app.core.config import Settings
from app.ingest.eventlog import iter_log
from tests.api.conftest import routed


def post(client: TestClient, events: list[dict[str, object]]):  # type: ignore[no-untyped-def]
    return client.post("/v1/events", json={"events": events})


def test_accepts_a_batch_and_logs_it(client: TestClient, settings: Settings) -> None:
    r = post(client, [routed("a"), routed("b", session_id="s2")])
    assert r.status_code == 200
    assert r.json() == {"accepted": ["a", "b"], "duplicates": [], "rejected": []}
    logged = [e.event_id for _, e in iter_log(settings.event_log_dir)]
    assert logged == ["a", "b"]


def test_a_resent_batch_is_acknowledged_as_duplicates_and_not_logged_again(
    client: TestClient, settings: Settings
) -> None:
    post(client, [routed("a"), routed("b")])
    r = post(client, [routed("a"), routed("b"), routed("c")])
    assert r.json() == {"accepted": ["c"], "duplicates": ["a", "b"], "rejected": []}
    assert [e.event_id for _, e in iter_log(settings.event_log_dir)] == ["a", "b", "c"]
    assert client.get("/v1/sessions/s1").json()["turns"] == 3


def test_a_repeat_within_one_batch_is_a_duplicate(client: TestClient) -> None:
    r = post(client, [routed("a"), routed("a")])
    assert r.json() == {"accepted": ["a"], "duplicates": ["a"], "rejected": []}


def test_mixed_batch_accepts_the_valid_and_names_each_bad_field(
    client: TestClient, settings: Settings
) -> None:
    r = post(
        client,
        [
            routed("ok1"),
            routed("bad1", prompt_tokens=-5),
            routed("bad2", block_hashes=[1, 2.5]),
            {"type": "no_such_type", "event_id": "bad3", "ts": 1.0},
            routed("ok2", extra_field=1),
            {
                "type": "kv_blocks_stored",
                "event_id": "bad4",
                "ts": 1.0,
                "tier": "pool",
                "instance_id": "gpu-0",
                "block_hashes": [1],
            },
            routed("ok3"),
        ],
    )
    assert r.status_code == 422
    body = r.json()
    assert body["accepted"] == ["ok1", "ok3"]
    assert body["duplicates"] == []
    assert body["rejected"] == [
        {
            "index": 1,
            "event_id": "bad1",
            "field": "events[1].prompt_tokens",
            "message": "Input should be greater than or equal to 0",
        },
        {
            "index": 2,
            "event_id": "bad2",
            "field": "events[2].block_hashes[1]",
            "message": "Input should be a valid integer",
        },
        {
            "index": 3,
            "event_id": "bad3",
            "field": "events[3]",
            "message": "Input tag 'no_such_type' found using 'type' "
            "does not match any of the expected tags: "
            "'request_routed', 'request_started', 'request_finished', 'session_closed', "
            "'session_signal', 'kv_blocks_stored', 'kv_blocks_removed', 'kv_blocks_cleared', "
            "'vllm_kv_events', 'instance_status', 'order_progress', 'model_changed'",
        },
        {
            "index": 4,
            "event_id": "ok2",
            "field": "events[4].extra_field",
            "message": "Extra inputs are not permitted",
        },
        {
            "index": 5,
            "event_id": "bad4",
            "field": "events[5]",
            "message": "tier 'pool' is shared: leave instance_id out",
        },
    ]
    assert (body["rejected_events"], body["rejections_omitted"]) == (5, 0)
    assert [e.event_id for _, e in iter_log(settings.event_log_dir)] == ["ok1", "ok3"]


@pytest.mark.parametrize(
    ("event", "field", "message"),
    [
        (
            {"type": "request_routed", "event_id": "x", "ts": 1.0},
            "events[0].session_id",
            "Field required",
        ),
        (
            routed("x", ts=float("1e12")),
            "events[0].ts",
            "Input should be less than or equal to 100000000000",
        ),
        (
            routed("x", prompt_tokens=10**9),
            "events[0].prompt_tokens",
            "Input should be less than or equal to 10000000",
        ),
        (
            routed("x", session_id=""),
            "events[0].session_id",
            "String should have at least 1 character",
        ),
        (
            routed(
                "",
            ),
            "events[0].event_id",
            "String should have at least 1 character",
        ),
        (
            {"event_id": "x", "ts": 1.0},
            "events[0]",
            "Unable to extract tag using discriminator 'type'",
        ),
        (
            {
                "type": "instance_status",
                "event_id": "x",
                "ts": 1.0,
                "instance_id": "g",
                "free_kv_bytes": 10,
                "total_kv_bytes": 5,
            },
            "events[0]",
            "free_kv_bytes exceeds total_kv_bytes",
        ),
        (
            {
                "type": "order_progress",
                "event_id": "x",
                "ts": 1.0,
                "order_id": "o",
                "status": "completed",
            },
            "events[0]",
            "a completed order reports bytes and seconds",
        ),
        (
            {
                "type": "order_progress",
                "event_id": "x",
                "ts": 1.0,
                "order_id": "o",
                "status": "failed",
            },
            "events[0]",
            "a failed order reports a reason",
        ),
        (
            {
                "type": "kv_blocks_removed",
                "event_id": "x",
                "ts": 1.0,
                "tier": "hbm",
                "block_hashes": [1],
            },
            "events[0]",
            "instance_id is required for tier 'hbm'",
        ),
        (
            {
                "type": "vllm_kv_events",
                "event_id": "x",
                "ts": 1.0,
                "instance_id": "g",
                "events": [{"type": "BlockStored", "block_hashes": [1]}],
            },
            "events[0].events[0].block_size",
            "Field required",
        ),
    ],
)
def test_each_bad_event_names_its_field(
    client: TestClient, event: dict, field: str, message: str
) -> None:
    r = post(client, [event])
    assert r.status_code == 422
    rejected = r.json()["rejected"]
    assert rejected[0]["field"] == field
    assert rejected[0]["message"] == message
    assert r.json()["accepted"] == []


def test_nan_is_rejected(client: TestClient) -> None:
    body = (
        '{"events": [{"type": "request_routed", "event_id": "x", "ts": NaN, "session_id": "s", '
        '"request_id": "r", "instance_id": "g", "prompt_tokens": 1}]}'
    )
    r = client.post("/v1/events", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["field"] == "body"


def test_malformed_json_is_400(client: TestClient) -> None:
    r = client.post(
        "/v1/events", content=b'{"events": [', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert r.json() == {
        "detail": "the body is not valid JSON: unexpected end of data: line 1 column 13 (char 12)",
        "field": "body",
    }


def test_wrong_content_type_is_415(client: TestClient) -> None:
    r = client.post(
        "/v1/events",
        content=json.dumps({"events": [routed("a")]}),
        headers={"content-type": "text/plain"},
    )
    assert r.status_code == 415
    assert r.json() == {"detail": "send the batch as application/json", "field": "content-type"}


@pytest.mark.parametrize(
    ("body", "status", "field", "detail"),
    [
        ([], 422, "body", 'the body must be a JSON object: {"events": [...]}'),
        ({}, 422, "events", "'events' is required"),
        ({"events": {}}, 422, "events", "'events' must be a list of events"),
        ({"events": []}, 422, "events", "a batch holds at least one event"),
        ({"events": [], "extra": 1}, 422, "extra", "unknown field: a batch has only 'events'"),
    ],
)
def test_bad_batch_shapes(
    client: TestClient, body: object, status: int, field: str, detail: str
) -> None:
    r = client.post("/v1/events", json=body)
    assert r.status_code == status
    assert r.json() == {"detail": detail, "field": field}


def test_too_many_events_is_413(client: TestClient) -> None:
    r = post(client, [routed(f"e{i}") for i in range(51)])
    assert r.status_code == 413
    assert r.json() == {"detail": "a batch holds at most 50 events, got 51", "field": "events"}
    assert client.get("/v1/sessions/s1").status_code == 404


def test_oversized_body_is_413_and_disturbs_nothing(client: TestClient) -> None:
    post(client, [routed("keep")])
    huge = {"events": [routed("big", block_hashes=list(range(20_000)))]}
    r = client.post("/v1/events", json=huge)
    assert r.status_code == 413
    assert r.json()["field"] == "body"
    assert client.get("/v1/sessions/s1").json()["turns"] == 1


def test_oversized_chunked_body_is_413(client: TestClient) -> None:
    def chunks():  # type: ignore[no-untyped-def]
        yield b'{"events": ['
        for _ in range(2000):
            yield (
                b'{"type": "session_closed", '
                b'"event_id": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "ts": 1},'
            )
        yield b"]}"

    r = client.post("/v1/events", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_every_event_type_is_accepted(client: TestClient) -> None:
    events = [
        routed("e1", block_hashes=[1, 2, "abc"], block_tokens=512),
        {
            "type": "request_started",
            "event_id": "e2",
            "ts": 2.0,
            "session_id": "s1",
            "request_id": "r-e1",
            "instance_id": "gpu-0",
        },
        {
            "type": "request_finished",
            "event_id": "e3",
            "ts": 3.0,
            "session_id": "s1",
            "request_id": "r-e1",
            "instance_id": "gpu-0",
            "output_tokens": 20,
            "context_tokens": 1020,
        },
        {
            "type": "kv_blocks_stored",
            "event_id": "e4",
            "ts": 3.0,
            "tier": "hbm",
            "instance_id": "gpu-0",
            "block_hashes": [1, 2],
            "parent_block_hash": None,
            "block_tokens": 512,
        },
        {
            "type": "kv_blocks_removed",
            "event_id": "e5",
            "ts": 4.0,
            "tier": "hbm",
            "instance_id": "gpu-0",
            "block_hashes": [2],
        },
        {
            "type": "kv_blocks_cleared",
            "event_id": "e6",
            "ts": 5.0,
            "tier": "host",
            "instance_id": "gpu-0",
        },
        {
            "type": "vllm_kv_events",
            "event_id": "e7",
            "ts": 6.0,
            "instance_id": "gpu-1",
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [7],
                    "parent_block_hash": None,
                    "token_ids": [1, 2],
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
            ],
        },
        {
            "type": "instance_status",
            "event_id": "e8",
            "ts": 6.0,
            "instance_id": "gpu-1",
            "free_kv_bytes": 10,
            "total_kv_bytes": 20,
            "queue_depth": 1,
            "running_requests": 2,
        },
        {
            "type": "order_progress",
            "event_id": "e9",
            "ts": 7.0,
            "order_id": "o1",
            "status": "completed",
            "bytes": 100,
            "seconds": 0.01,
        },
        {"type": "session_closed", "event_id": "e10", "ts": 8.0, "session_id": "s1"},
        {"type": "session_signal", "event_id": "e11", "ts": 7.5, "session_id": "s1", "kind": "x"},
    ]
    r = post(client, events)
    assert r.status_code == 200, r.json()
    assert len(r.json()["accepted"]) == 11
    assert client.get("/v1/sessions/s1").json()["state"] == "closed"


def test_an_unavailable_store_is_503_and_nothing_is_acknowledged(settings: Settings) -> None:
    from app.api.main import create_app
    from app.core.errors import StoreUnavailable
    from app.state import MemoryStore

    class Down(MemoryStore):
        def apply(self, events):  # type: ignore[no-untyped-def]
            raise StoreUnavailable("connection refused")

    with TestClient(create_app(settings, store=Down(bytes_per_token=1, block_tokens=512))) as c:
        r = post(c, [routed("a")])
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        assert r.json() == {
            "detail": "the state store is unavailable: connection refused",
            "field": "store",
        }


@pytest.mark.parametrize("error", ["unavailable", "failed"])
def test_a_store_503_is_counted_as_a_refused_batch(settings: Settings, error: str) -> None:
    from app.api.main import create_app
    from app.core.errors import StoreError, StoreUnavailable
    from app.state import MemoryStore

    class Down(MemoryStore):
        def seen_and_newest(self, event_ids):  # type: ignore[no-untyped-def]
            if error == "unavailable":
                raise StoreUnavailable("connection refused")
            raise StoreError("OOM")

    with TestClient(create_app(settings, store=Down(bytes_per_token=1, block_tokens=512))) as c:
        assert [post(c, [routed("a")]).status_code for _ in range(3)] == [503] * 3
        text = c.get("/metrics").text
    assert 'kvprefetch_event_batches_refused_total{code="503"} 3.0' in text
