"""One contract, every order source found (tests/implementations.py: every class under app/ or
client/ that declares `OrderSource`), each fed by the service's own producer: StreamSource reads
what RedisStreamSink writes on the real Redis; PullSource pulls from the real service, whose
PullQueue leases on a manual clock. A new source needs a factory in FACTORIES below
(test_every_order_source_has_a_factory says so).

What the protocol promises (client/kvprefetch_client/agent/consumer.py), and the runner relies
on: a source serves the instance it was made for; it hands over the orders of that instance,
intact, and its cancels; an order one agent holds is not handed to another agent of the instance
until the first stops (dies, or stops renewing); `is_cancelled` says whether an order was
cancelled, whichever agent read the Cancel; an order whose outcome the service has and that is
acked is not delivered again, to any agent.

Tests here load the service (they sit beside tests/client/conftest.py's service_url, not under
tests/client/agent, whose tests never do).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from app.api.main import create_app
from app.core.clock import ManualClock
from app.core.config import Settings
from app.deliver import PullQueue, RedisStreamSink
from kvprefetch_client.agent.consumer import Delivery, OrderSource, PullSource, StreamSource
from kvprefetch_client.events import OrderProgress
from kvprefetch_client.orders import Cancel, Order
from tests.client.conftest import HANG_GUARD
from tests.conftest import live_server
from tests.implementations import factory_of, here, missing_factories, params

T0 = 1_767_000_000.0
INSTANCE = "gpu-0"
OTHER = "gpu-1"
# A stream entry idle this long goes to another agent; a live agent renews a third of it apart,
# so only a stalled process (not a slow test step) loses what it holds.
CLAIM_IDLE_SECONDS = 1.0
LEASE_SECONDS = 30.0


def order(order_id: str, instance_id: str = INSTANCE, **kw: Any) -> Order:
    fields: dict[str, Any] = dict(
        order_id=order_id,
        kind="prefetch",
        instance_id=instance_id,
        source_tier="pool",
        block_hashes=[1, 2],
        size_bytes=2048,
        created_ts=T0,
        start_by_ts=T0 + 1.0,
        # Far ahead: useful for as long as a test runs, past any lease it lets run out.
        needed_by_ts=T0 + 3600.0,
        session_ids=["s1"],
    )
    fields.update(kw)
    return Order(**fields)


@dataclass
class Feed:
    """The service side of a source, and the agents' sources on it.

    `open(instance, agent)`: a new agent's source for the instance (closed after the test);
    `submit`, `cancel`: the service's producer; `finished(ids)`: the service has these orders'
    outcomes (what the runner reports before it acks); `stop_holding()`: time enough passes for
    what a stopped agent held (dead, not renewing) to go to another agent."""

    new_source: Callable[[str, str], OrderSource]
    submit: Callable[[Sequence[Order]], None]
    cancel: Callable[[Sequence[Cancel]], None]
    finished: Callable[[Sequence[str]], None]
    stop_holding: Callable[[], None]
    opened: list[OrderSource] = field(default_factory=list)
    closed: set[int] = field(default_factory=set)

    def open(self, agent: str, instance: str = INSTANCE) -> OrderSource:
        source = self.new_source(instance, agent)
        self.opened.append(source)
        return source

    def close(self, source: OrderSource) -> None:
        """The agent stops: its source closes (its renewals stop), without an ack."""
        if id(source) not in self.closed:
            self.closed.add(id(source))
            source.close()

    def close_all(self) -> None:
        for source in self.opened:
            self.close(source)


def _stream_feed(request: pytest.FixtureRequest, stack: ExitStack) -> Feed:
    url = request.getfixturevalue("redis_url")
    prefix = request.getfixturevalue("clean_redis")

    def produce(call: Callable[[RedisStreamSink], Awaitable[Any]]) -> None:
        async def main() -> None:
            sink = RedisStreamSink.from_url(url, prefix)
            try:
                await call(sink)
            finally:
                await sink.close()

        asyncio.run(main())

    return Feed(
        new_source=lambda instance, agent: StreamSource.from_url(
            url,
            prefix=prefix,
            consumer=agent,
            instance_id=instance,
            claim_idle_seconds=CLAIM_IDLE_SECONDS,
        ),
        submit=lambda orders: produce(lambda sink: sink.submit(orders)),
        cancel=lambda cancels: produce(lambda sink: sink.cancel(cancels)),
        finished=lambda order_ids: None,  # the stream has nothing to learn: the ack is all
        stop_holding=lambda: time.sleep(CLAIM_IDLE_SECONDS * 2.5),
    )


def _pull_feed(request: pytest.FixtureRequest, stack: ExitStack) -> Feed:
    tmp_path: Path = request.getfixturevalue("tmp_path")
    clock = ManualClock(T0)
    queue = PullQueue(lease_seconds=LEASE_SECONDS)
    app = create_app(Settings(data_dir=tmp_path, store="memory"), clock=clock, order_sink=queue)
    url = stack.enter_context(live_server(app, HANG_GUARD))

    def finished(order_ids: Sequence[str]) -> None:
        queue.observe(
            [
                OrderProgress(
                    event_id=f"done-{i}",
                    ts=clock.now(),
                    order_id=i,
                    status="completed",
                    bytes=1,
                    seconds=0.0,
                )
                for i in order_ids
            ]
        )

    # The test thread calls the queue beside the service's loop, as tests/api/test_orders.py
    # does: between the sources' requests, but for the one renewal a source's heartbeat makes
    # when it learns the lease, which only extends leases (nothing here expires meanwhile).
    return Feed(
        # Renewals only when asked (is_cancelled): the tests move the service's clock themselves.
        new_source=lambda instance, agent: PullSource(
            url, instance, agent=agent, renew_seconds=3600.0
        ),
        submit=queue.submit_nowait,
        cancel=queue.cancel_nowait,
        finished=finished,
        stop_holding=lambda: clock.advance(LEASE_SECONDS + 1.0),
    )


# One per implementation found (test_every_order_source_has_a_factory checks).
FACTORIES: dict[type, Callable[[pytest.FixtureRequest, ExitStack], Feed]] = {
    StreamSource: _stream_feed,
    PullSource: _pull_feed,
}


def test_every_order_source_has_a_factory() -> None:
    missing = missing_factories(OrderSource, FACTORIES, here(__file__))
    assert not missing, "\n".join(missing)


@pytest.fixture(params=params(OrderSource))
def feed(request: pytest.FixtureRequest) -> Iterator[Feed]:
    with ExitStack() as stack:  # the service stops after the sources close
        f = factory_of(OrderSource, FACTORIES, request.param, request)(request, stack)
        stack.callback(f.close_all)
        yield f


def drain(source: OrderSource) -> list[Delivery]:
    """Everything the source hands over now (polls without waiting until one brings nothing)."""
    out: list[Delivery] = []
    for _ in range(20):
        got = source.poll(0)
        if not got:
            return out
        out += got
    raise AssertionError("the source kept handing deliveries over")


def order_ids(deliveries: list[Delivery]) -> list[str]:
    return sorted(d.message.order_id for d in deliveries if isinstance(d.message, Order))


def cancelled_ids(deliveries: list[Delivery]) -> list[str]:
    return sorted(d.message.order_id for d in deliveries if isinstance(d.message, Cancel))


def test_a_source_serves_the_instance_it_was_made_for(feed: Feed) -> None:
    source = feed.open("a")
    source.bind(INSTANCE)
    source.bind(INSTANCE)  # again, the same: fine
    with pytest.raises(ValueError, match=OTHER):
        source.bind(OTHER)


def test_a_poll_with_nothing_there_hands_nothing_over(feed: Feed) -> None:
    source = feed.open("a")
    assert source.poll(0) == []
    source.ack([])


def test_orders_arrive_intact_at_their_instance_only(feed: Feed) -> None:
    mine = [
        order(
            "prefetch-3f2a-0",
            priority=0.123456789012345,
            block_hashes=[2**63 - 1, -(2**63), "ab01", 7],
            size_bytes=2**53,
            session_ids=["chat-42", "chat-43"],
            created_ts=T0 + 0.123456,
            start_by_ts=T0 + 0.5,
        ),
        order(
            "pin-1",
            kind="pin",
            source_tier=None,
            tier="host",
            ttl_seconds=300.0,
            block_hashes=["x" * 128],
            size_bytes=0,
            session_ids=[],
        ),
        order("demote-é-1", kind="demote", source_tier=None, tier="hbm", start_by_ts=T0 + 2.0),
    ]
    theirs = order("o-other", OTHER)
    source, other = feed.open("a"), feed.open("b", OTHER)
    feed.submit([*mine, theirs])
    got = drain(source)
    assert all(d.error is None for d in got)
    assert {d.message.order_id: d.message for d in got if d.message is not None} == {
        o.order_id: o for o in mine
    }
    assert [d.message for d in drain(other)] == [theirs]


def test_an_order_one_agent_holds_is_not_handed_to_another(feed: Feed) -> None:
    a, b = feed.open("a"), feed.open("b")
    feed.submit([order("o1"), order("o2", start_by_ts=T0 + 2.0)])
    assert order_ids(drain(a)) == ["o1", "o2"]
    assert drain(b) == []


def test_a_cancel_reaches_the_instance_and_every_agent_of_it_knows(feed: Feed) -> None:
    a, b = feed.open("a"), feed.open("b")
    feed.submit([order("o1"), order("o2", start_by_ts=T0 + 2.0)])
    assert order_ids(drain(a)) == ["o1", "o2"]
    assert not a.is_cancelled("o1") and not a.is_cancelled("o2")
    feed.cancel([Cancel(order_id="o1", reason="session closed")])
    read = drain(b)  # the other agent of the instance reads the Cancel
    assert (order_ids(read), cancelled_ids(read)) == ([], ["o1"])
    assert a.is_cancelled("o1")  # though `a`, holding it, never read the Cancel
    assert not a.is_cancelled("o2")


def test_what_a_stopped_agent_held_goes_to_another(feed: Feed) -> None:
    a = feed.open("a")
    feed.submit([order("o1")])
    assert order_ids(drain(a)) == ["o1"]
    feed.close(a)  # dies holding it: no outcome, no ack
    feed.stop_holding()
    b = feed.open("b")
    got = drain(b)
    assert order_ids(got) == ["o1"]
    assert [d.message for d in got] == [order("o1")]


def test_an_order_finished_and_acked_is_not_delivered_again(feed: Feed) -> None:
    a = feed.open("a")
    feed.submit([order("o1"), order("o2", start_by_ts=T0 + 2.0)])
    got = drain(a)
    assert order_ids(got) == ["o1", "o2"]
    done = [d for d in got if isinstance(d.message, Order) and d.message.order_id == "o1"]
    feed.finished(["o1"])
    a.ack(done)
    assert drain(a) == []
    feed.close(a)  # stops holding o2, which it never finished
    feed.stop_holding()
    b = feed.open("b")
    assert order_ids(drain(b)) == ["o2"]
