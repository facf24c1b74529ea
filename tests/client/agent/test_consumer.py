"""The order sources: the pull endpoint (a scripted service) and the Redis Stream (the real
Redis)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import orjson
import pytest
import redis

from kvprefetch_client.agent.consumer import (
    GROUP,
    PullSource,
    StreamSource,
    cancel_key,
    parse,
    stream_key,
)
from kvprefetch_client.orders import Cancel, Order
from tests.client.agent.fakes import order


def test_parse_turns_a_bad_message_into_a_delivery_without_one() -> None:
    assert isinstance(parse("1-0", order("o1", [1]).to_json()).message, Order)
    assert isinstance(parse("1-0", b'{"type": "cancel", "order_id": "o1"}').message, Cancel)
    for raw in (b"{", b'{"type": "order"}', b'{"type": "launch"}', None):
        d = parse("1-0", raw)
        assert d.message is None and d.error


# -- pull --------------------------------------------------------------------------------------


def test_pull_reads_orders_and_cancels_for_its_instance() -> None:
    seen: list[httpx.Request] = []

    def service(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(
            200,
            json={
                "orders": [
                    orjson.loads(order("o1", [1, 2]).to_json()),
                    {"type": "order", "order_id": "bad"},
                ],
                "cancelled": ["o0"],
            },
        )

    source = PullSource(
        "http://kvp",
        "gpu-3",
        limit=7,
        transport=httpx.MockTransport(service),
        sleep=lambda s: pytest.fail("slept though orders came"),
        agent="a-1",
    )
    got = source.poll(1.0)
    assert seen[0].url.path == "/v1/orders"
    assert dict(seen[0].url.params) == {"instance_id": "gpu-3", "limit": "7", "agent": "a-1"}
    assert source.held() == ["o1"]  # held until acked: its lease is renewed meanwhile
    source.ack(got[:1])
    assert source.held() == []
    source.close()
    assert [type(d.message).__name__ for d in got] == ["Order", "NoneType", "Cancel"]
    assert got[0].message.block_hashes == [1, 2] and got[2].message.order_id == "o0"
    assert got[1].error


def test_pull_sends_its_token_and_none_without_one() -> None:
    seen: list[httpx.Request] = []

    def service(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"orders": [], "cancelled": []})

    for token in ("agent-token-0123456789", None):
        source = PullSource(
            "http://kvp", "gpu-3", transport=httpx.MockTransport(service), token=token
        )
        source.poll(0)
        source.close()
    assert seen[0].headers["authorization"] == "Bearer agent-token-0123456789"
    assert "authorization" not in seen[1].headers


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(503, json={"detail": "store down"}),
        httpx.Response(200, content=b"<html>"),
        httpx.Response(200, json={"orders": {}}),
        httpx.Response(404, json={"detail": "Not Found"}),  # a service without the endpoint
    ],
)
def test_pull_survives_a_bad_answer_and_waits(answer: httpx.Response) -> None:
    slept: list[float] = []
    source = PullSource(
        "http://kvp", "gpu-0", transport=httpx.MockTransport(lambda r: answer), sleep=slept.append
    )
    assert source.poll(0.25) == [] and slept == [0.25]


def test_pull_survives_an_unreachable_service() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    slept: list[float] = []
    source = PullSource(
        "http://kvp", "gpu-0", transport=httpx.MockTransport(refuse), sleep=slept.append
    )
    assert source.poll(0.1) == [] and source.poll(0.1) == [] and slept == [0.1, 0.1]


def test_pull_refuses_to_serve_another_instance() -> None:
    source = PullSource(
        "http://kvp", "gpu-0", transport=httpx.MockTransport(lambda r: pytest.fail())
    )
    source.bind("gpu-0")
    with pytest.raises(ValueError, match="gpu-1"):
        source.bind("gpu-1")
    source.close()


# -- stream ------------------------------------------------------------------------------------


@pytest.fixture
def r(redis_url: str, clean_redis: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


INSTANCE = "gpu-0"


def make(
    redis_url: str, prefix: str, name: str, idle: float = 0.3, instance_id: str | None = INSTANCE
) -> StreamSource:
    return StreamSource.from_url(
        redis_url, prefix=prefix, consumer=name, instance_id=instance_id, claim_idle_seconds=idle
    )


@pytest.mark.redis
def test_stream_delivers_once_per_group_and_forgets_what_is_acked(
    r: redis.Redis, redis_url: str, clean_redis: str
) -> None:
    a, b = make(redis_url, clean_redis, "a", idle=30), make(redis_url, clean_redis, "b", idle=30)
    try:
        make(redis_url, clean_redis, "c", idle=30).close()  # the group exists already: fine
        key = stream_key(clean_redis, INSTANCE)
        r.xadd(key, {"msg": order("o1", [1]).to_json()})
        r.xadd(key, {"msg": b"garbage"})
        got = a.poll(0.2) + a.poll(0.05)
        assert [d.message.order_id if d.message else None for d in got] == ["o1", None]
        assert b.poll(0.05) == []
        a.ack(got)
        assert r.xpending(key, GROUP)["pending"] == 0 and a.held() == []
    finally:
        a.close()
        b.close()


@pytest.mark.redis
def test_stream_reads_only_its_instances_stream(
    r: redis.Redis, redis_url: str, clean_redis: str
) -> None:
    assert stream_key("p", "gpu-1") == "p:orders:gpu-1"
    gpu0 = make(redis_url, clean_redis, "a", idle=0.1)
    gpu1 = make(redis_url, clean_redis, "b", idle=0.1, instance_id="gpu-1")
    try:
        r.xadd(
            stream_key(clean_redis, "gpu-1"),
            {"msg": order("o1", [1], instance_id="gpu-1").to_json()},
        )
        (got,) = gpu1.poll(0.2)
        time.sleep(0.2)  # idle past the claim time, in gpu-1's stream: gpu-0's agent cannot take it
        assert gpu0.poll(0.05) == [] and gpu0.poll(0.05) == []
        assert r.xpending(stream_key(clean_redis, "gpu-0"), GROUP)["pending"] == 0
        assert got.message.order_id == "o1" and gpu1.held() == [got.token]
    finally:
        gpu0.close()
        gpu1.close()


@pytest.mark.redis
def test_an_unbound_stream_source_reads_the_instance_it_is_bound_to(
    r: redis.Redis, redis_url: str, clean_redis: str
) -> None:
    source = make(redis_url, clean_redis, "a", idle=30, instance_id=None)
    try:
        with pytest.raises(RuntimeError, match="not bound"):
            source.poll(0)
        source.bind("gpu-3")
        source.bind("gpu-3")  # again, the same: fine
        with pytest.raises(ValueError, match="gpu-4"):
            source.bind("gpu-4")
        r.xadd(
            stream_key(clean_redis, "gpu-3"),
            {"msg": order("o1", [1], instance_id="gpu-3").to_json()},
        )
        assert [d.message.order_id for d in source.poll(0.2)] == ["o1"]
    finally:
        source.close()


@pytest.mark.redis
def test_stream_hands_a_dead_agents_entries_to_another_but_not_a_live_ones(
    r: redis.Redis, redis_url: str, clean_redis: str
) -> None:
    key = stream_key(clean_redis, INSTANCE)
    live, dead, other = (make(redis_url, clean_redis, n) for n in ("live", "dead", "other"))
    try:
        r.xadd(key, {"msg": order("held", [1]).to_json()})
        assert [d.message.order_id for d in live.poll(0.2)] == ["held"]
        r.xadd(key, {"msg": order("orphan", [2]).to_json()})
        assert [d.message.order_id for d in dead.poll(0.2)] == ["orphan"]
        dead.close()  # its heartbeat stops, as a killed process's would
        time.sleep(0.8)  # > 2 x claim idle: live's heartbeat ran, dead's did not
        claimed = []
        deadline = time.monotonic() + 3
        while not claimed and time.monotonic() < deadline:
            claimed = other.poll(0.05)
        assert [d.message.order_id for d in claimed] == ["orphan"]
        owners = {
            p["message_id"].decode(): p["consumer"].decode()
            for p in r.xpending_range(key, GROUP, "-", "+", 10)
        }
        assert sorted(owners.values()) == ["live", "other"]
    finally:
        live.close()
        other.close()


@pytest.mark.redis
def test_stream_sees_cancel_keys(r: redis.Redis, redis_url: str, clean_redis: str) -> None:
    source = make(redis_url, clean_redis, "a", idle=30)
    try:
        assert not source.is_cancelled("o1")
        r.set(cancel_key(clean_redis, "o1"), "1")
        assert source.is_cancelled("o1")
    finally:
        source.close()


@pytest.mark.redis
def test_stream_reads_what_the_services_sink_writes(redis_url: str, clean_redis: str) -> None:
    """The format is the producer's (app/deliver/redis_stream.py): same key, group, field
    and cancel keys, checked against the real producer where it is present."""
    sink_module = pytest.importorskip("app.deliver.redis_stream")
    import asyncio

    assert sink_module.GROUP == GROUP
    assert sink_module.stream_key("p", "gpu-0") == stream_key("p", "gpu-0")
    assert sink_module.cancel_key("p", "o") == cancel_key("p", "o")

    async def produce() -> None:
        sink = sink_module.RedisStreamSink.from_url(redis_url, clean_redis)
        try:
            await sink.submit(
                [order("o1", [1, "ab"]), order("o2", [2]), order("o3", [3], instance_id="gpu-1")]
            )
            await sink.cancel([Cancel(order_id="o2"), Cancel(order_id="o3")])
        finally:
            await sink.close()

    asyncio.run(produce())
    source = make(redis_url, clean_redis, "a", idle=30)
    try:
        got = source.poll(0.2)
        assert [(type(d.message).__name__, d.message.order_id) for d in got] == [
            ("Order", "o1"),
            ("Order", "o2"),
            ("Cancel", "o2"),
        ]
        assert got[0].message.block_hashes == [1, "ab"]
        assert source.is_cancelled("o2") and not source.is_cancelled("o1")
        assert source.poll(0.05) == []  # o3 and its cancel went to gpu-1's stream
    finally:
        source.close()
