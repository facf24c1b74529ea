"""One contract, every sink found (tests/implementations.py: every class under app/ or client/
that declares `OrderSink`): memory, webhook (a real local HTTP server), redis (the real server,
a prefix per test), pull and lmcache. What each sink delivered is read the way its consumers read
it: for the sinks that deliver per instance (redis, pull), by one consumer per instance. A new
sink needs a factory in FACTORIES below (test_every_order_sink_has_a_factory says so).

The lmcache sink carries orders out rather than passing them on: what it delivered is what it
reported (an order_progress per order). It keeps the once-per-id, close and empty-submit parts
(`any_case`); orders arriving intact and cancels being delivered are not its to keep (LMCache
receives tokens, and has no cancel: tests/deliver/test_lmcache.py checks its own)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from app.deliver import (
    InProcessSink,
    LmcacheSink,
    OrderSink,
    PullQueue,
    RedisStreamSink,
    SinkClosed,
    TokenIndex,
    WebhookSink,
)
from kvprefetch_client.agent import StreamSource
from kvprefetch_client.events import OrderProgress
from kvprefetch_client.orders import Cancel, Order, message_adapter
from tests.deliver.conftest import order
from tests.implementations import factory_of, here, missing_factories, params

INSTANCES = ("gpu-0", "gpu-1")


@dataclass
class Case:
    """Opens the sink inside the test's event loop; `delivered()` is what reached the consumer
    side since the last call: (orders, cancelled order ids). `read_instance`, for a sink that
    delivers per instance, is what reached one instance's consumer since its last read."""

    open: Callable[[], OrderSink]
    read: Callable[[OrderSink], list[Order | Cancel]]
    close_consumer: Callable[[], None] = lambda: None
    read_instance: Callable[[OrderSink, str], list[Order | Cancel]] | None = None
    sink: Any = None

    def delivered(self) -> tuple[list[Order], list[str]]:
        messages = self.read(self.sink)
        return (
            [m for m in messages if isinstance(m, Order)],
            [m.order_id for m in messages if isinstance(m, Cancel)],
        )

    def run(self, body: Callable[[OrderSink], Awaitable[None]]) -> None:
        async def main() -> None:
            self.sink = self.open()
            try:
                await body(self.sink)
            finally:
                await self.sink.close()
                self.close_consumer()

        asyncio.run(main())


def _lease(sink: PullQueue, instance: str) -> list[Order | Cancel]:
    # Through the JSON the endpoint answers with; `now` inside every test order's useful life.
    body = orjson.loads(sink.lease(instance, 1000, now=11.0).to_json())
    return [message_adapter.validate_python(o) for o in body["orders"]] + [
        Cancel(order_id=i) for i in body["cancelled"]
    ]


def _read_pull(sink: PullQueue) -> list[Order | Cancel]:
    return [m for instance in INSTANCES for m in _lease(sink, instance)]


def _lmcache_case() -> Case:
    """Nothing listens at its coordinator URL and its token index is empty: every order fails
    at once, reported before `submit` returns, without a call. What it delivered is read from
    those reports (the contract compares ids)."""
    reports: list[OrderProgress] = []
    taken = [0]

    async def report(events: Sequence[OrderProgress]) -> None:
        reports.extend(events)

    def read(_: OrderSink) -> list[Order | Cancel]:
        fresh, taken[0] = reports[taken[0] :], len(reports)
        return [order(e.order_id) for e in fresh if e.status != "accepted"]

    return Case(
        open=lambda: LmcacheSink(
            "http://127.0.0.1:9", model_name="m", tokens=TokenIndex(1000), report=report
        ),
        read=read,
    )


def _memory_case(request: pytest.FixtureRequest) -> Case:
    return Case(open=InProcessSink, read=lambda s: s.drain())


def _pull_case(request: pytest.FixtureRequest) -> Case:
    return Case(open=PullQueue, read=_read_pull, read_instance=_lease)


def _webhook_case(request: pytest.FixtureRequest) -> Case:
    receiver, url = request.getfixturevalue("receiver")
    return Case(open=lambda: WebhookSink(url, max_attempts=1), read=lambda _: receiver.take())


def _redis_case(request: pytest.FixtureRequest) -> Case:
    url = request.getfixturevalue("redis_url")
    prefix = request.getfixturevalue("clean_redis")
    consumers = {
        i: StreamSource.from_url(
            url, prefix=prefix, consumer=f"contract-{i}", instance_id=i, batch=1000
        )
        for i in INSTANCES
    }

    def read_instance(_: OrderSink, instance: str) -> list[Order | Cancel]:
        consumer = consumers[instance]
        deliveries = consumer.poll(0)
        consumer.ack(deliveries)
        return [d.message for d in deliveries if d.message is not None]

    def close() -> None:
        for c in consumers.values():
            c.close()

    return Case(
        open=lambda: RedisStreamSink.from_url(url, prefix, maxlen=1000),
        read=lambda s: [m for i in INSTANCES for m in read_instance(s, i)],
        close_consumer=close,
        read_instance=read_instance,
    )


@dataclass(frozen=True)
class Sink:
    """How the suite sets a sink up (`case(request)`), and which parts of the contract are its:
    `passes_on` (what it delivered arrives intact, cancels included: not the lmcache sink, which
    carries orders out), `per_instance` (a consumer per instance reads its own instance's feed)."""

    case: Callable[[pytest.FixtureRequest], Case]
    passes_on: bool = True
    per_instance: bool = False


# One per implementation found (test_every_order_sink_has_a_factory checks).
FACTORIES: dict[type, Sink] = {
    InProcessSink: Sink(_memory_case),
    WebhookSink: Sink(_webhook_case),
    RedisStreamSink: Sink(_redis_case, per_instance=True),
    PullQueue: Sink(_pull_case, per_instance=True),
    LmcacheSink: Sink(lambda request: _lmcache_case(), passes_on=False),
}


def test_every_order_sink_has_a_factory() -> None:
    missing = missing_factories(OrderSink, FACTORIES, here(__file__))
    assert not missing, "\n".join(missing)


def _sinks(keeps: Callable[[Sink], bool]) -> list[Any]:
    # A sink without a factory is in every list: its tests fail, saying where to add one.
    return params(OrderSink, keep=lambda cls: cls not in FACTORIES or keeps(FACTORIES[cls]))


def _case(request: pytest.FixtureRequest) -> Case:
    return factory_of(OrderSink, FACTORIES, request.param, request).case(request)


@pytest.fixture(params=_sinks(lambda sink: sink.passes_on))
def case(request: pytest.FixtureRequest) -> Case:
    return _case(request)


# Every sink, the lmcache one included: for the parts of the contract it keeps.
@pytest.fixture(params=_sinks(lambda sink: True))
def any_case(request: pytest.FixtureRequest) -> Case:
    return _case(request)


# The sinks that keep a feed per instance (memory and webhook carry every instance's orders in one).
@pytest.fixture(params=_sinks(lambda sink: sink.per_instance))
def per_instance_case(request: pytest.FixtureRequest) -> Case:
    return _case(request)


def ids(orders: list[Order]) -> list[str]:
    return [o.order_id for o in orders]


def test_a_resubmitted_order_is_delivered_once(any_case: Case) -> None:
    case = any_case
    # Later start_by for later ids, so every sink's order of delivery is the submission order.
    a, b, c = (order(i, start_by_ts=10.0 + n / 10) for n, i in enumerate("abc"))

    async def body(sink: OrderSink) -> None:
        assert await sink.submit([a, b]) == ["a", "b"]
        assert await sink.submit([a]) == []
        assert await sink.submit([b, c, c]) == ["c"]
        assert ids(case.delivered()[0]) == ["a", "b", "c"]
        assert await sink.submit([a, b, c]) == []
        assert case.delivered() == ([], [])

    case.run(body)


def test_cancels_are_delivered_once(case: Case) -> None:
    async def body(sink: OrderSink) -> None:
        await sink.submit([order("a"), order("b")])
        assert ids(case.delivered()[0]) == ["a", "b"]
        assert await sink.cancel([Cancel(order_id="a", reason="session closed")]) == ["a"]
        assert await sink.cancel([Cancel(order_id="a")]) == []
        assert case.delivered() == ([], ["a"])
        assert await sink.submit([order("a")]) == []  # a cancelled id is not ordered again
        assert case.delivered() == ([], [])

    case.run(body)


def test_close_is_idempotent_and_final(any_case: Case) -> None:
    case = any_case

    async def body(sink: OrderSink) -> None:
        await sink.submit([order("a")])
        await sink.close()
        await sink.close()
        with pytest.raises(SinkClosed):
            await sink.submit([order("b")])
        with pytest.raises(SinkClosed):
            await sink.cancel([Cancel(order_id="a")])

    case.run(body)


def test_orders_arrive_intact(case: Case) -> None:
    sent = [
        order(
            "prefetch-3f2a-0",
            priority=0.123456789012345,
            block_hashes=[2**63 - 1, -(2**63), "ab01", 7],
            size_bytes=2**53,
            session_ids=["chat-42", "chat-43"],
            created_ts=1767000000.123456,
            start_by_ts=1767000000.5,
            needed_by_ts=1767000001.75,
        ),
        # One scheduler clock for a batch, as in the service (the pull queue expires by it).
        order(
            "pin-1",
            kind="pin",
            source_tier=None,
            tier="host",
            ttl_seconds=300.0,
            block_hashes=["x" * 128],
            size_bytes=0,
            session_ids=[],
            created_ts=1767000000.0,
            start_by_ts=1767000001.0,
            needed_by_ts=1767000002.0,
            instance_id="gpu-1",
        ),
        order(
            "demote-é-1",
            kind="demote",
            source_tier=None,
            tier="hbm",
            created_ts=1767000000.0,
            start_by_ts=1767000002.0,
            needed_by_ts=1767000002.0,
        ),
    ]

    async def body(sink: OrderSink) -> None:
        assert await sink.submit(sent) == [o.order_id for o in sent]
        got = {o.order_id: o for o in case.delivered()[0]}
        assert got == {o.order_id: o for o in sent}

    case.run(body)


def test_an_empty_submit_delivers_nothing(any_case: Case) -> None:
    case = any_case

    async def body(sink: OrderSink) -> None:
        assert await sink.submit([]) == []
        assert await sink.cancel([]) == []
        assert case.delivered() == ([], [])

    case.run(body)


def test_each_instance_reads_its_own_orders_and_their_cancels(per_instance_case: Case) -> None:
    case = per_instance_case
    read = case.read_instance
    assert read is not None

    async def body(sink: OrderSink) -> None:
        await sink.submit(
            [
                order("a", "gpu-0", start_by_ts=11.0),
                order("b", "gpu-1"),
                order("c", "gpu-0", start_by_ts=11.5),
            ]
        )
        assert [m.order_id for m in read(sink, "gpu-1")] == ["b"]
        assert [m.order_id for m in read(sink, "gpu-0")] == ["a", "c"]
        assert await sink.cancel([Cancel(order_id="b")]) == ["b"]
        assert read(sink, "gpu-0") == []
        assert read(sink, "gpu-1") == [Cancel(order_id="b")]

    case.run(body)
