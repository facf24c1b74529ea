"""The planning lease on the real Redis: one holder at a time, renewed by it, taken over once it
runs out with a new token, the hand-over state and the stream sink fenced by it; the fleet's
feed of accepted events; what a lease needs of the settings."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from app.core.config import Settings
from app.core.errors import ConfigError
from app.decide.fleet_feed import FleetFeed
from app.decide.lease import PlanningLease, lease_key
from app.deliver import Fence, RedisStreamSink, SinkError
from app.engine import Engine
from kvprefetch_client.events import SessionClosed
from tests.deliver.conftest import order

# Long beside any pause of a busy machine: the tests run a lease out by its clock or its key,
# never by sleeping past it.
LEASE_SECONDS = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def lease(url: str, prefix: str, replica: str, clock: Clock | None = None) -> PlanningLease:
    made = PlanningLease.from_url(url, prefix, replica, LEASE_SECONDS, timeout_seconds=1.0)
    if clock is not None:
        made._now = clock
    return made


def test_one_holder_renews_and_another_takes_over_once_it_runs_out(
    redis_url: str, clean_redis: str, r: redis.Redis
) -> None:
    async def body() -> None:
        a, b = lease(redis_url, clean_redis, "a"), lease(redis_url, clean_redis, "b")
        gained: list[tuple[str, int, dict[str, str]]] = []

        def on_gain(name: str):
            async def gain(token: int, state: dict[str, str]) -> None:
                gained.append((name, token, state))

            return gain

        a.on_gain, b.on_gain = on_gain("a"), on_gain("b")
        try:
            assert await a.step() and a.held and a.token == 1
            assert not await b.step() and not b.held
            assert await a.write_state({"o:x": "1{}", "p:s": "[]"})
            assert await a.write_state({"o:x": "1{}"})  # p:s deleted
            r.pexpire(lease_key(clean_redis), 1000)
            assert await a.step()  # renewed: still a's, for a whole lease again
            assert r.pttl(lease_key(clean_redis)) > LEASE_SECONDS * 1000 / 2
            assert not await b.step()
            # a stops renewing (as a killed process would): b takes over once it runs out.
            r.pexpire(lease_key(clean_redis), 1)
            while r.exists(lease_key(clean_redis)):
                await asyncio.sleep(0.005)
            assert await b.step() and b.token == 2
            assert gained == [("a", 1, {}), ("b", 2, {"o:x": "1{}"})]
            assert r.get(lease_key(clean_redis)) == b"b|2"
            # a, back, finds it lost: it neither holds it nor writes the hand-over state.
            assert not await a.step() and not a.held
            assert not await a.write_state({"o:y": "0{}"})
            assert r.hgetall(f"{clean_redis}:planner-state") == {b"o:x": b"1{}"}
            # A clean stop releases it at once.
            await b.close()
            assert r.get(lease_key(clean_redis)) is None
            assert await a.step() and a.token == 3
        finally:
            await a.close()
            await b.close()

    asyncio.run(body())


def test_a_holder_stops_counting_itself_the_holder_before_redis_lets_it_go(
    redis_url: str, clean_redis: str
) -> None:
    async def body() -> None:
        clock = Clock()
        a = lease(redis_url, clean_redis, "a", clock)
        try:
            assert await a.step()
            clock.now = LEASE_SECONDS * 0.85
            assert a.held
            clock.now = LEASE_SECONDS * 0.95  # past the drift margin, not yet the lease
            assert not a.held
        finally:
            await a.close()

    asyncio.run(body())


def test_a_holder_paused_past_its_lease_steps_down_once_on_resuming(
    redis_url: str, clean_redis: str, r: redis.Redis
) -> None:
    async def body() -> None:
        clock_a, clock_b = Clock(), Clock()
        a = lease(redis_url, clean_redis, "a", clock_a)
        b = lease(redis_url, clean_redis, "b", clock_b)
        calls: list[tuple[str, object]] = []

        def on_gain(name: str):
            async def gain(token: int, state: dict[str, str]) -> None:
                calls.append((f"gain {name}", state))

            return gain

        def on_loss(name: str):
            async def loss() -> None:
                calls.append((f"loss {name}", None))

            return loss

        a.on_gain, a.on_loss = on_gain("a"), on_loss("a")
        b.on_gain, b.on_loss = on_gain("b"), on_loss("b")
        try:
            assert await a.step()
            assert await a.write_state({"o:x": "1{}"})
            # a pauses (SIGSTOP) past its lease: its key runs out in Redis and b takes over.
            clock_a.now = LEASE_SECONDS * 5
            r.delete(lease_key(clean_redis))
            assert await b.step()
            # a resumes: it finds its lease lapsed and steps down at once, once.
            assert not a.held
            assert not await a.step()
            assert not await a.step()
            assert not a.leading
            assert calls == [
                ("gain a", {}),
                ("gain b", {"o:x": "1{}"}),  # a's open order handed over, once
                ("loss a", None),
            ]
            assert r.get(lease_key(clean_redis)) == b"b|2"  # b's lease untouched by a
        finally:
            await a.close()
            await b.close()

    asyncio.run(body())


def test_a_holder_cut_off_past_its_lease_steps_down_once_and_may_begin_a_new_term(
    redis_url: str, clean_redis: str, r: redis.Redis
) -> None:
    async def body() -> None:
        clock = Clock()
        a = lease(redis_url, clean_redis, "a", clock)
        losses: list[int] = []

        async def gain(token: int, state: dict[str, str]) -> None:
            pass

        async def loss() -> None:
            losses.append(a.token)

        a.on_gain, a.on_loss = gain, loss
        try:
            assert await a.step() and a.token == 1
            # Nobody took it while a was away (its key ran out): a steps down, then takes a
            # new term, whose loss is a loss of its own.
            clock.now = LEASE_SECONDS * 5
            r.delete(lease_key(clean_redis))
            assert await a.step() and a.token == 2 and a.leading
            assert losses == [1]
            clock.now = LEASE_SECONDS * 10
            r.set(lease_key(clean_redis), "b|3")
            assert not await a.step()
            assert losses == [1, 2]
        finally:
            await a.close()

    asyncio.run(body())


def test_the_stream_sink_adds_nothing_for_a_replica_that_does_not_hold_the_lease(
    redis_url: str, clean_redis: str, r: redis.Redis
) -> None:
    async def body() -> None:
        a, b = lease(redis_url, clean_redis, "a"), lease(redis_url, clean_redis, "b")
        sink = RedisStreamSink.from_url(redis_url, f"{clean_redis}:sink")
        try:
            assert await a.step()
            sink.fence = Fence(a.key, lambda: a.value if a.held else None)
            assert await sink.submit([order("one")]) == ["one"]
            r.delete(lease_key(clean_redis))  # ran out (a paused past it) and b took it
            assert await b.step()
            with pytest.raises(SinkError, match="FENCED"):
                await sink.submit([order("two")])
            assert r.xlen(f"{clean_redis}:sink:orders:gpu-0") == 1
            assert r.get(f"{clean_redis}:sink:order-ids:two") is None  # not marked either
        finally:
            await sink.close()
            await a.close()
            await b.close()

    asyncio.run(body())


def test_each_replica_reads_the_others_accepted_events_from_the_feed(
    redis_url: str, clean_redis: str
) -> None:
    async def body() -> None:
        a = FleetFeed(redis_url, clean_redis, "a", timeout_seconds=1.0)
        b = FleetFeed(redis_url, clean_redis, "b", timeout_seconds=1.0)
        try:
            a.publish([closed("before")])  # before b's first read: not b's to see
            assert await b.read() == []
            a.publish([closed("e1"), closed("e2")])
            b.publish([closed("e3")])
            assert [e.event_id for e in await b.read()] == ["e1", "e2"]
            assert [e.event_id for e in await a.read()] == []  # a started after its own
        finally:
            await a.close()
            await b.close()

    asyncio.run(body())


def closed(event_id: str) -> SessionClosed:
    return SessionClosed(event_id=event_id, ts=1.0, session_id="s")


@pytest.mark.parametrize(
    ("store", "sink", "needs"),
    [("memory", "redis", "KVP_STORE=redis"), ("redis", "pull", "pull sink's queues")],
)
def test_a_lease_needs_the_redis_store_and_a_sink_every_replica_reaches(
    tmp_path: Path, redis_url: str, clean_redis: str, store: str, sink: str, needs: str
) -> None:
    settings = Settings(
        data_dir=tmp_path,
        store=store,  # type: ignore[arg-type]
        redis_url=redis_url,
        redis_prefix=clean_redis,
        order_sink=sink,  # type: ignore[arg-type]
        planning_lease_seconds=1.0,
    )
    with pytest.raises(ConfigError, match=needs):
        Engine(settings)


@pytest.mark.parametrize("sink", ["redis", "webhook", "lmcache"])
def test_every_sink_that_sends_outside_is_fenced_by_the_lease(
    tmp_path: Path, redis_url: str, clean_redis: str, sink: str
) -> None:
    async def body() -> None:
        settings = Settings(
            data_dir=tmp_path,
            store="redis",
            redis_url=redis_url,
            redis_prefix=clean_redis,
            order_sink=sink,  # type: ignore[arg-type]
            order_webhook_url="http://127.0.0.1:9/orders",
            lmcache_model_name="m",
            planning_lease_seconds=1.0,
            log_fsync=False,
        )
        engine = Engine(settings)
        try:
            fence = engine.order_sink.fence  # type: ignore[attr-defined]
            assert isinstance(fence, Fence) and fence.key == lease_key(clean_redis)
            assert fence.value() is None  # not taken yet: nothing may go out
            assert engine.lease is not None and await engine.lease.step()
            assert fence.value() == engine.lease.value
        finally:
            await engine.close()

    asyncio.run(body())
