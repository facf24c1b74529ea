"""The Redis stream sink and its consumers, on the real server: the format agents read, claims
from a consumer that died, cancels seen across consumers, the length bound."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis

from app.engine.orders import Cancel, Order
from app.engine.sinks import GROUP, RedisStreamConsumer, RedisStreamSink, SinkUnavailable
from tests.engine.sinks.conftest import order

IDLE_SECONDS = 0.1


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def prefix(clean_redis: str) -> str:
    return clean_redis


def submit(url: str, prefix: str, orders: list[Order] = (), cancels: list[Cancel] = (),  # type: ignore[assignment]
           **kw: object) -> tuple[list[str], list[str]]:
    async def body() -> tuple[list[str], list[str]]:
        sink = RedisStreamSink.from_url(url, prefix, **kw)  # type: ignore[arg-type]
        try:
            return await sink.submit(orders), await sink.cancel(cancels)
        finally:
            await sink.close()

    return asyncio.run(body())


def consumer(url: str, prefix: str, name: str) -> RedisStreamConsumer:
    return RedisStreamConsumer.from_url(url, prefix, name, claim_idle_seconds=IDLE_SECONDS)


def test_the_stream_format_agents_read(redis_url: str, prefix: str, r: redis.Redis) -> None:
    submit(redis_url, prefix, [order("a")], [Cancel(order_id="a", reason="closed")])
    entries = r.xrange(f"{prefix}:orders")
    assert [fields for _, fields in entries] == [{b"msg": order("a").to_json()},
                                                 {b"msg": Cancel(order_id="a", reason="closed").to_json()}]
    (group,) = r.xinfo_groups(f"{prefix}:orders")
    assert group["name"] == GROUP.encode() == b"kvp-agents" and group["last-delivered-id"] == b"0-0"
    assert 0 < r.ttl(f"{prefix}:order-ids:a") <= 3600 and 0 < r.ttl(f"{prefix}:cancel-ids:a") <= 3600


def test_a_group_a_consumer_made_first_is_the_one_the_sink_adds_to(redis_url: str, prefix: str) -> None:
    c = consumer(redis_url, prefix, "early")
    assert c.poll(10) == []
    submit(redis_url, prefix, [order("a")])
    assert [e.message for e in c.poll(10)] == [order("a")]
    c.close()


def test_resubmits_from_another_replica_or_after_a_restart_add_nothing(redis_url: str, prefix: str,
                                                                      r: redis.Redis) -> None:
    assert submit(redis_url, prefix, [order("a"), order("b")]) == (["a", "b"], [])
    assert submit(redis_url, prefix, [order("b"), order("c")], [Cancel(order_id="a")]) == (["c"], ["a"])
    assert submit(redis_url, prefix, [], [Cancel(order_id="a")]) == ([], [])
    assert r.xlen(f"{prefix}:orders") == 4


def test_an_entry_a_dead_consumer_held_is_claimed_after_the_idle_time_and_acked_once(
        redis_url: str, prefix: str) -> None:
    submit(redis_url, prefix, [order("a"), order("b")])
    dead, alive = consumer(redis_url, prefix, "dead"), consumer(redis_url, prefix, "alive")
    taken = dead.poll(1)
    assert [e.message.order_id for e in taken] == ["a"]
    (b,) = alive.poll(10)  # "a" is not idle long enough to claim yet
    assert (b.message.order_id, b.claimed) == ("b", False)
    assert alive.ack(b.entry_id)
    time.sleep(IDLE_SECONDS * 1.5)
    (claimed,) = alive.poll(10)
    assert (claimed.entry_id, claimed.message, claimed.claimed) == (taken[0].entry_id, order("a"), True)
    assert alive.ack(claimed.entry_id) is True
    assert dead.ack(claimed.entry_id) is False  # it comes back to life late: the order is done already
    assert alive.pending() == 0
    assert alive.poll(10) == []
    assert alive.stats["claimed"] == 1 and alive.stats["acked"] == 2
    dead.close()
    alive.close()


def test_a_slow_consumer_is_not_handed_its_own_entry_twice(redis_url: str, prefix: str) -> None:
    submit(redis_url, prefix, [order("a")])
    c = consumer(redis_url, prefix, "slow")
    (entry,) = c.poll(10)
    time.sleep(IDLE_SECONDS * 1.5)
    assert c.poll(10) == []
    assert c.ack(entry.entry_id) and c.pending() == 0
    c.close()


def test_a_cancelled_order_is_skipped_whoever_read_the_cancel(redis_url: str, prefix: str) -> None:
    one, two = consumer(redis_url, prefix, "one"), consumer(redis_url, prefix, "two")
    submit(redis_url, prefix, [order("a")])
    (held,) = one.poll(10)
    assert not one.is_cancelled("a")
    submit(redis_url, prefix, [order("b")], [Cancel(order_id="a"), Cancel(order_id="b")])
    assert [type(e.message).__name__ + ":" + e.message.order_id for e in two.poll(10)] == ["Cancel:a", "Cancel:b"]
    assert one.is_cancelled("a")  # "one" checks before starting what it holds
    assert two.stats["skipped_cancelled"] == 1  # "b": acked and never handed out
    assert two.pending() == 3  # "a" with one, the two cancels with two
    one.close()
    two.close()


def test_a_malformed_entry_is_acked_and_skipped(redis_url: str, prefix: str, r: redis.Redis) -> None:
    c = consumer(redis_url, prefix, "c")
    c.poll(1)
    r.xadd(f"{prefix}:orders", {"msg": b"{not json"})
    r.xadd(f"{prefix}:orders", {"other": b"1"})
    submit(redis_url, prefix, [order("a")])
    assert [e.message.order_id for e in c.poll(10)] == ["a"]
    assert c.stats["malformed"] == 2 and c.pending() == 1
    c.close()


def test_the_stream_is_bounded_by_maxlen(redis_url: str, prefix: str, r: redis.Redis) -> None:
    maxlen, total = 200, 2000
    node_entries = int(r.config_get("stream-node-max-entries")["stream-node-max-entries"])
    submit(redis_url, prefix, [order(f"o{i}") for i in range(total)], maxlen=maxlen)
    length = r.xlen(f"{prefix}:orders")
    # MAXLEN ~ trims whole nodes: never below the bound, at most a node over it.
    assert maxlen <= length <= maxlen + node_entries
    newest = r.xrevrange(f"{prefix}:orders", count=1)[0][1][b"msg"]
    assert newest == order(f"o{total - 1}").to_json()


def test_redis_away_is_sink_unavailable() -> None:
    async def body() -> None:
        sink = RedisStreamSink.from_url("redis://127.0.0.1:1/0", "kvptest-away", timeout_seconds=0.5)
        with pytest.raises(SinkUnavailable, match="Redis at 127.0.0.1:1/0 did not answer"):
            await sink.submit([order("a")])
        await sink.close()

    asyncio.run(body())
