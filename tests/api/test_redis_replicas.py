"""Two service replicas sharing one Redis: what one accepts, the other sees and dedupes."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.config import Settings
from app.ingest.eventlog import iter_log
from tests.api.conftest import routed


def replica(tmp_path: Path, name: str, redis_url: str, prefix: str, **kw: object) -> TestClient:
    settings = Settings(
        data_dir=tmp_path / name,
        store="redis",
        redis_url=redis_url,
        redis_prefix=prefix,
        replica_id=name,
        log_fsync=False,
        **kw,  # type: ignore[arg-type]
    )
    return TestClient(create_app(settings))


def test_replicas_share_state_and_idempotency(
    tmp_path: Path, redis_url: str, clean_redis: str
) -> None:
    with (
        replica(tmp_path, "a", redis_url, clean_redis) as a,
        replica(tmp_path, "b", redis_url, clean_redis) as b,
    ):
        assert (
            a.post(
                "/v1/events", json={"events": [routed("e1", ts=1.0), routed("e2", ts=2.0)]}
            ).status_code
            == 200
        )
        view = b.get("/v1/sessions/s1").json()
        assert (view["turns"], view["recent_arrivals_ts"]) == (2, [1.0, 2.0])
        # A client retrying through the other replica: acknowledged, not applied twice.
        r = b.post("/v1/events", json={"events": [routed("e2", ts=2.0), routed("e3", ts=3.0)]})
        assert r.json() == {"accepted": ["e3"], "duplicates": ["e2"], "rejected": []}
        assert a.get("/v1/sessions/s1").json()["turns"] == 3
        assert b.get("/readyz").json()["store"] == "redis"
    assert [e.event_id for _, e in iter_log(tmp_path / "a" / "events")] == ["e1", "e2"]
    assert [e.event_id for _, e in iter_log(tmp_path / "b" / "events")] == ["e3"]


def test_a_restarted_replica_replays_only_its_log_tail(
    tmp_path: Path, redis_url: str, clean_redis: str
) -> None:
    with replica(tmp_path, "a", redis_url, clean_redis) as a:
        a.post("/v1/events", json={"events": [routed(f"e{i}", ts=float(i)) for i in range(5)]})
    # Restart: the Redis store already holds everything up to its checkpoint.
    with replica(tmp_path, "a", redis_url, clean_redis) as a:
        assert a.get("/v1/sessions/s1").json()["turns"] == 5
        assert a.app.state.engine.ingestor.recover() == 0


def test_a_service_whose_redis_is_unreachable_does_not_start(tmp_path: Path) -> None:
    import pytest

    from app.core.errors import StoreUnavailable

    settings = Settings(
        data_dir=tmp_path,
        store="redis",
        redis_url="redis://127.0.0.1:1/0",
        redis_timeout_seconds=0.2,
        log_fsync=False,
    )
    # Startup replays the log tail into the store: without it the service would serve a blind state.
    with pytest.raises(StoreUnavailable), TestClient(create_app(settings)):
        pass


def test_with_a_lease_one_replica_plans_and_hands_over_on_a_clean_stop(
    tmp_path: Path, redis_url: str, clean_redis: str
) -> None:
    lease = {"planning_lease_seconds": 30.0, "order_sink": "redis"}
    with replica(tmp_path, "b", redis_url, clean_redis, **lease) as b:
        with replica(tmp_path, "a", redis_url, clean_redis, **lease) as a:
            # b started first: it plans; a does not.
            assert b.get("/v1/scheduler").json()["planning"] is True
            assert a.get("/v1/scheduler").json()["planning"] is False
            assert "kvprefetch_planning_leader 0.0" in a.get("/metrics").text
        with replica(tmp_path, "c", redis_url, clean_redis, **lease) as c:
            assert c.get("/v1/scheduler").json()["planning"] is False
            # b stops cleanly and releases the lease: c takes it at its next step, not 30 s on.
            engine = b.app.state.engine
            assert asyncio.run_coroutine_threadsafe(engine.close(), engine._loop).result(10) is None
            engine = c.app.state.engine
            assert asyncio.run_coroutine_threadsafe(engine.lease.step(), engine._loop).result(10)
            assert c.get("/v1/scheduler").json()["planning"] is True
            assert "kvprefetch_planning_terms_total 1.0" in c.get("/metrics").text


def test_the_planning_side_counts_the_other_replicas_events_it_applied_from_the_feed(
    tmp_path: Path, redis_url: str, clean_redis: str
) -> None:
    import time

    lease = {"planning_lease_seconds": 30.0, "order_sink": "redis"}

    def applied(client: TestClient) -> tuple[float, float]:
        values = {}
        for line in client.get("/metrics").text.splitlines():
            name, _, value = line.partition(" ")
            values[name] = float(value) if name.startswith("kvprefetch_fleet_feed_") else 0.0
        return (
            values["kvprefetch_fleet_feed_applied_events_total"],
            values["kvprefetch_fleet_feed_applied_batches_total"],
        )

    with (
        replica(tmp_path, "a", redis_url, clean_redis, **lease) as a,
        replica(tmp_path, "b", redis_url, clean_redis, **lease) as b,
    ):
        time.sleep(0.5)  # b's reader starts from the feed's end as its first read finds it
        for n in range(3):
            events = [routed(f"e{n}-{i}", ts=float(n * 10 + i)) for i in range(n + 1)]
            assert a.post("/v1/events", json={"events": events}).status_code == 200
        deadline = time.monotonic() + 10
        while applied(b) != (6.0, 3.0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert applied(b) == (6.0, 3.0)  # 1 + 2 + 3 events in three batches
        assert applied(a) == (0.0, 0.0)  # its own batches are skipped, not applied twice
