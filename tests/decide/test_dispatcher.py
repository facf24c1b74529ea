"""The planning loop's seams: orders to the sink (and back to the scheduler when the sink fails),
and the ingest observer that tells the scheduler and the route tracker what happened."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from app.core.clock import ManualClock
from app.decide.dispatcher import Dispatcher, feedback_observer
from app.decide.lease import PlanningLease
from app.decide.routing import RouteTracker
from app.decide.scheduler import Scheduler
from app.deliver import InProcessSink, SinkUnavailable
from kvprefetch_client.events import OrderProgress, RequestRouted, SessionClosed
from kvprefetch_client.orders import Cancel, Order
from tests.decide.test_scheduler import BLOCK_BYTES, advice, config, store_with


class DownSink(InProcessSink):
    async def submit(self, orders: Sequence[Order]) -> list[str]:
        raise SinkUnavailable("receiver down")

    async def cancel(self, cancels: Sequence[Cancel]) -> list[str]:
        raise SinkUnavailable("receiver down")


def scheduler_with_a_candidate() -> Scheduler:
    sched = Scheduler(store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(10)), config())
    sched.advise([advice("a", [0, 1])], 0.0)
    return sched


def test_orders_go_to_the_sink() -> None:
    sched, sink = scheduler_with_a_candidate(), InProcessSink()
    plan = asyncio.run(Dispatcher(sched, sink, ManualClock(0.0)).tick())
    assert [m.order_id for m in sink.drain()] == [o.order_id for o in plan.orders]
    assert len(sched.open_orders()) == 1


def test_each_plans_orders_are_told_as_decided_whether_or_not_a_sink_took_them() -> None:
    told: list[list[str]] = []
    sched = scheduler_with_a_candidate()
    dispatcher = Dispatcher(
        sched,
        DownSink(),
        ManualClock(0.0),
        planned=lambda orders: told.append([o.order_id for o in orders]),
    )
    plan = asyncio.run(dispatcher.tick())
    assert plan.orders and told == [[o.order_id for o in plan.orders]]
    asyncio.run(dispatcher.tick())  # nothing new decided: nothing told
    assert len(told) == 1


def test_orders_a_sink_did_not_take_are_planned_again_after_a_backoff() -> None:
    sched = scheduler_with_a_candidate()
    clock = ManualClock(0.0)
    dispatcher = Dispatcher(sched, DownSink(), clock)
    first = asyncio.run(dispatcher.tick())
    assert len(first.orders) == 1 and sched.open_orders() == [] and dispatcher.undelivered == 1
    clock.set(0.1)
    assert asyncio.run(dispatcher.tick()).orders == []  # not every tick
    clock.set(sched.config.retry_backoff_seconds)
    assert len(asyncio.run(dispatcher.tick()).orders) == 1  # not counted as on its way


def test_the_observer_forgets_routed_and_closed_sessions_and_follows_progress() -> None:
    sched, routes = scheduler_with_a_candidate(), RouteTracker()
    (order,) = sched.plan(0.0).orders
    sched.advise([advice("b", [5])], 0.0)
    observe = feedback_observer(sched, routes)
    observe(
        [
            RequestRouted(
                event_id="e1",
                ts=1.0,
                session_id="a",
                request_id="r",
                instance_id="gpu-0",
                prompt_tokens=100,
            ),
            SessionClosed(event_id="e2", ts=1.0, session_id="b"),
            OrderProgress(event_id="e3", ts=1.0, order_id=order.order_id, status="accepted"),
        ]
    )
    assert sched.tracked_sessions == 0
    assert (
        sched.plan(2.0).cancels == [] and sched.totals.bytes_wasted == 0
    )  # started, and used by a's request
    observe(
        [
            OrderProgress(
                event_id="e4",
                ts=3.0,
                order_id=order.order_id,
                status="completed",
                bytes=1,
                seconds=0.1,
            )
        ]
    )
    assert sched.totals.completed == 1


def test_only_the_lease_holder_plans_and_it_writes_its_handover_state_first(
    redis_url: str, clean_redis: str
) -> None:
    async def body() -> None:
        mine = PlanningLease.from_url(redis_url, clean_redis, "me", 5.0, timeout_seconds=1.0)
        other = PlanningLease.from_url(redis_url, clean_redis, "other", 5.0, timeout_seconds=1.0)
        sched, sink, skipped = scheduler_with_a_candidate(), InProcessSink(), []
        dispatcher = Dispatcher(
            sched, sink, ManualClock(0.0), lease=mine, skipped=lambda: skipped.append(1)
        )
        try:
            assert await other.step()
            assert not await mine.step()
            assert (await dispatcher.tick()).orders == [] and sink.drain() == []
            assert skipped == [1] and sched.open_orders() == []  # nothing planned either
            await other.release()
            assert await mine.step()
            plan = await dispatcher.tick()
            assert [m.order_id for m in sink.drain()] == [o.order_id for o in plan.orders]
            state = await mine.client.hgetall(mine.state_key)
            assert set(state) == {f"o:{o.order_id}".encode() for o in plan.orders}
        finally:
            await mine.close()
            await other.close()

    asyncio.run(body())


def test_planning_is_said_to_resume_only_once_the_store_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A tick with nothing to plan reads nothing of the store: during an outage it succeeds, and
    planning must not be said to resume (then pause again) until the store itself answers."""
    from app.core.errors import StoreUnavailable

    sched = Scheduler(store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(10)), config())
    store = sched.store
    down = {"tick": True, "ping": True}
    plan, ping = sched.plan, store.ping

    def planned(now: float):
        if down["tick"]:
            down["tick"] = False  # the first tick fails; the later ones touch nothing
            raise StoreUnavailable("Redis is unavailable")
        return plan(now)

    def pinged() -> None:
        if down["ping"]:
            raise StoreUnavailable("Redis is unavailable")
        ping()

    sched.plan = planned  # type: ignore[method-assign]
    store.ping = pinged  # type: ignore[method-assign]
    dispatcher = Dispatcher(sched, InProcessSink(), ManualClock(0.0))

    async def body() -> None:
        loop = asyncio.create_task(dispatcher.run(0.001))
        for _ in range(50):
            await asyncio.sleep(0.001)
        assert "planning again" not in caplog.text  # ticks succeed, the store does not answer
        down["ping"] = False
        for _ in range(200):
            await asyncio.sleep(0.001)
            if "planning again" in caplog.text:
                break
        loop.cancel()

    with caplog.at_level("INFO", logger="app.decide.dispatcher"):
        asyncio.run(body())
    assert caplog.text.count("planning paused") == 1
    assert caplog.text.count("planning again: the store answers") == 1
