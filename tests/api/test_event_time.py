"""POST /v1/events against the service clock, on both stores and across a restart
(docs/decisions.md, 15): one event from the future must not make the store forget every session."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.config import Settings
from tests.api.conftest import routed

YEAR_3000 = 32_503_680_000.0
HOUR = 3600.0


@pytest.fixture(params=["memory", "redis"])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Settings]:
    """The service's own windows and clock (a SystemClock); Redis on a clean prefix."""
    if request.param == "memory":
        yield Settings(data_dir=tmp_path, log_fsync=False)
    else:
        yield Settings(
            data_dir=tmp_path,
            log_fsync=False,
            store="redis",
            redis_url=request.getfixturevalue("redis_url"),
            redis_prefix=request.getfixturevalue("clean_redis"),
        )


def refused_total(client: TestClient, reason: str) -> float:
    text = client.get("/metrics").text
    match = re.search(
        rf'^kvprefetch_events_refused_total\{{reason="{reason}"\}} (\S+)$', text, re.MULTILINE
    )
    assert match, text
    return float(match.group(1))


def test_events_from_the_future_are_refused_and_later_sessions_read_back(
    settings: Settings,
) -> None:
    now = time.time()
    with TestClient(create_app(settings)) as c:
        assert (
            c.post(
                "/v1/events", json={"events": [routed("before", "s-before", now - 5)]}
            ).status_code
            == 200
        )
        batch = [
            {
                "type": "order_progress",
                "event_id": "far",
                "ts": YEAR_3000,
                "order_id": "o1",
                "status": "accepted",
            },
            routed("valid", "s-valid", now - 1),
            {
                "type": "instance_status",
                "event_id": "hour",
                "ts": now + HOUR,
                "instance_id": "gpu-9",
                "free_kv_bytes": 1,
            },
            {
                "type": "kv_blocks_cleared",
                "event_id": "cleared",
                "ts": now + HOUR,
                "instance_id": "gpu-0",
            },
        ]
        r = c.post("/v1/events", json={"events": batch})
        assert r.status_code == 422
        body = r.json()
        assert body["accepted"] == ["valid"]
        assert [(x["index"], x["event_id"], x["field"]) for x in body["rejected"]] == [
            (0, "far", "events[0].ts"),
            (2, "hour", "events[2].ts"),
            (3, "cleared", "events[3].ts"),
        ]
        assert "KVP_MAX_CLOCK_SKEW_SECONDS" in body["rejected"][0]["message"]
        assert (
            c.post("/v1/events", json={"events": [routed("after", "s-after", now)]}).status_code
            == 200
        )
        for session in ("s-before", "s-valid", "s-after"):
            assert c.get(f"/v1/sessions/{session}").status_code == 200, session
        assert "gpu-9" not in [i["instance_id"] for i in c.get("/v1/instances").json()["instances"]]
        assert refused_total(c, "clock_skew") == 3
        assert refused_total(c, "past_retention") == 0
    # A restart replays the log (memory) or its tail (Redis): still every session.
    with TestClient(create_app(settings)) as c:
        for session in ("s-before", "s-valid", "s-after"):
            assert c.get(f"/v1/sessions/{session}").status_code == 200, session


def test_a_session_event_older_than_the_retention_is_answered_422(settings: Settings) -> None:
    now = time.time()
    with TestClient(create_app(settings)) as c:
        assert (
            c.post("/v1/events", json={"events": [routed("new", "s-new", now)]}).status_code == 200
        )
        r = c.post(
            "/v1/events",
            json={
                "events": [
                    {"bad": "shape", "event_id": "x"},
                    routed("old", "s-old", now - settings.session_retention_seconds - 1),
                ]
            },
        )
        assert r.status_code == 422
        body = r.json()
        assert body["accepted"] == []
        # Indexed in the posted batch, after the event that failed validation.
        assert [(x["index"], x["field"]) for x in body["rejected"]][-1] == (1, "events[1].ts")
        assert "older than the session retention" in body["rejected"][-1]["message"]
        assert c.get("/v1/sessions/s-old").status_code == 404
        assert refused_total(c, "past_retention") == 1


def test_an_order_progress_older_than_the_retention_is_answered_422(settings: Settings) -> None:
    # Order records expire with the sessions' retention (decisions 17): a report older than the
    # cutoff would be ignored, so it is refused like a session event.
    now = time.time()
    with TestClient(create_app(settings)) as c:
        assert (
            c.post("/v1/events", json={"events": [routed("new", "s-new", now)]}).status_code == 200
        )
        old = {
            "type": "order_progress",
            "event_id": "p-old",
            "ts": now - settings.session_retention_seconds - 1,
            "order_id": "o-old",
            "status": "accepted",
        }
        r = c.post("/v1/events", json={"events": [old]})
        assert r.status_code == 422, r.text
        assert [(x["index"], x["field"]) for x in r.json()["rejected"]] == [(0, "events[0].ts")]
        assert refused_total(c, "past_retention") == 1
