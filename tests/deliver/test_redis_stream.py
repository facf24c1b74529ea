"""The Redis stream sink on the real server: the format agents read (one stream per instance),
cancels seen across consumers and routed to their order's stream, the length bound. What is
written is read back by the agents' own consumer, `kvprefetch_client.agent.StreamSource`; its
claims, acks and skips are tested with the agent (tests/client/agent/)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis

from app.deliver import (
    GROUP,
    RedisStreamSink,
    SinkError,
    SinkUnavailable,
    stream_key,
)
from kvprefetch_client.agent import StreamSource
from kvprefetch_client.orders import Cancel, Order
from tests.deliver.conftest import order

IDLE_SECONDS = 0.1


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def prefix(clean_redis: str) -> str:
    return clean_redis


def submit(
    url: str,
    prefix: str,
    orders: list[Order] = (),
    cancels: list[Cancel] = (),  # type: ignore[assignment]
    **kw: object,
) -> tuple[list[str], list[str]]:
    async def body() -> tuple[list[str], list[str]]:
        sink = RedisStreamSink.from_url(url, prefix, **kw)  # type: ignore[arg-type]
        try:
            return await sink.submit(orders), await sink.cancel(cancels)
        finally:
            await sink.close()

    return asyncio.run(body())


def consumer(url: str, prefix: str, name: str, instance_id: str = "gpu-0") -> StreamSource:
    return StreamSource.from_url(
        url, prefix=prefix, consumer=name, instance_id=instance_id, claim_idle_seconds=IDLE_SECONDS
    )


def messages(source: StreamSource) -> list[Order | Cancel | None]:
    """What one poll hands out (it waits for nothing)."""
    return [d.message for d in source.poll(0)]


def pending(r: redis.Redis, prefix: str, instance_id: str) -> int:
    return int(r.xpending(stream_key(prefix, instance_id), GROUP)["pending"])


def keys(r: redis.Redis, prefix: str) -> set[str]:
    return {k.decode()[len(prefix) + 1 :] for k in r.scan_iter(match=f"{prefix}:*")}


def test_the_stream_format_agents_read(redis_url: str, prefix: str, r: redis.Redis) -> None:
    submit(redis_url, prefix, [order("a")], [Cancel(order_id="a", reason="closed")])
    assert stream_key(prefix, "gpu-0") == f"{prefix}:orders:gpu-0"
    entries = r.xrange(f"{prefix}:orders:gpu-0")
    assert [fields for _, fields in entries] == [
        {b"msg": order("a").to_json()},
        {b"msg": Cancel(order_id="a", reason="closed").to_json()},
    ]
    (group,) = r.xinfo_groups(f"{prefix}:orders:gpu-0")
    assert group["name"] == GROUP.encode() == b"kvp-agents" and group["last-delivered-id"] == b"0-0"
    assert r.get(f"{prefix}:order-ids:a") == b"gpu-0" and r.get(f"{prefix}:cancel-ids:a") == b"1"
    assert (
        0 < r.ttl(f"{prefix}:order-ids:a") <= 3600 and 0 < r.ttl(f"{prefix}:cancel-ids:a") <= 3600
    )
    assert keys(r, prefix) == {"orders:gpu-0", "order-ids:a", "cancel-ids:a"}


def test_orders_for_two_instances_land_in_two_streams(
    redis_url: str, prefix: str, r: redis.Redis
) -> None:
    odd = "node:7/gpu 1{x}é"  # any Ident is a key as it is
    sent = [order("a", "gpu-0"), order("b", "gpu-1"), order("c", "gpu-0"), order("d", odd)]
    assert submit(redis_url, prefix, sent) == (["a", "b", "c", "d"], [])
    for instance, expected in (("gpu-0", ["a", "c"]), ("gpu-1", ["b"]), (odd, ["d"])):
        key = stream_key(prefix, instance)
        c = consumer(redis_url, prefix, "x", instance)
        assert [m.order_id for m in messages(c)] == expected
        c.close()
        assert [g["name"] for g in r.xinfo_groups(key)] == [b"kvp-agents"]
        assert [r.get(f"{prefix}:order-ids:{o}").decode() for o in expected] == [instance] * len(
            expected
        )


def test_a_consumer_of_one_instance_never_sees_anothers_orders(
    redis_url: str, prefix: str, r: redis.Redis
) -> None:
    gpu0, gpu1 = (
        consumer(redis_url, prefix, "a", "gpu-0"),
        consumer(redis_url, prefix, "b", "gpu-1"),
    )
    submit(redis_url, prefix, [order("x", "gpu-1"), order("y", "gpu-1")])
    assert messages(gpu0) == []
    assert [m.order_id for m in messages(gpu1)] == ["x", "y"]
    time.sleep(IDLE_SECONDS * 1.5)  # idle long enough to claim: only within gpu-1's stream
    assert messages(gpu0) == [] and pending(r, prefix, "gpu-0") == 0
    assert pending(r, prefix, "gpu-1") == 2
    gpu0.close()
    gpu1.close()


def test_a_cancel_goes_to_the_stream_of_its_orders_instance(
    redis_url: str, prefix: str, r: redis.Redis
) -> None:
    submit(redis_url, prefix, [order("a", "gpu-0"), order("b", "gpu-1")])
    assert submit(redis_url, prefix, [], [Cancel(order_id="b", reason="moved")]) == ([], ["b"])
    assert r.xlen(f"{prefix}:orders:gpu-0") == 1
    assert [f[b"msg"] for _, f in r.xrange(f"{prefix}:orders:gpu-1")] == [
        order("b", "gpu-1").to_json(),
        Cancel(order_id="b", reason="moved").to_json(),
    ]
    # The order's stream gone (trimmed away, deleted): the cancel makes it again, with its group.
    r.delete(f"{prefix}:orders:gpu-0")
    assert submit(redis_url, prefix, [], [Cancel(order_id="a")]) == ([], ["a"])
    c = consumer(redis_url, prefix, "x", "gpu-0")
    assert messages(c) == [Cancel(order_id="a")]
    c.close()


def test_a_cancel_of_an_unknown_order_sets_only_the_cancel_key(
    redis_url: str, prefix: str, r: redis.Redis
) -> None:
    assert submit(redis_url, prefix, [], [Cancel(order_id="never-seen")]) == ([], ["never-seen"])
    assert keys(r, prefix) == {"cancel-ids:never-seen"}
    assert submit(redis_url, prefix, [], [Cancel(order_id="never-seen")]) == ([], [])
    # Should the order come after all, the agent that reads it finds it cancelled.
    assert submit(redis_url, prefix, [order("never-seen")]) == (["never-seen"], [])
    c = consumer(redis_url, prefix, "x")
    assert messages(c) == [order("never-seen")] and c.is_cancelled("never-seen")
    c.close()


def test_a_key_that_is_not_a_stream_fails_the_submit_and_marks_nothing(
    redis_url: str, prefix: str, r: redis.Redis
) -> None:
    r.set(f"{prefix}:orders:gpu-9", "not a stream")
    with pytest.raises(SinkError, match="WRONGTYPE"):
        submit(redis_url, prefix, [order("a", "gpu-9")])
    assert r.get(f"{prefix}:order-ids:a") is None


def test_a_group_a_consumer_made_first_is_the_one_the_sink_adds_to(
    redis_url: str, prefix: str
) -> None:
    c = consumer(redis_url, prefix, "early")
    assert messages(c) == []
    submit(redis_url, prefix, [order("a")])
    assert messages(c) == [order("a")]
    c.close()


def test_resubmits_from_another_replica_or_after_a_restart_add_nothing(
    redis_url: str, prefix: str, r: redis.Redis
) -> None:
    assert submit(redis_url, prefix, [order("a"), order("b")]) == (["a", "b"], [])
    assert submit(redis_url, prefix, [order("b"), order("c")], [Cancel(order_id="a")]) == (
        ["c"],
        ["a"],
    )
    assert submit(redis_url, prefix, [], [Cancel(order_id="a")]) == ([], [])
    assert r.xlen(f"{prefix}:orders:gpu-0") == 4


def test_a_cancel_is_seen_by_every_consumer_of_the_instance(
    redis_url: str, prefix: str, r: redis.Redis
) -> None:
    one, two = consumer(redis_url, prefix, "one"), consumer(redis_url, prefix, "two")
    submit(redis_url, prefix, [order("a")])
    assert messages(one) == [order("a")]
    assert not one.is_cancelled("a")
    submit(redis_url, prefix, [order("b")], [Cancel(order_id="a"), Cancel(order_id="b")])
    assert [f"{type(m).__name__}:{m.order_id}" for m in messages(two)] == [
        "Order:b",
        "Cancel:a",
        "Cancel:b",
    ]
    assert one.is_cancelled("a")  # "one" checks before starting what it holds
    assert two.is_cancelled("b")
    assert pending(r, prefix, "gpu-0") == 4  # "a" with one; "b" and the two cancels with two
    one.close()
    two.close()


def test_each_stream_is_bounded_by_maxlen(redis_url: str, prefix: str, r: redis.Redis) -> None:
    maxlen, total = 200, 2000
    node_entries = int(r.config_get("stream-node-max-entries")["stream-node-max-entries"])
    submit(redis_url, prefix, [order(f"o{i}", f"gpu-{i % 2}") for i in range(total)], maxlen=maxlen)
    for instance in ("gpu-0", "gpu-1"):
        length = r.xlen(f"{prefix}:orders:{instance}")
        # MAXLEN ~ trims whole nodes: never below the bound, at most a node over it.
        assert maxlen <= length <= maxlen + node_entries
    newest = r.xrevrange(f"{prefix}:orders:gpu-1", count=1)[0][1][b"msg"]
    assert newest == order(f"o{total - 1}", "gpu-1").to_json()


def test_redis_away_is_sink_unavailable() -> None:
    async def body() -> None:
        sink = RedisStreamSink.from_url(
            "redis://127.0.0.1:1/0", "kvptest-away", timeout_seconds=0.5
        )
        with pytest.raises(SinkUnavailable, match=r"Redis at 127\.0\.0\.1:1/0 did not answer"):
            await sink.submit([order("a")])
        await sink.close()

    asyncio.run(body())
