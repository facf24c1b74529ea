"""The fleet's rate limits on the real Redis: one bucket per client whichever replica charges it;
a Redis that does not answer lets requests through."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.config import Settings
from app.core.errors import ConfigError
from app.core.fleet_ratelimit import FleetRateLimiter
from tests.api.conftest import routed


def test_two_replicas_spend_one_bucket(redis_url: str, clean_redis: str) -> None:
    async def body() -> None:
        a = FleetRateLimiter.from_url(redis_url, clean_redis, "events", 1.0, 5.0, timeout_seconds=1)
        b = FleetRateLimiter.from_url(redis_url, clean_redis, "events", 1.0, 5.0, timeout_seconds=1)
        try:
            assert [await x.spend("c") for x in (a, b, a, b, a)] == [0.0] * 5
            wait = await b.spend("c")
            assert 0 < wait <= 1.0
            assert await a.spend("other") == 0.0  # another client's own bucket
            # A cost over the whole bucket waits for a full one, then overdraws.
            assert await a.spend("big", 50) == 0.0
            assert await b.spend("big") > 0
        finally:
            await a.close()
            await b.close()

    asyncio.run(body())


def test_a_redis_away_lets_requests_through() -> None:
    async def body() -> None:
        lim = FleetRateLimiter.from_url(
            "redis://127.0.0.1:1/0", "p", "events", 1.0, 1.0, timeout_seconds=0.2
        )
        try:
            assert [await lim.spend("c") for _ in range(3)] == [0.0] * 3
        finally:
            await lim.close()

    asyncio.run(body())


def settings(tmp_path: Path, name: str, redis_url: str, prefix: str, **kw: object) -> Settings:
    return Settings(
        data_dir=tmp_path / name,
        store="redis",
        redis_url=redis_url,
        redis_prefix=prefix,
        replica_id=name,
        log_fsync=False,
        rate_limit_events_per_second=2.0,
        rate_limit_burst_seconds=2.0,
        **kw,  # type: ignore[arg-type]
    )


def test_a_client_spreading_its_posts_over_replicas_gets_its_rate_once(
    tmp_path: Path, redis_url: str, clean_redis: str
) -> None:
    fleet = {"rate_limit_scope": "fleet"}
    with (
        TestClient(create_app(settings(tmp_path, "a", redis_url, clean_redis, **fleet))) as a,
        TestClient(create_app(settings(tmp_path, "b", redis_url, clean_redis, **fleet))) as b,
    ):
        post = {"json": {"events": [routed("e1", ts=1.0), routed("e2", ts=2.0)]}}
        assert a.post("/v1/events", **post).status_code == 200
        post = {"json": {"events": [routed("e3", ts=3.0), routed("e4", ts=4.0)]}}
        assert b.post("/v1/events", **post).status_code == 200
        refused = b.post("/v1/events", json={"events": [routed("e5", ts=5.0)]})
        assert refused.status_code == 429 and "retry-after" in refused.headers


def test_the_fleet_scope_needs_the_redis_store(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path, rate_limit_scope="fleet"))
    with pytest.raises(ConfigError, match="KVP_STORE=redis"), TestClient(app):
        pass
