"""The order book: every order tracked to its outcome. A delivered prefetch is not ordered again
while it stands; failed orders come back with backoff; pins are held once confirmed; every landed
byte ends used, wasted or still waiting; the hand-over carries all of it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import orjson

from app.decide.advisor import SessionAdvice
from app.decide.dispatcher import feedback_observer
from app.decide.routing import RouteTracker
from app.decide.scheduler import Plan, Scheduler
from kvprefetch_client.events import (
    KvBlocksCleared,
    KvBlocksRemoved,
    KvBlocksStored,
    RequestRouted,
    VllmKvEvents,
)
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


def test_blocks_a_vllm_batch_removes_are_ordered_again() -> None:
    sched, _ = delivered_scheduler()
    observe = feedback_observer(sched, RouteTracker())
    assert sched.holds_landed
    batch = VllmKvEvents(
        event_id="v1",
        ts=1.0,
        instance_id="gpu-0",
        events=[{"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}],  # type: ignore[list-item]
    )
    observe([batch])
    (again,) = prefetches(tick(sched, [advice("a", [0, 1, 2, 3])], 1.0))
    assert again.block_hashes == [3]
    # With nothing landed anywhere, a batch is not expanded at all: nothing could change.
    idle = Scheduler(store_with(free_bytes={"gpu-0": BLOCK_BYTES}), config())
    assert not idle.holds_landed


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


def keep(session_id: str = "k", blocks: Sequence[int] = (1, 2)) -> SessionAdvice:
    return advice(session_id, blocks, p_soon=0.1, p_keep=0.6, retention="keep")


def pinning_scheduler(**kw: float) -> Scheduler:
    store = store_with(free_bytes={"gpu-0": 0}, hbm={"gpu-0": [1, 2, 3]})
    return Scheduler(store, config(**kw))


def pins(plan: Plan) -> list[Order]:
    return [o for o in plan.orders if o.kind == "pin"]


def test_a_pin_is_held_only_once_confirmed_and_not_ordered_again_meanwhile() -> None:
    sched = pinning_scheduler()
    (pin,) = pins(tick(sched, [keep()], 0.0))
    assert (sched.book.pins_pending, sched.book.pins_held) == (1, 0)
    assert pins(tick(sched, [keep()], 1.0)) == []  # on its way
    sched.on_progress(pin.order_id, "accepted")
    sched.on_progress(pin.order_id, "completed")
    assert (sched.book.pins_pending, sched.book.pins_held) == (0, 1)
    assert pins(tick(sched, [keep()], 100.0)) == []


def test_a_failed_pin_is_ordered_again_after_its_backoff_without_new_advice() -> None:
    sched = pinning_scheduler()
    (pin,) = pins(tick(sched, [keep()], 0.0))
    sched.on_progress(pin.order_id, "failed")
    assert sched.book.pins_pending == 0
    assert pins(tick(sched, [keep()], 0.5)) == []  # re-advised, but backing off
    (again,) = pins(sched.plan(1.0))  # due: decided again from the advice held
    assert again.block_hashes == [1, 2] and again.order_id != pin.order_id
    sched.on_progress(again.order_id, "failed")
    assert pins(sched.plan(2.5)) == []  # twice in a row: 2 s
    assert len(pins(sched.plan(3.0))) == 1


def test_a_pin_nobody_answers_is_given_up_and_ordered_again() -> None:
    sched = pinning_scheduler(overdue_seconds=10.0)
    (pin,) = pins(tick(sched, [keep()], 0.0))
    assert pins(sched.plan(9.9)) == []
    assert pins(sched.plan(10.0)) == []  # given up now; its backoff starts
    (again,) = pins(sched.plan(11.0))
    # A late completion of the first is news of an order replaced: it confirms nothing.
    sched.on_progress(pin.order_id, "completed")
    assert sched.book.pins_held == 0
    sched.on_progress(again.order_id, "completed")
    assert sched.book.pins_held == 1


def test_a_confirmed_pin_its_tier_lost_is_ordered_again_at_the_next_tick() -> None:
    sched = pinning_scheduler()
    (pin,) = pins(tick(sched, [keep()], 0.0))
    sched.on_progress(pin.order_id, "completed")
    sched.on_progress(pin.order_id, "failed")  # the LMCache sink: its coordinator restarted
    assert (sched.book.pins_held, sched.book.pins_lost) == (0, 1)
    (again,) = pins(sched.plan(0.1))
    assert again.block_hashes == [1, 2]


def test_a_failed_demote_is_ordered_again_after_its_backoff() -> None:
    sched = pinning_scheduler()
    drop = advice("d", [3], p_soon=0.0, p_keep=0.01, retention="demote")
    (demote,) = tick(sched, [drop], 0.0).orders
    assert tick(sched, [drop], 0.5).orders == []  # on its way
    sched.on_progress(demote.order_id, "failed")
    assert tick(sched, [drop], 0.6).orders == []
    assert [o.kind for o in sched.plan(1.6).orders] == ["demote"]


def test_the_hand_over_carries_the_pins_state() -> None:
    old = pinning_scheduler()
    (pin,) = pins(tick(old, [keep()], 0.0))
    new = pinning_scheduler()
    new.take_over(2, old.handover_state())
    assert new.book.pins_pending == 1
    assert pins(tick(new, [keep()], 1.0)) == []  # on its way, as the old planner knew
    new.on_progress(pin.order_id, "completed")  # reported to the planner now in charge
    assert new.book.pins_held == 1
    nxt = pinning_scheduler()
    nxt.take_over(3, new.handover_state())
    nxt.on_progress(pin.order_id, "failed")  # lost, as a confirmed pin
    assert len(pins(tick(nxt, [keep()], 2.0))) == 1


def test_an_older_planners_pin_entries_are_read_as_confirmed() -> None:
    sched = pinning_scheduler()
    spell = ["gpu-0", "k", 2, 2]
    sched.take_over(
        1, {"p:k": orjson.dumps([spell, 300.0]).decode(), "d:d": orjson.dumps(spell).decode()}
    )
    assert sched.book.pins_held == 1
    assert pins(tick(sched, [keep()], 1.0)) == []


def balanced(sched: Scheduler) -> bool:
    t = sched.totals
    return t.bytes_used + t.bytes_wasted + t.bytes_waiting == t.bytes_landed


def test_landed_bytes_evicted_before_a_request_used_them_are_wasted() -> None:
    sched, _ = delivered_scheduler([0, 1, 2, 3])
    t = sched.totals
    assert (t.bytes_landed, t.bytes_waiting) == (4 * BLOCK_BYTES, 4 * BLOCK_BYTES)
    observe = feedback_observer(sched, RouteTracker())
    observe(
        [
            KvBlocksRemoved(
                event_id="evicted", ts=1.0, tier="hbm", instance_id="gpu-0", block_hashes=[3]
            )
        ]
    )
    assert (t.bytes_wasted, t.bytes_waiting) == (BLOCK_BYTES, 3 * BLOCK_BYTES)
    # A request names the blocks it reuses: those still there are used, once.
    observe([routed("a", "gpu-0", [0, 1, 2, 3, 9])])
    assert (t.bytes_used, t.bytes_wasted, t.bytes_waiting) == (3 * BLOCK_BYTES, BLOCK_BYTES, 0)
    observe([routed("b", "gpu-0", [0, 1, 2], event_id="r2")])
    assert t.bytes_used == 3 * BLOCK_BYTES and balanced(sched)


def routed(
    session_id: str, instance_id: str, blocks: Sequence[int] | None, event_id: str = "r1"
) -> RequestRouted:
    return RequestRouted(
        event_id=event_id,
        ts=1.0,
        session_id=session_id,
        request_id=f"q-{event_id}",
        instance_id=instance_id,
        prompt_tokens=100,
        block_hashes=None if blocks is None else list(blocks),
    )


def test_a_request_of_another_session_uses_landed_blocks_it_names_there_only() -> None:
    sched, _ = delivered_scheduler([0, 1, 2, 3])
    observe = feedback_observer(sched, RouteTracker())
    observe([routed("other", "gpu-1", [0, 1])])  # another instance: nothing of it
    assert sched.totals.bytes_used == 0
    observe([routed("other", "gpu-0", [0, 1], event_id="r2")])  # a shared prefix, there
    assert (sched.totals.bytes_used, sched.totals.bytes_waiting) == (2 * BLOCK_BYTES,) * 2
    # Its own session back, with a router that names no blocks: the rest of its landing.
    observe([routed("a", "gpu-0", None, event_id="r3")])
    assert (sched.totals.bytes_used, sched.totals.bytes_waiting) == (4 * BLOCK_BYTES, 0)


def test_landed_bytes_nobody_used_within_their_hold_are_wasted() -> None:
    sched, order = delivered_scheduler([0, 1])
    assert order.ttl_seconds is not None
    sched.forget("a", routed_to="gpu-1")  # back elsewhere: they wait for any request there
    sched.plan(order.ttl_seconds - 0.1)
    assert (sched.totals.bytes_wasted, sched.totals.bytes_waiting) == (0, 2 * BLOCK_BYTES)
    sched.plan(order.ttl_seconds)
    assert (sched.totals.bytes_wasted, sched.totals.bytes_waiting) == (2 * BLOCK_BYTES, 0)
    assert balanced(sched)


def test_landed_bytes_demoted_before_use_are_wasted() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(100))
    sched = Scheduler(store, config())
    (order,) = prefetches(tick(sched, [advice("a", [0, 1])], 0.0))
    sched.on_progress(order.order_id, "completed")
    store.apply(
        [
            KvBlocksStored(
                event_id="in", ts=1.0, tier="hbm", instance_id="gpu-0", block_hashes=[0, 1]
            )
        ]
    )
    # The planner changes its mind: a demote of the context, while its landing still waits.
    drop = advice("a", [0, 1], p_soon=0.0, p_keep=0.01, retention="demote")
    (demote,) = tick(sched, [drop], 2.0).orders
    assert demote.kind == "demote"
    assert (sched.totals.bytes_wasted, sched.totals.bytes_waiting) == (2 * BLOCK_BYTES, 0)
    assert balanced(sched)


def test_a_started_order_whose_sessions_fell_lands_and_counts_as_any() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(100))
    sched = Scheduler(store, config())
    (order,) = prefetches(tick(sched, [advice("a", [0, 1])], 0.0))
    sched.on_progress(order.order_id, "accepted")
    sched.forget("a")  # closed while it moved
    assert sched.plan(1.0).cancels == [] and sched.totals.bytes_wasted == 0
    sched.on_progress(order.order_id, "completed")
    assert sched.totals.bytes_waiting == 2 * BLOCK_BYTES
    feedback_observer(sched, RouteTracker())([routed("z", "gpu-0", [0, 1])])
    assert (sched.totals.bytes_used, sched.totals.bytes_wasted) == (2 * BLOCK_BYTES, 0)


def test_the_hand_over_carries_what_stands_and_each_replica_keeps_its_own_accounting() -> None:
    sched, _ = delivered_scheduler([0, 1])
    nxt = Scheduler(sched.store, config())
    nxt.take_over(2, sched.handover_state())
    assert prefetches(tick(nxt, [advice("a", [0, 1])], 1.0)) == []  # delivered: stands there
    assert nxt.totals.bytes_landed == 0  # landed by the other planner: counted there
    nxt.blocks_removed("hbm", "gpu-0", [0, 1])
    assert nxt.totals.bytes_wasted == 0 and balanced(nxt)
    (again,) = prefetches(tick(nxt, [advice("a", [0, 1])], 2.0))
    assert again.block_hashes == [0, 1]
    # The old planner taking over again keeps counting its own landing.
    sched.take_over(3, nxt.handover_state())
    sched.blocks_removed("hbm", "gpu-0", [0, 1])
    assert sched.totals.bytes_wasted == 2 * BLOCK_BYTES and balanced(sched)


def test_a_landed_block_past_the_first_one_a_request_misses_is_not_used_by_it() -> None:
    # Blocks 0 and 1 were in HBM; 2 and 3 landed. The engine then evicted block 1.
    store = store_with(
        free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(100), hbm={"gpu-0": [0, 1]}
    )
    sched = Scheduler(store, config())
    (order,) = prefetches(tick(sched, [advice("a", [0, 1, 2, 3])], 0.0))
    assert order.block_hashes == [2, 3]
    sched.on_progress(order.order_id, "completed", 2 * BLOCK_BYTES)
    evicted = KvBlocksRemoved(
        event_id="out", ts=1.0, tier="hbm", instance_id="gpu-0", block_hashes=[1]
    )
    store.apply([evicted])
    observe = feedback_observer(sched, RouteTracker())
    observe([evicted, routed("a", "gpu-0", [0, 1, 2, 3])])
    # A prefix cache stops at block 1: 2 and 3 are loaded again, not reused.
    assert (sched.totals.bytes_used, sched.totals.bytes_waiting) == (0, 2 * BLOCK_BYTES)


def test_landed_bytes_are_what_the_completion_reports_moved() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(100))
    sched = Scheduler(store, config())
    (half, nothing) = prefetches(tick(sched, [advice("a", [0, 1]), advice("b", [5, 6])], 0.0))
    sched.on_progress(half.order_id, "completed", BLOCK_BYTES)  # one block's worth moved
    sched.on_progress(nothing.order_id, "completed", 0)  # there already: nothing moved
    t = sched.totals
    assert (t.bytes_landed, t.bytes_waiting) == (BLOCK_BYTES, BLOCK_BYTES)
    sched.blocks_removed("hbm", "gpu-0", [0, 1, 5, 6])
    assert (t.bytes_wasted, t.bytes_waiting) == (BLOCK_BYTES, 0) and balanced(sched)
