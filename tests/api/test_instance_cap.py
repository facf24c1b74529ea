"""POST /v1/events past KVP_MAX_INSTANCES, on both stores and across a restart: the events naming
one instance more are refused (422 on their instance_id), the rest of the batch is taken, and a
log holding more instances than the cap replays within it."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.config import Settings
from tests.api.conftest import routed

CAP = 3


@pytest.fixture(params=["memory", "redis"])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Settings]:
    if request.param == "memory":
        yield Settings(data_dir=tmp_path, log_fsync=False, max_instances=CAP)
    else:
        yield Settings(
            data_dir=tmp_path,
            log_fsync=False,
            max_instances=CAP,
            store="redis",
            redis_url=request.getfixturevalue("redis_url"),
            redis_prefix=request.getfixturevalue("clean_redis"),
        )


def stored(event_id: str, instance_id: str, ts: float) -> dict[str, Any]:
    return {
        "type": "kv_blocks_stored",
        "event_id": event_id,
        "ts": ts,
        "instance_id": instance_id,
        "block_hashes": [1, 2],
    }


def refused_total(client: TestClient) -> float:
    text = client.get("/metrics").text
    match = re.search(
        r'^kvprefetch_events_refused_total\{reason="instance_cap"\} (\S+)$', text, re.MULTILINE
    )
    assert match, text
    return float(match.group(1))


def instance_ids(client: TestClient) -> list[str]:
    return [i["instance_id"] for i in client.get("/v1/instances").json()["instances"]]


def test_events_naming_instances_past_the_cap_are_422_and_the_rest_taken(
    settings: Settings,
) -> None:
    now = time.time()
    batch = [
        stored("a", "gpu-0", now),
        stored("b", "gpu-1", now),
        routed("c", instance_id="gpu-2", ts=now),
        stored("d", "gpu-3", now),  # one more than the cap
        {"type": "session_closed", "event_id": "e", "ts": now, "session_id": "s1"},
        stored("f", "gpu-0", now),  # a held instance still takes events
        {
            "type": "instance_status",
            "event_id": "g",
            "ts": now,
            "instance_id": "gpu-4",
            "free_kv_bytes": 1,
        },
        routed("h", session_id="s9", instance_id="gpu-5", ts=now),
    ]
    with TestClient(create_app(settings)) as c:
        r = c.post("/v1/events", json={"events": batch})
        assert r.status_code == 422, r.text
        body = r.json()
        assert [(x["index"], x["field"]) for x in body["rejected"]] == [
            (3, "events[3].instance_id"),
            (6, "events[6].instance_id"),
            (7, "events[7].instance_id"),
        ]
        assert "KVP_MAX_INSTANCES" in body["rejected"][0]["message"]
        assert body["accepted"] == ["a", "b", "c", "e", "f"]
        assert instance_ids(c) == ["gpu-0", "gpu-1", "gpu-2"]
        assert c.get("/v1/sessions/s9").status_code == 404
        assert refused_total(c) == 3
        # The same again: what was taken is a duplicate, what was refused is refused again.
        r = c.post("/v1/events", json={"events": batch})
        assert r.status_code == 422
        assert (r.json()["duplicates"], len(r.json()["rejected"])) == (
            ["a", "b", "c", "e", "f"],
            3,
        )


def test_a_batch_that_moves_past_the_retention_finds_the_room_it_makes(
    settings: Settings,
) -> None:
    settings = settings.model_copy(update={"instance_retention_seconds": 100.0})
    now = time.time()
    with TestClient(create_app(settings)) as c:
        first = [stored(f"a{i}", f"old-{i}", now - 500) for i in range(CAP)]
        assert c.post("/v1/events", json={"events": first}).status_code == 200
        # At the cap; the batch's second event moves the cutoff past every old instance.
        batch = [
            stored("b0", "new-0", now - 450),
            stored("b1", "new-1", now - 300),
            stored("b2", "new-2", now - 300),
            stored("b3", "new-3", now - 300),
            stored("b4", "old-0", now - 300),
        ]
        r = c.post("/v1/events", json={"events": batch})
        assert r.status_code == 422, r.text
        assert [x["field"] for x in r.json()["rejected"]] == [
            "events[0].instance_id",
            "events[4].instance_id",
        ]
        assert instance_ids(c) == ["new-1", "new-2", "new-3"]


def test_a_log_holding_more_instances_than_the_cap_replays_within_it(
    settings: Settings,
) -> None:
    now = time.time()
    settings.event_log_dir.mkdir(parents=True)
    # As a version without the cap logged it: ten instances.
    (settings.event_log_dir / "events-00000001.jsonl").write_bytes(
        orjson.dumps({"events": [stored(f"e{i}", f"gpu-{i}", now) for i in range(10)]}) + b"\n"
    )
    with TestClient(create_app(settings)) as c:
        assert instance_ids(c) == ["gpu-0", "gpu-1", "gpu-2"]
        locations = c.get("/v1/locations").json()["locations"]
        assert [loc["location"] for loc in locations] == ["hbm@gpu-0", "hbm@gpu-1", "hbm@gpu-2"]
