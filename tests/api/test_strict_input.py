"""Strict input on POST /v1/events: numbers as numbers, what is logged is what was validated, and
every session id accepted can be read back."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import orjson
import pytest
from fastapi.testclient import TestClient
from pydantic_core import from_json

from app.core.config import Settings
from app.ingest.eventlog import iter_log
from tests.api.conftest import routed


def post(client: TestClient, events: list[dict[str, Any]]):  # type: ignore[no-untyped-def]
    return client.post("/v1/events", json={"events": events})


def status(event_id: str, **kw: Any) -> dict[str, Any]:
    return {
        "type": "instance_status",
        "event_id": event_id,
        "ts": 1.0,
        "instance_id": "gpu-0",
        "free_kv_bytes": 10,
        **kw,
    }


@pytest.mark.parametrize(
    ("event", "field"),
    [
        (routed("a", prompt_tokens="10"), "prompt_tokens"),
        (routed("a", prompt_tokens=True), "prompt_tokens"),
        (routed("a", prompt_tokens=10.0), "prompt_tokens"),
        (routed("a", ts="1767000000"), "ts"),
        (routed("a", ts=True), "ts"),
        (routed("a", block_hashes=[True]), "block_hashes[0]"),
        (routed("a", block_tokens="16"), "block_tokens"),
        (status("a", free_kv_bytes="10"), "free_kv_bytes"),
        (status("a", queue_depth=False), "queue_depth"),
        (
            {
                "type": "order_progress",
                "event_id": "a",
                "ts": 1,
                "order_id": "o",
                "status": "completed",
                "bytes": 1,
                "seconds": "0.5",
            },
            "seconds",
        ),
        (
            {
                "type": "vllm_kv_events",
                "event_id": "a",
                "ts": 1,
                "instance_id": "gpu-0",
                "events": [["BlockStored", [1], None, [1, 2], "16", None, "GPU"]],
            },
            "events[0].block_size",
        ),
        (
            {
                "type": "vllm_kv_events",
                "event_id": "a",
                "ts": 1,
                "instance_id": "gpu-0",
                "data_parallel_rank": True,
                "events": [],
            },
            "data_parallel_rank",
        ),
    ],
)
def test_numbers_are_strict_on_the_wire(
    client: TestClient, settings: Settings, event: dict[str, Any], field: str
) -> None:
    r = post(client, [event])
    assert r.status_code == 422, r.json()
    assert r.json()["rejected"][0]["field"] == f"events[0].{field}"
    assert list(iter_log(settings.event_log_dir)) == []


def test_a_float_takes_a_json_int_and_block_hashes_take_ints_and_strings(
    client: TestClient,
) -> None:
    r = post(
        client,
        [
            routed("a", ts=100, block_hashes=[1, "ab"]),
            {
                "type": "order_progress",
                "event_id": "b",
                "ts": 2,
                "order_id": "o",
                "status": "completed",
                "bytes": 1,
                "seconds": 1,
            },
        ],
    )
    assert r.status_code == 200, r.json()
    assert client.get("/v1/sessions/s1").json()["last_activity_ts"] == 100.0


def test_what_is_logged_is_what_was_validated(client: TestClient, settings: Settings) -> None:
    # A batch of our own events, all new: logged as posted, which strict validation makes hold
    # exactly the values validated (ints as ints, floats as numbers).
    ours = [routed("a", ts=100, block_hashes=[1, "x"]), status("b", total_kv_bytes=20)]
    assert post(client, ours).status_code == 200
    # vLLM's own encoding and the fields of it we do not use (NaN, 1e400, a long string): dropped,
    # and the batch logged re-encoded.
    body = (
        b'{"events": [{"type": "vllm_kv_events", "event_id": "v", "ts": 2, "instance_id": "gpu-1", '
        b'"events": [["BlockStored", [7], null, [1, 2], 16, null, "GPU", "'
        + b"x"
        * 50_000
        + b'"], '
        b'{"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": NaN, '
        b'"extra_keys": 1e400}]}]}'
    )
    r = client.post("/v1/events", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.json()
    lines = (settings.event_log_dir / "events-00000001.jsonl").read_bytes().splitlines()
    assert len(lines) == 2
    assert b"NaN" not in lines[1] and b"1e400" not in lines[1] and b"xxxx" not in lines[1]
    validated = [e.model_dump(mode="json") for _, e in iter_log(settings.event_log_dir)]
    logged = [*from_json(lines[0])["events"], from_json(lines[1])]
    # Every value on a line is the validated one (a line may leave out a default).
    for raw, event in zip(logged, validated, strict=True):
        assert {k: event[k] for k in raw} == raw
        assert all(
            type(event[k]) is type(v) or (isinstance(v, int) and isinstance(event[k], float))
            for k, v in raw.items()
        ), (raw, event)


@pytest.mark.parametrize(
    "session_id", [".", "..", "a/b", "/", "a\nb", "a\x00b", "a\x7fb", "a\x85b", "tab\there"]
)
def test_a_session_id_no_route_could_read_back_is_refused(
    client: TestClient, session_id: str
) -> None:
    r = post(client, [routed("a", session_id=session_id)])
    assert r.status_code == 422
    assert r.json()["rejected"][0]["field"] == "events[0].session_id"


@pytest.mark.parametrize(
    "session_id",
    [
        "...",
        ".hidden",
        "a b",
        "a?b#c",
        "100%",
        "user@example.com",
        "é-ü-中",
        "a\\b",
        "a;b=c&d",
        "x" * 256,
    ],
)
def test_every_session_id_accepted_reads_back(client: TestClient, session_id: str) -> None:
    assert post(client, [routed("a", session_id=session_id)]).status_code == 200
    r = client.get("/v1/sessions/" + quote(session_id, safe=""))
    assert r.status_code == 200, r.text
    assert r.json()["session_id"] == session_id


_CONTROL_IDS = ["gpu\n0", "gpu\r0", "gpu\x1b[31m0", "gpu\x00", "\x7f", "a\x85b", "tab\there"]


def _carriers(instance_id: str) -> list[dict[str, Any]]:
    """One event of each type that names an instance."""
    base = {"ts": 1.0, "instance_id": instance_id}
    return [
        routed("r", instance_id=instance_id),
        {**routed("s"), "type": "request_started", "instance_id": instance_id}
        | {"prompt_tokens": None},
        {"type": "kv_blocks_stored", "event_id": "k", "block_hashes": [1], **base},
        {"type": "kv_blocks_removed", "event_id": "x", "block_hashes": [1], **base},
        {"type": "kv_blocks_cleared", "event_id": "z", **base},
        {"type": "vllm_kv_events", "event_id": "v", "events": [], **base},
        status("i", instance_id=instance_id),
        {"type": "session_signal", "event_id": "g", "session_id": "s1", "kind": "queued", **base},
    ]


@pytest.mark.parametrize("instance_id", _CONTROL_IDS)
def test_an_instance_id_with_control_characters_is_refused_and_the_rest_taken(
    client: TestClient, instance_id: str
) -> None:
    events = [{k: v for k, v in e.items() if v is not None} for e in _carriers(instance_id)] + [
        routed("fine", instance_id="gpu-7")
    ]
    r = post(client, events)
    assert r.status_code == 422, r.text
    rejected = r.json()["rejected"]
    assert [x["field"] for x in rejected] == [
        f"events[{i}].instance_id" for i in range(len(events) - 1)
    ]
    assert r.json()["accepted"] == ["fine"]
    assert [i["instance_id"] for i in client.get("/v1/instances").json()["instances"]] == ["gpu-7"]


@pytest.mark.parametrize("instance_id", ["gpu-0", "node a/gpu 1", "é-中", "x" * 256])
def test_every_instance_id_accepted_reads_back(client: TestClient, instance_id: str) -> None:
    assert post(client, [routed("a", instance_id=instance_id)]).status_code == 200
    body = client.get("/v1/instances").json()
    assert [i["instance_id"] for i in body["instances"]] == [instance_id]


def test_a_log_written_by_a_lenient_version_still_replays(settings: Settings) -> None:
    from app.api.main import create_app

    settings.event_log_dir.mkdir(parents=True)
    # Strings for numbers, and session ids the schema now refuses, as older versions logged them.
    (settings.event_log_dir / "events-00000001.jsonl").write_bytes(
        orjson.dumps(
            {
                "events": [
                    routed("old", ts="5", prompt_tokens="10"),
                    routed("slash", session_id="a/b", prompt_tokens="7"),
                    routed("esc", session_id="s2", instance_id="gpu\x1b0"),
                ]
            }
        )
        + b"\n"
        + orjson.dumps(routed("dot", session_id=".."))
        + b"\n"
    )
    with TestClient(create_app(settings)) as c:
        view = c.get("/v1/sessions/s1").json()
        assert (view["last_activity_ts"], view["last_request"]["prompt_tokens"]) == (5.0, 10)
        store = c.app.state.engine.store  # type: ignore[attr-defined]
        assert store.session("a/b").last_request.prompt_tokens == 7
        assert store.session("..") is not None
        assert store.session("s2").instance_id == "gpu\x1b0"
