"""The scheduler driving each real sink for a simulated minute: orders per context counted where
they are carried out.

The sink tests test a sink alone; these test it behind the scheduler and its planning loop
(app/decide/dispatcher.py Dispatcher, on a ManualClock ticking every 0.1 s for 60 s, the advice
refreshed every tick as the scorer refreshes it), with what carries the orders out reporting
their outcomes back through the feedback observer, as agents and the lmcache sink do:

- memory (the in-process list), pull (leased as an agent leases), the Redis stream (the real Redis,
  read by the agents' own StreamSource), the webhook (a real HTTP receiver): a stand-in agent per
  instance completes gpu-0's orders and fails gpu-1's;
- the Mooncake tier: a real mooncake_master and pool holder, an agent's MooncakeTier per
  instance; gpu-1's blocks are not in the store, so its orders fail;
- LMCache: the real coordinator, MP server and bench engine of tests/deliver/test_lmcache.py;
  gpu-1 is no MP server LMCache knows, so its orders fail (404).

Each time: the context at gpu-0 is ordered once (its delivery stands: the tiers report nothing in
HBM, as LMCache's L1 does not), and the one at gpu-1 is tried with the order book's backoff, 1 s
doubling: at 0.1, 1.1, 3.1, 7.1, 15.1 and 31.1 s. And a coordinator restart makes the lost LMCache
pins be ordered again.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.core.clock import ManualClock
from app.decide.dispatcher import Dispatcher, feedback_observer
from app.decide.routing import RouteTracker
from app.decide.scheduler import Scheduler, SchedulerConfig
from app.deliver import InProcessSink, LmcacheSink, OrderSink, PullQueue, RedisStreamSink
from app.deliver.webhook import WebhookSink
from app.state import MemoryStore
from bench._util import quiet_port
from kvprefetch_client.agent import StreamSource
from kvprefetch_client.agent.runner import progress_event_id
from kvprefetch_client.events import InstanceStatus, KvBlocksStored, OrderProgress
from kvprefetch_client.orders import Cancel, Order
from tests.decide.test_scheduler import advice
from tests.deliver.conftest import Receiver
from tests.deliver.test_lmcache import (  # noqa: F401  (fixtures)
    MODEL,
    MP_INSTANCE,
    Lmcache,
    _start,
    _stop,
    _wait_or_in_use,
    bench_engine,
    bench_index,
    coordinator,
    lmcache,
)
from tests.ports import retry_in_use

pytestmark = pytest.mark.slow

TICK_SECONDS = 0.1
TICKS = 600  # a simulated minute
BLOCK_BYTES = 64 * 1024
FAILING = "gpu-1"
# Where the failing context's order goes, ordered first at 0.1 s: 1 s, 2, 4, 8, 16 apart (the
# next, 32 s later, is past the minute).
RETRIES_AT = [0.1, 1.1, 3.1, 7.1, 15.1, 31.1]

# An order's outcome, as what carried it out reports it: None to leave it unanswered.
Outcome = tuple[str, str | None]
CarryOut = Callable[[float], Awaitable[list[Order]]]


class Spy:
    """The sink, recording each order handed to it."""

    def __init__(self, sink: OrderSink) -> None:
        self.sink = sink
        self.by_id: dict[str, Order] = {}

    async def submit(self, orders: Sequence[Order]) -> list[str]:
        self.by_id.update((o.order_id, o) for o in orders)
        return await self.sink.submit(orders)

    async def cancel(self, cancels: Sequence[Cancel]) -> list[str]:
        return await self.sink.cancel(cancels)

    async def close(self) -> None:
        await self.sink.close()


class Minute:
    """One scheduler, its feedback observer and its planning loop over `sink`, on a manual
    clock; the store knows both instances' room and both contexts' blocks in the pool, and
    nothing of them in HBM."""

    def __init__(
        self,
        sink: OrderSink,
        good: str,
        good_blocks: Sequence[Any],
        bad_blocks: Sequence[Any],
    ) -> None:
        self.good = good
        store = MemoryStore(bytes_per_token=BLOCK_BYTES // 16, block_tokens=16)
        store.apply(
            [
                InstanceStatus(event_id=f"room-{i}", ts=0.0, instance_id=i, free_kv_bytes=10**12)
                for i in (good, FAILING)
            ]
            + [
                KvBlocksStored(
                    event_id="pool",
                    ts=0.0,
                    tier="pool",
                    block_hashes=list(dict.fromkeys([*good_blocks, *bad_blocks])),
                )
            ]
        )
        self.scheduler = Scheduler(store, SchedulerConfig(bytes_per_block=BLOCK_BYTES))
        self.observe = feedback_observer(self.scheduler, RouteTracker())
        self.clock = ManualClock(0.0)
        self.spy = Spy(sink)
        self.dispatcher = Dispatcher(self.scheduler, self.spy, self.clock)
        # Held for two minutes on landing (the keep advice's): the delivery stands all minute.
        self.advice = [
            replace(advice("ok", good_blocks, instance_id=good), keep_seconds=120.0),
            replace(advice("bad", bad_blocks, instance_id=FAILING), keep_seconds=120.0),
        ]
        self.carried: dict[str, list[float]] = {"ok": [], "bad": []}  # session -> when

    def run(self, carry_out: CarryOut) -> None:
        async def main() -> None:
            try:
                for i in range(1, TICKS + 1):
                    now = round(i * TICK_SECONDS, 1)
                    self.clock.set(now)
                    self.scheduler.advise(self.advice, now)
                    await self.dispatcher.tick()
                    for order in await carry_out(now):
                        for s in order.session_ids:
                            self.carried[s].append(now)
            finally:
                await self.spy.close()  # on the loop its client belongs to

        asyncio.run(main())

    def check(self) -> None:
        assert self.carried["ok"] == [0.1], self.carried
        assert self.carried["bad"] == RETRIES_AT, self.carried
        t = self.scheduler.totals
        assert (t.orders["prefetch"], t.completed, t.failed) == (7, 1, 6)


def progress(order: Order, now: float, outcome: Outcome) -> list[OrderProgress]:
    status, reason = outcome
    fields: dict[str, Any] = (
        {"reason": reason} if status == "failed" else {"bytes": 1, "seconds": 0.0}
    )
    return [
        OrderProgress(
            event_id=progress_event_id(order.order_id, "accepted"),
            ts=now,
            order_id=order.order_id,
            status="accepted",
        ),
        OrderProgress(
            event_id=progress_event_id(order.order_id, status),
            ts=now,
            order_id=order.order_id,
            status=status,
            **fields,
        ),
    ]


def stand_in_agent(order: Order) -> Outcome:
    """gpu-0's agent completes what it is given; gpu-1's tier is down."""
    if order.instance_id == FAILING:
        return ("failed", "the tier is down")
    return ("completed", None)


def run_with_stand_in_agents(
    sink: OrderSink, fetch: Callable[[float], Awaitable[list[Order | Cancel]]], also: Any = None
) -> Minute:
    minute = Minute(sink, "gpu-0", [1, 2, 3, 4], [5, 6, 7, 8])

    async def carry_out(now: float) -> list[Order]:
        orders = [m for m in await fetch(now) if isinstance(m, Order)]
        events = [e for o in orders for e in progress(o, now, stand_in_agent(o))]
        minute.observe(events)
        if also is not None:
            also(events)
        return orders

    minute.run(carry_out)
    return minute


def test_through_the_memory_sink() -> None:
    sink = InProcessSink()

    async def fetch(now: float) -> list[Order | Cancel]:
        return sink.drain()

    run_with_stand_in_agents(sink, fetch).check()


def test_through_the_pull_queue() -> None:
    sink = PullQueue(lease_seconds=30.0)

    async def fetch(now: float) -> list[Order | Cancel]:
        return [o for inst in ("gpu-0", FAILING) for o in sink.lease(inst, 100, now).orders]

    run_with_stand_in_agents(sink, fetch, also=sink.observe).check()


def test_through_the_redis_stream(redis_url: str, clean_redis: str) -> None:
    sink = RedisStreamSink.from_url(redis_url, clean_redis)
    agents = [
        StreamSource.from_url(redis_url, prefix=clean_redis, consumer=f"agent-{i}", instance_id=i)
        for i in ("gpu-0", FAILING)
    ]

    async def fetch(now: float) -> list[Order | Cancel]:
        out: list[Order | Cancel] = []
        for agent in agents:
            deliveries = agent.poll(0)
            agent.ack(deliveries)
            out += [d.message for d in deliveries if d.message is not None]
        return out

    run_with_stand_in_agents(sink, fetch).check()


def test_through_the_webhook(receiver: tuple[Receiver, str]) -> None:
    got, url = receiver
    sink = WebhookSink(url)

    async def fetch(now: float) -> list[Order | Cancel]:
        return got.take()

    run_with_stand_in_agents(sink, fetch).check()


# -- Mooncake -----------------------------------------------------------------------------------


@pytest.fixture
def mooncake(tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    from bench.mooncake_cluster import Holder, Master

    master = Master(tmp_path)
    master.start()
    holder = Holder(master, tmp_path)
    try:
        yield master, holder
    finally:
        holder.close()
        master.stop()


def test_through_mooncake_tiers(mooncake: tuple[Any, Any]) -> None:
    from kvprefetch_client.agent.mooncake import MooncakeSettings, MooncakeTier, store_key

    master, holder = mooncake
    ns = "t"
    good_blocks, bad_blocks = [11, 12, 13, 14], [21, 22, 23, 24]
    for h in good_blocks:  # only gpu-0's context is in the store
        assert holder.put(store_key(ns, h), BLOCK_BYTES) == 0

    def tier(instance_id: str) -> MooncakeTier:
        return MooncakeTier(
            instance_id,
            MooncakeSettings(
                master_address=master.address,
                metadata_url=master.metadata_url,
                local_host=f"127.0.0.1:{quiet_port()}",
                segment_bytes=16 << 20,
                buffer_bytes=8 << 20,
                namespace=ns,
                attempts=2,
                retry_seconds=0.1,
                task_timeout_seconds=20.0,
            ),
        )

    tiers = {"gpu-0": tier("gpu-0"), FAILING: tier(FAILING)}
    sink = InProcessSink()
    minute = Minute(sink, "gpu-0", good_blocks, bad_blocks)

    async def carry_out(now: float) -> list[Order]:
        orders = [m for m in sink.drain() if isinstance(m, Order)]
        for o in orders:
            assert o.kind == "prefetch"
            done = tiers[o.instance_id].prefetch(o, now)
            outcome: Outcome = (
                ("completed", None) if done.failure is None else ("failed", done.failure)
            )
            minute.observe(progress(o, now, outcome))
        return orders

    try:
        minute.run(carry_out)
    finally:
        for t in tiers.values():
            t.close()
    minute.check()


# -- LMCache ------------------------------------------------------------------------------------


class Reports:
    def __init__(self) -> None:
        self.events: list[OrderProgress] = []

    async def __call__(self, events: Sequence[OrderProgress]) -> None:
        self.events.extend(events)

    def take(self) -> list[OrderProgress]:
        out, self.events = self.events, []
        return out


def test_through_the_lmcache_coordinator(coordinator: str, bench_engine: None) -> None:  # noqa: F811
    reports = Reports()
    sink = LmcacheSink(
        coordinator,
        model_name=MODEL,
        tokens=bench_index(),
        report=reports,
        backoff_seconds=0.01,
        max_backoff_seconds=0.02,
    )
    # The bench engine's request, whole: LMCache holds its two chunks. gpu-1 it does not know.
    blocks = [f"b{i}" for i in range(32)]
    minute = Minute(sink, MP_INSTANCE, blocks, blocks)
    ended: dict[str, str] = {}

    async def carry_out(now: float) -> list[Order]:
        await sink.settle()  # LMCache's answers, before the next tick
        events = reports.take()
        minute.observe(events)
        orders = []
        for e in events:
            if e.status != "accepted":  # each order's end, once: what LMCache carried out
                ended[e.order_id] = e.status
                orders.append(minute.spy.by_id[e.order_id])
        return orders

    minute.run(carry_out)
    assert sorted(ended.values()) == ["completed"] + ["failed"] * 6
    minute.check()


class Coordinator:
    """An LMCache coordinator of this test's own (no MP server: pins need none), restarted on
    the same port."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.port = retry_in_use(self._start_on)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _start_on(self, port: int) -> int:
        self.starts += 1
        log = self.logs / f"coordinator-{self.starts}.log"
        proc = _start(["coordinator", "--host", "127.0.0.1", "--port", str(port)], log)
        self.proc = proc
        try:
            _wait_or_in_use(
                f"http://127.0.0.1:{port}/healthz", lambda r: r.status_code == 200, proc, log
            )
        except BaseException:
            if proc.poll() is None:
                _stop(proc)
            raise
        return port

    def restart(self) -> None:
        self.stop()
        self._start_on(self.port)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _stop(self.proc)

    def pins(self) -> list[dict[str, Any]]:
        answer = httpx.get(f"{self.url}/cache/pins", params={"model_name": MODEL}, timeout=5)
        return list(answer.json()["pins"])


@pytest.fixture
def own_coordinator(tmp_path: Path) -> Iterator[Coordinator]:
    c = Coordinator(tmp_path)
    try:
        yield c
    finally:
        c.stop()


def test_a_coordinator_restart_makes_the_lost_pins_be_ordered_again(
    own_coordinator: Coordinator,
) -> None:
    reports = Reports()
    sink = LmcacheSink(
        own_coordinator.url,
        model_name=MODEL,
        tokens=bench_index(),
        report=reports,
        pin_check_seconds=0.2,
        backoff_seconds=0.01,
        max_backoff_seconds=0.02,
    )
    blocks = [f"b{i}" for i in range(32)]
    store = MemoryStore(bytes_per_token=BLOCK_BYTES // 16, block_tokens=16)
    # The context is in the engine's HBM, and its session is advised kept: it is pinned.
    store.apply(
        [
            InstanceStatus(event_id="room", ts=0.0, instance_id=MP_INSTANCE, free_kv_bytes=0),
            KvBlocksStored(
                event_id="hbm", ts=0.0, tier="hbm", instance_id=MP_INSTANCE, block_hashes=blocks
            ),
        ]
    )
    scheduler = Scheduler(store, SchedulerConfig(bytes_per_block=BLOCK_BYTES))
    observe = feedback_observer(scheduler, RouteTracker())
    clock = ManualClock(0.0)
    spy = Spy(sink)
    dispatcher = Dispatcher(scheduler, spy, clock)
    keep = advice("k", [0], instance_id=MP_INSTANCE, p_soon=0.1, p_keep=0.6, retention="keep")
    keep = replace(keep, block_hashes=tuple(blocks))
    outcomes: list[tuple[str, str]] = []
    held_after: list[dict[str, Any]] = []

    async def main() -> None:
        now = 0.0
        deadline = time.monotonic() + 60
        restarted = False
        try:
            while time.monotonic() < deadline:
                now = round(now + TICK_SECONDS, 1)
                clock.set(now)
                scheduler.advise([keep], now)
                await dispatcher.tick()
                await sink.settle()
                await asyncio.sleep(0.05)  # real time for the sink's pin checks
                events = reports.take()
                observe(events)
                outcomes.extend((e.order_id, e.status) for e in events if e.status != "accepted")
                pins_ordered = [o for o in spy.by_id.values() if o.kind == "pin"]
                if not restarted and outcomes == [(pins_ordered[0].order_id, "completed")]:
                    assert len(own_coordinator.pins()) == 2  # its two chunks' keys
                    own_coordinator.restart()
                    assert own_coordinator.pins() == []  # a restart forgets every pin
                    restarted = True
                if restarted and len(outcomes) == 3:
                    held_after.extend(own_coordinator.pins())  # before close() releases them
                    break
        finally:
            await spy.close()

    asyncio.run(main())
    pins_ordered = [o for o in spy.by_id.values() if o.kind == "pin"]
    assert len(pins_ordered) == 2, outcomes
    first, second = (o.order_id for o in pins_ordered)
    # Pinned, lost with the restart (the sink found it gone), pinned again on the new one.
    assert outcomes == [(first, "completed"), (first, "failed"), (second, "completed")]
    assert scheduler.book.pins_lost == 1 and scheduler.book.pins_held == 1
    assert len(held_after) == 2
