"""The order book: every order tracked to its outcome. A delivered prefetch is not ordered again
while it stands; failed orders come back with backoff; pins are held once confirmed; every landed
byte ends used, wasted or still waiting; the hand-over carries all of it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from app.decide.advisor import SessionAdvice
from app.decide.plan_loop import feedback_observer
from app.decide.routing import RouteTracker
from app.decide.scheduler import Plan, Scheduler
from kvprefetch_client.events import KvBlocksCleared, KvBlocksRemoved
from kvprefetch_client.orders import Order
from tests.decide.test_scheduler import BLOCK_BYTES, advice, config, store_with


def tick(sched: Scheduler, advice_: Sequence[SessionAdvice], now: float) -> Plan:
    sched.advise(advice_, now)
    return sched.plan(now)


def prefetches(plan: Plan) -> list[Order]:
    return [o for o in plan.orders if o.kind == "prefetch"]


def delivered_scheduler(blocks: Sequence[int] = (0, 1, 2, 3)) -> tuple[Scheduler, Order]:
    """A scheduler whose prefetch of `blocks` to gpu-0 for session a completed, as a tier that
    never reports the blocks in HBM (LMCache loads into its own L1) reports it."""
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(100))
    sched = Scheduler(store, config())
    (order,) = prefetches(tick(sched, [advice("a", blocks)], 0.0))
    sched.on_progress(order.order_id, "accepted")
    sched.on_progress(order.order_id, "completed")
    return sched, order


def test_a_delivered_prefetch_is_not_ordered_again_while_it_stands() -> None:
    sched, _ = delivered_scheduler()
    # Ten ticks a second for 20 s, the advice refreshed as the scorer does: nothing again.
    for i in range(1, 200):
        assert prefetches(tick(sched, [advice("a", [0, 1, 2, 3])], i * 0.1)) == []
    assert sched.totals.orders["prefetch"] == 1


def test_blocks_the_engine_reports_gone_are_ordered_again() -> None:
    sched, _ = delivered_scheduler()
    observe = feedback_observer(sched, RouteTracker())
    observe(
        [
            KvBlocksRemoved(
                event_id="gone", ts=1.0, tier="hbm", instance_id="gpu-0", block_hashes=[2, 3]
            )
        ]
    )
    (again,) = prefetches(tick(sched, [advice("a", [0, 1, 2, 3])], 1.0))
    assert again.block_hashes == [2, 3]
    # Removed from another place: nothing of this delivery.
    sched2, _ = delivered_scheduler()
    sched2.blocks_removed("hbm", "gpu-1", [0, 1])
    sched2.blocks_removed("host", "gpu-0", [0, 1])
    assert prefetches(tick(sched2, [advice("a", [0, 1, 2, 3])], 1.0)) == []


def test_an_engine_that_cleared_its_cache_gets_the_blocks_again() -> None:
    sched, _ = delivered_scheduler()
    observe = feedback_observer(sched, RouteTracker())
    observe([KvBlocksCleared(event_id="clr", ts=1.0, tier="hbm", instance_id="gpu-0")])
    (again,) = prefetches(tick(sched, [advice("a", [0, 1, 2, 3])], 1.0))
    assert again.block_hashes == [0, 1, 2, 3]


def test_a_new_spell_of_the_session_is_ordered_afresh() -> None:
    sched, _ = delivered_scheduler()
    # The next turn grew the context: its advice is for another spell.
    (again,) = prefetches(tick(sched, [advice("a", [0, 1, 2, 3, 4])], 1.0))
    assert again.block_hashes == [0, 1, 2, 3, 4]


def test_advice_for_another_instance_ends_the_delivery_there() -> None:
    sched, _ = delivered_scheduler()
    sched.advise([advice("a", [0, 1, 2, 3], instance_id="gpu-1")], 1.0)
    (again,) = prefetches(tick(sched, [advice("a", [0, 1, 2, 3])], 2.0))
    assert again.block_hashes == [0, 1, 2, 3]


def test_a_session_back_or_closed_ends_the_delivery_for_it() -> None:
    sched, _ = delivered_scheduler()
    sched.forget("a", routed_to="gpu-0")
    (again,) = prefetches(tick(sched, [advice("a", [0, 1, 2, 3])], 1.0))
    assert again.block_hashes == [0, 1, 2, 3]


def test_a_delivery_stands_until_its_ttl() -> None:
    sched, order = delivered_scheduler()
    ttl = order.ttl_seconds
    assert ttl is not None
    assert prefetches(tick(sched, [advice("a", [0, 1, 2, 3])], ttl - 0.1)) == []
    (again,) = prefetches(tick(sched, [advice("a", [0, 1, 2, 3])], ttl + 0.1))
    assert again.block_hashes == [0, 1, 2, 3]


def test_a_shared_delivery_stands_while_any_session_it_served_is_advised_so() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(100))
    sched = Scheduler(store, config())
    both = [advice("a", [0, 1, 2]), advice("b", [0, 1, 2], p_soon=0.8)]
    (order,) = prefetches(tick(sched, both, 0.0))
    assert order.session_ids == ["a", "b"]
    sched.on_progress(order.order_id, "completed")
    sched.forget("a", routed_to="gpu-0")
    assert prefetches(tick(sched, [advice("b", [0, 1, 2], p_soon=0.8)], 1.0)) == []
    sched.forget("b")
    assert len(prefetches(tick(sched, [advice("c", [0, 1, 2])], 2.0))) == 1


def test_the_hand_over_carries_the_delivered_memory() -> None:
    sched, _ = delivered_scheduler()
    sched.take_over(1, sched.handover_state())  # its own state, through the hash's encoding
    nxt = Scheduler(sched.store, config())
    nxt.take_over(2, sched.handover_state())
    assert prefetches(tick(nxt, [advice("a", [0, 1, 2, 3])], 1.0)) == []
    # The delivery still ends as it would have: its spell changed.
    grown = advice("a", [0, 1, 2, 3, 4])
    assert len(prefetches(tick(nxt, [grown], 2.0))) == 1


def test_a_completion_for_a_spell_gone_by_is_not_remembered() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(100))
    sched = Scheduler(store, config())
    (order,) = prefetches(tick(sched, [advice("a", [0, 1])], 0.0))
    sched.on_progress(order.order_id, "accepted")
    # While it moved, the session had another turn somewhere else and is idle again.
    sched.advise([replace(advice("a", [0, 1, 5]), instance_id="gpu-0")], 0.5)
    sched.on_progress(order.order_id, "completed")
    (again,) = prefetches(sched.plan(1.0))
    assert again.block_hashes == [0, 1, 5]


def test_a_failing_order_is_retried_with_a_doubling_capped_backoff() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(100))
    sched = Scheduler(store, config(retry_backoff_seconds=1.0, retry_backoff_max_seconds=8.0))
    attempts = []
    for i in range(400):  # 40 s, ten ticks a second; every order fails at once
        now = i * 0.1
        for o in prefetches(tick(sched, [advice("a", [0, 1])], now)):
            attempts.append(round(now, 1))
            sched.on_progress(o.order_id, "failed")
    # Waits of 1, 2, 4, then 8 s (the cap) after each failure.
    assert attempts == [0.0, 1.0, 3.0, 7.0, 15.0, 23.0, 31.0, 39.0]


def test_a_backoff_is_per_session_and_destination_and_a_success_clears_it() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(100))
    sched = Scheduler(store, config())
    (failed,) = prefetches(tick(sched, [advice("a", [0, 1])], 0.0))
    sched.on_progress(failed.order_id, "failed")
    # Another session to the same destination, and the same session to another: ordered.
    plan = tick(sched, [advice("a", [0, 1]), advice("b", [5, 6], p_soon=0.8)], 0.1)
    assert [o.session_ids for o in prefetches(plan)] == [["b"]]
    (retried,) = prefetches(tick(sched, [advice("a", [0, 1])], 1.0))
    sched.on_progress(retried.order_id, "completed")
    sched.forget("a")  # its delivery gone with it, so the next order is up to the backoff
    (after,) = prefetches(tick(sched, [advice("a", [0, 1])], 1.1))
    assert after.block_hashes == [0, 1]


def test_a_started_order_given_up_overdue_backs_off_too() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(100))
    sched = Scheduler(store, config(overdue_seconds=5.0))
    (o,) = prefetches(tick(sched, [advice("a", [0, 1])], 0.0))
    sched.on_progress(o.order_id, "accepted")
    given_up_at = o.needed_by_ts + 5.0
    assert prefetches(tick(sched, [advice("a", [0, 1])], given_up_at)) == []
    assert sched.totals.failed == 1
    assert len(prefetches(tick(sched, [advice("a", [0, 1])], given_up_at + 1.0))) == 1


def test_the_hand_over_carries_the_backoffs() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(100))
    old = Scheduler(store, config())
    (o,) = prefetches(tick(old, [advice("a", [0, 1])], 0.0))
    old.on_progress(o.order_id, "failed")
    new = Scheduler(store, config())
    new.take_over(2, old.handover_state())
    assert prefetches(tick(new, [advice("a", [0, 1])], 0.5)) == []
    assert len(prefetches(tick(new, [advice("a", [0, 1])], 1.0))) == 1
