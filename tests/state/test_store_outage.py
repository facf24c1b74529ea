"""The planning loop through outages: a tick the store fails half way loses nothing it decided,
and the loop says so once per outage rather than a traceback per tick; an order whose agent died
(or that nobody took) is given up once overdue, so its blocks can be ordered again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest

from app.core.clock import ManualClock
from app.core.errors import StoreUnavailable
from app.decide.dispatcher import Dispatcher
from app.decide.scheduler import Plan, Scheduler
from app.deliver import InProcessSink
from app.state import MemoryStore
from tests.decide.test_scheduler import BLOCK_BYTES, advice, config, prefetches, store_with, tick


class FlakyStore:
    """A MemoryStore whose calls raise StoreUnavailable while `down(method, args)` says so."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self.down: Callable[[str, tuple[Any, ...]], bool] = lambda name, args: False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.down(name, args):
                raise StoreUnavailable("Redis is unavailable: Connection refused")
            return attr(*args, **kwargs)

        return call


def test_cancels_and_pins_a_failed_tick_decided_go_out_with_the_next_tick() -> None:
    store = FlakyStore(
        store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(10), hbm={"gpu-0": [7, 8]})
    )
    sched = Scheduler(store, config())  # type: ignore[arg-type]
    (order,) = prefetches(tick(sched, [advice("a", [0, 1])], 0.0).orders)
    keep = advice("k", [7, 8], p_soon=0.1, p_keep=0.9, retention="keep")

    # The store goes away after the tick has cancelled a's order (its chance fell) and pinned k,
    # when it reads the room of b's destination (one that never reported its room: b is never
    # ordered).
    store.down = lambda name, args: name == "instances"
    b = advice("b", [3], instance_id="gpu-1")
    with pytest.raises(StoreUnavailable):
        tick(sched, [advice("a", [0, 1], p_soon=0.1), keep, b], 1.0)
    store.down = lambda name, args: False

    plan = sched.plan(1.1)
    assert [c.order_id for c in plan.cancels] == [order.order_id]
    assert [(o.kind, o.block_hashes, o.session_ids) for o in plan.orders] == [
        ("pin", [7, 8], ["k"])
    ]
    assert sched.plan(1.2) == Plan(orders=[], cancels=[])  # each went out once
    assert sched.totals.cancelled == 1 and sched.totals.orders["pin"] == 1


def test_a_prefetch_booked_before_the_store_failed_goes_out_once_with_the_next_tick() -> None:
    store = FlakyStore(store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(10)))
    sched = Scheduler(store, config())  # type: ignore[arg-type]
    # a is planned first (likelier); the store fails when b's blocks are looked up.
    store.down = lambda name, args: name == "holds" and 5 in args[2]
    with pytest.raises(StoreUnavailable):
        tick(sched, [advice("a", [0, 1], p_soon=0.9), advice("b", [5, 6], p_soon=0.8)], 0.0)
    store.down = lambda name, args: False

    plan = sched.plan(0.1)
    assert sorted(o.block_hashes for o in prefetches(plan.orders)) == [[0, 1], [5, 6]]
    assert {o.order_id for o in plan.orders} == {o.order_id for o in sched.open_orders()}
    assert prefetches(sched.plan(0.2).orders) == []
    assert sched.totals.orders["prefetch"] == 2


def test_a_carried_prefetch_cancelled_before_it_went_out_goes_out_neither_way() -> None:
    store = FlakyStore(store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(10)))
    sched = Scheduler(store, config())  # type: ignore[arg-type]
    store.down = lambda name, args: name == "holds" and 5 in args[2]
    with pytest.raises(StoreUnavailable):
        tick(sched, [advice("a", [0, 1], p_soon=0.9), advice("b", [5, 6], p_soon=0.8)], 0.0)
    store.down = lambda name, args: False
    sched.forget("a", routed_to="gpu-1")  # back elsewhere before the store was: its order falls

    plan = tick(sched, [advice("b", [5, 6], p_soon=0.8)], 0.1)
    assert [o.session_ids for o in prefetches(plan.orders)] == [["b"]]
    assert plan.cancels == []


def test_the_planning_loop_says_once_per_outage_that_the_store_is_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = FlakyStore(store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(10)))
    sched = Scheduler(store, config())  # type: ignore[arg-type]
    sched.advise([advice("a", [0, 1])], 0.0)
    sink = InProcessSink()
    calls = 0

    def down(name: str, args: tuple[Any, ...]) -> bool:
        nonlocal calls
        if name != "instances":
            return False
        calls += 1
        return 3 <= calls <= 12 or 20 <= calls <= 25  # two outages

    store.down = down
    caplog.set_level(logging.INFO, logger="app.decide.dispatcher")

    async def main() -> None:
        task = asyncio.create_task(Dispatcher(sched, sink, ManualClock(0.0)).run(0.001))
        async with asyncio.timeout(30):  # only reached when the loop stops ticking
            while calls < 30:
                await asyncio.sleep(0.001)
        task.cancel()

    asyncio.run(main())
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [m for m in messages if m[0] != "INFO" or "planning" in m[1]] == [
        ("WARNING", "planning paused: Redis is unavailable: Connection refused"),
        ("INFO", "planning again: the store answers"),
    ] * 2
    assert [o.block_hashes for o in sink.drain()] == [[0, 1]]  # planned before the outage, once


# --- orders whose agent died -------------------------------------------------------------------


def test_a_started_order_whose_agent_went_silent_is_given_up_and_its_blocks_ordered_again() -> None:
    store = store_with(free_bytes={"gpu-0": 3 * BLOCK_BYTES}, pool=range(10))
    sched = Scheduler(store, config(overdue_seconds=60.0))
    (order,) = prefetches(tick(sched, [advice("a", [0, 1])], 0.0).orders)
    sched.on_progress(order.order_id, "accepted")  # and then its agent is killed: no more word

    # Until the deadline it holds its blocks and its room: nothing more is ordered.
    both = [advice("a", [0, 1]), advice("b", [5, 6])]
    assert prefetches(tick(sched, both, order.needed_by_ts + 59.0).orders) == []
    sched.forget("b")  # b came back meanwhile: a alone wants the room
    plan = tick(sched, [advice("a", [0, 1])], order.needed_by_ts + 60.5)
    assert plan.cancels == []  # it started: nothing at the sink to withdraw
    # Given up and counted failed: its blocks are tried again once the failure's backoff (1 s)
    # has passed, not at once.
    assert prefetches(plan.orders) == []
    again = prefetches(tick(sched, [advice("a", [0, 1])], order.needed_by_ts + 61.6).orders)
    assert [o.block_hashes for o in again] == [[0, 1]] and again[0].order_id != order.order_id
    assert sched.totals.failed == 1 and order.order_id not in {
        o.order_id for o in sched.open_orders()
    }
    sched.on_progress(order.order_id, "completed")  # a late word from it changes nothing
    assert sched.totals.completed == 0


def test_an_order_nobody_started_in_time_is_cancelled_at_the_sink() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(10))
    sched = Scheduler(store, config(overdue_seconds=60.0))
    (order,) = prefetches(tick(sched, [advice("a", [0, 1])], 0.0).orders)

    plan = tick(sched, [], order.needed_by_ts + 60.5)
    assert [c.order_id for c in plan.cancels] == [order.order_id]
    assert sched.totals.cancelled == 1
    # a is still advised on: a new order takes over.
    (new,) = prefetches(plan.orders)
    assert [o.order_id for o in sched.open_orders()] == [new.order_id] != [order.order_id]
