"""The scheduler: advice in, orders out, within links and room, never twice, withdrawn when
wrong."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

import pytest

from app.decide.advisor import SessionAdvice
from app.decide.dispatcher import feedback_observer
from app.decide.routing import RouteTracker
from app.decide.scheduler import TERM_GENERATIONS, Plan, Scheduler, SchedulerConfig
from app.state import MemoryStore
from kvprefetch_client.events import (
    Event,
    InstanceStatus,
    KvBlocksRemoved,
    KvBlocksStored,
    OrderProgress,
)
from kvprefetch_client.orders import Order

BLOCK_BYTES = 1_000_000
_ids = itertools.count()


def store_with(
    *,
    free_bytes: dict[str, int],
    pool: Sequence[int] = (),
    hbm: dict[str, Sequence[int]] | None = None,
    ts: float = 0.0,
) -> MemoryStore:
    store = MemoryStore(bytes_per_token=BLOCK_BYTES // 512, block_tokens=512)
    events: list = [
        InstanceStatus(event_id=f"e{next(_ids)}", ts=ts, instance_id=i, free_kv_bytes=b)
        for i, b in free_bytes.items()
    ]
    if pool:
        events.append(
            KvBlocksStored(
                event_id=f"e{next(_ids)}",
                ts=ts,
                tier="pool",
                instance_id=None,
                block_hashes=list(pool),
            )
        )
    for inst, blocks in (hbm or {}).items():
        events.append(
            KvBlocksStored(
                event_id=f"e{next(_ids)}",
                ts=ts,
                tier="hbm",
                instance_id=inst,
                block_hashes=list(blocks),
            )
        )
    store.apply(events)
    return store


def advice(
    session_id: str,
    blocks: Sequence[int],
    *,
    p_soon: float = 0.9,
    p_keep: float | None = None,
    instance_id: str = "gpu-0",
    retention: str = "lru",
) -> SessionAdvice:
    return SessionAdvice(
        session_id,
        instance_id,
        tuple(blocks),
        retention,  # type: ignore[arg-type]
        300.0 if retention == "keep" else 0.0,
        p_keep if p_keep is not None else p_soon,
        p_soon,
        max(p_soon, p_keep or 0.0),
        p_soon >= 0.5,
    )


def config(**kw: float) -> SchedulerConfig:
    return SchedulerConfig(bytes_per_block=BLOCK_BYTES, **kw)  # type: ignore[arg-type]


def tick(sched: Scheduler, advice_: Sequence[SessionAdvice], now: float) -> Plan:
    sched.advise(advice_, now)
    return sched.plan(now)


def prefetches(orders: Sequence[Order]) -> list[Order]:
    return [o for o in orders if o.kind == "prefetch"]


def test_a_shared_prefix_moves_once_and_serves_every_session() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(10))
    sched = Scheduler(store, config())
    plan = tick(
        sched,
        [
            advice("a", [0, 1, 2, 3], p_soon=0.9),
            advice("b", [0, 1, 2, 7], p_soon=0.8),
            advice("c", [0, 1, 2, 8], p_soon=0.7),
        ],
        100.0,
    )
    moved = [b for o in prefetches(plan.orders) for b in o.block_hashes]
    assert sorted(moved) == [0, 1, 2, 3, 7, 8]  # every block once
    first = next(o for o in plan.orders if 0 in o.block_hashes)
    assert first.session_ids == ["a", "b", "c"]
    solo = next(o for o in plan.orders if o.block_hashes == [7])
    assert first.priority > solo.priority  # the shared order is worth the sum of its sessions
    # Next tick: in flight, so not ordered again.
    again = tick(sched, [advice("a", [0, 1, 2, 3]), advice("b", [0, 1, 2, 7])], 100.1)
    assert prefetches(again.orders) == []


def test_blocks_already_there_or_nowhere_are_not_ordered() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=[1, 2], hbm={"gpu-0": [0]})
    plan = tick(Scheduler(store, config()), [advice("a", [0, 1, 2, 3])], 0.0)
    (order,) = prefetches(plan.orders)
    assert (order.block_hashes, order.source_tier, order.size_bytes) == (
        [1, 2],
        "pool",
        2 * BLOCK_BYTES,
    )


def test_host_blocks_come_over_the_host_link() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=[1, 2, 3])
    store.apply(
        [KvBlocksStored(event_id="h", ts=0.0, tier="host", instance_id="gpu-0", block_hashes=[2])]
    )
    plan = tick(Scheduler(store, config()), [advice("a", [1, 2, 3])], 0.0)
    assert {(o.source_tier, tuple(o.block_hashes)) for o in plan.orders} == {
        ("host", (2,)),
        ("pool", (1, 3)),
    }


def test_a_links_prefetch_share_is_never_exceeded() -> None:
    # 10 sessions x 20 blocks of 1 MB over a 100 MB/s link at half share: 50 MB/s, 0.4 s each.
    cfg = config(
        pool_link_bytes_per_second=100e6,
        link_share=0.5,
        lead_seconds=4.0,
        needed_within_fraction=0.5,
        margin_seconds=0.0,
    )
    store = store_with(free_bytes={"gpu-0": 10_000 * BLOCK_BYTES}, pool=range(200))
    sched = Scheduler(store, cfg)
    plan = tick(
        sched,
        [advice(f"s{i}", range(i * 20, i * 20 + 20), p_soon=0.9 - i * 0.01) for i in range(10)],
        now=0.0,
    )
    orders = prefetches(plan.orders)
    # Half the lead (needed_by = now + 2 s) at 50 MB/s is room for 5 orders of 20 MB.
    assert len(orders) == 5
    windows = sorted((o.start_by_ts, o.start_by_ts + o.size_bytes / 50e6) for o in orders)
    for (_, e1), (s2, _) in zip(windows, windows[1:]):
        assert s2 >= e1 - 1e-9  # back to back: never two at once at the share's rate
    assert all(
        end <= o.needed_by_ts + 1e-9
        for o, (_, end) in zip(sorted(orders, key=lambda o: o.start_by_ts), windows)
    )
    assert [o.session_ids[0] for o in sorted(orders, key=lambda o: -o.priority)] == [
        "s0",
        "s1",
        "s2",
        "s3",
        "s4",
    ]


def test_destination_room_is_never_exceeded_and_unknown_room_gets_nothing() -> None:
    store = store_with(free_bytes={"gpu-0": 5 * BLOCK_BYTES}, pool=range(100))
    sched = Scheduler(store, config())
    plan = tick(
        sched,
        [
            advice("a", range(4)),
            advice("b", range(10, 14), p_soon=0.8),
            advice("c", range(20, 24), instance_id="gpu-9"),
        ],
        0.0,
    )
    orders = prefetches(plan.orders)
    assert [o.session_ids for o in orders] == [["a"]]  # b does not fit; gpu-9 never said its room
    assert sched.inflight_bytes("gpu-0") == 4 * BLOCK_BYTES
    assert (
        prefetches(
            tick(
                sched, [advice("a", range(4)), advice("b", range(10, 14), p_soon=0.8)], now=0.1
            ).orders
        )
        == []
    )  # what is on its way counts against the room


def test_short_room_demotes_only_what_is_less_likely_back() -> None:
    store = store_with(free_bytes={"gpu-0": 0}, pool=range(100), hbm={"gpu-0": [50, 51, 60, 61]})
    plan = tick(
        Scheduler(store, config()),
        [
            advice("hot", [0, 1], p_soon=0.9),
            advice("cold", [50, 51], p_soon=0.0, p_keep=0.05),
            advice("warm", [60, 61], p_soon=0.0, p_keep=0.95),
        ],
        0.0,
    )
    kinds = {(o.kind, tuple(o.session_ids)) for o in plan.orders}
    assert kinds == {("demote", ("cold",)), ("prefetch", ("hot",))}


def test_unstarted_orders_are_cancelled_and_started_ones_land_and_waste_unless_used() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(10))
    sched = Scheduler(store, config(lead_seconds=30.0))
    plan = tick(sched, [advice("a", [0, 1]), advice("b", [5, 6])], 0.0)
    by_session = {o.session_ids[0]: o for o in prefetches(plan.orders)}
    sched.on_progress(by_session["b"].order_id, "accepted")
    # Both fall: a's session came back elsewhere, b's chance dropped.
    sched.forget("a", routed_to="gpu-1")
    later = tick(sched, [advice("b", [5, 6], p_soon=0.1)], 1.0)
    assert [c.order_id for c in later.cancels] == [by_session["a"].order_id]
    assert sched.totals.cancelled == 1
    assert sched.totals.bytes_wasted == 0  # b's runs on: wasted only if nothing uses it
    sched.on_progress(by_session["b"].order_id, "completed")
    sched.on_progress(by_session["b"].order_id, "completed")  # a duplicate completion: counted once
    sched.on_progress("never-issued", "completed")  # unknown: a no-op
    assert sched.totals.completed == 1 and sched.open_orders() == []
    assert (sched.totals.bytes_landed, sched.totals.bytes_waiting) == (2 * BLOCK_BYTES,) * 2
    sched.plan(31.0)  # its hold (the lead) is over, and no request used it
    assert (sched.totals.bytes_wasted, sched.totals.bytes_waiting) == (2 * BLOCK_BYTES, 0)


def test_a_small_dip_does_not_cancel() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(10))
    sched = Scheduler(store, config(cancel_below_p=0.25))
    tick(sched, [advice("a", [0, 1], p_soon=0.6)], 0.0)
    assert tick(sched, [advice("a", [0, 1], p_soon=0.3)], 1.0).cancels == []


def test_landed_blocks_retire_the_order_an_agent_took_and_withdraw_one_nobody_took() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(10))
    sched = Scheduler(store, config())
    (taken,) = tick(sched, [advice("a", [0, 1])], 0.0).orders
    (untouched,) = tick(sched, [advice("b", [2, 3])], 0.0).orders
    sched.on_progress(taken.order_id, "accepted")
    store.apply(
        [
            KvBlocksStored(
                event_id="landed",
                ts=1.0,
                tier="hbm",
                instance_id="gpu-0",
                block_hashes=[0, 1, 2, 3],
            )
        ]
    )
    plan = tick(sched, [], 1.0)
    assert sched.open_orders() == [] and sched.totals.completed == 1
    # b's blocks came by other means (a request loaded them): nothing of the order's doing.
    assert [c.order_id for c in plan.cancels] == [untouched.order_id]
    assert sched.totals.cancelled == 1


def test_a_landed_prefetch_is_used_only_as_far_as_it_is_still_there() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(10))
    sched = Scheduler(store, config())
    (order,) = tick(sched, [advice("a", [0, 1, 2, 3])], 0.0).orders
    sched.on_progress(order.order_id, "accepted")
    sched.on_progress(order.order_id, "completed")
    events: list[Event] = [
        KvBlocksStored(
            event_id="in", ts=1.0, tier="hbm", instance_id="gpu-0", block_hashes=[0, 1, 2, 3]
        ),
        KvBlocksRemoved(
            event_id="out", ts=2.0, tier="hbm", instance_id="gpu-0", block_hashes=[2, 3]
        ),
    ]
    store.apply(events)
    feedback_observer(sched, RouteTracker())(events)  # as the ingest tells it
    assert (sched.totals.bytes_wasted, sched.totals.bytes_waiting) == (2 * BLOCK_BYTES,) * 2
    sched.forget("a", routed_to="gpu-0")
    assert (sched.totals.bytes_used, sched.totals.bytes_wasted) == (
        2 * BLOCK_BYTES,
        2 * BLOCK_BYTES,
    )


def test_pins_follow_keep_advice_once_per_ttl_and_demotes_once_per_spell() -> None:
    store = store_with(free_bytes={"gpu-0": 0}, hbm={"gpu-0": [1, 2, 3]})
    sched = Scheduler(store, config())
    keep = advice("k", [1, 2, 9], p_soon=0.1, p_keep=0.6, retention="keep")
    drop = advice("d", [3], p_soon=0.0, p_keep=0.01, retention="demote")
    first = tick(sched, [keep, drop], 0.0)
    assert sorted((o.kind, tuple(o.block_hashes), o.ttl_seconds) for o in first.orders) == [
        ("demote", (3,), None),
        ("pin", (1, 2), 300.0),
    ]
    for o in first.orders:  # confirmed: a pin or demote nobody answers is ordered again
        sched.on_progress(o.order_id, "completed")
    assert tick(sched, [keep, drop], 10.0).orders == []
    assert [o.kind for o in tick(sched, [keep, drop], 296.0).orders] == ["pin"]  # about to lapse
    sched.forget("d")  # active again: its next idle spell is a new question
    assert [o.kind for o in tick(sched, [keep, drop], 301.0).orders] == ["demote"]


def test_orders_have_consistent_times_and_ids() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(10))
    plan = tick(Scheduler(store, config(lead_seconds=30.0)), [advice("a", [0, 1])], 50.0)
    (o,) = plan.orders
    assert (
        o.created_ts == 50.0 and o.needed_by_ts == 53.0 and 50.0 <= o.start_by_ts <= o.needed_by_ts
    )
    assert o.ttl_seconds == 30.0  # held through the lead it was fetched for (no keep advice)
    (kept,) = tick(
        Scheduler(store, config(lead_seconds=30.0)),
        [advice("k", [3, 4], p_keep=0.9, retention="keep")],
        50.0,
    ).orders
    assert (kept.kind, kept.ttl_seconds) == ("prefetch", 300.0)  # as long as it would be kept
    assert o.priority == pytest.approx(0.9 * min(2 * BLOCK_BYTES / 12.5e9, 2 * 512 / 20_000))


def test_progress_events_reach_the_scheduler_through_their_fields() -> None:
    # The service passes accepted OrderProgress events straight through.
    event = OrderProgress(event_id="p", ts=1.0, order_id="x", status="failed", reason="disk gone")
    sched = Scheduler(store_with(free_bytes={}), config())
    sched.on_progress(event.order_id, event.status)
    assert sched.totals.failed == 0  # not one of its orders


def test_a_cancelled_order_gives_its_link_time_back() -> None:
    cfg = config(
        pool_link_bytes_per_second=100e6,
        link_share=0.5,
        lead_seconds=4.0,
        needed_within_fraction=0.5,
        margin_seconds=0.0,
    )
    store = store_with(free_bytes={"gpu-0": 10_000 * BLOCK_BYTES}, pool=range(200))
    sched = Scheduler(store, cfg)
    # One order of 100 MB fills the link's share up to needed_by (2 s at 50 MB/s).
    first = tick(sched, [advice("big", range(100))], 0.0)
    assert len(prefetches(first.orders)) == 1
    assert (
        prefetches(
            tick(sched, [advice("big", range(100)), advice("x", range(100, 110))], 0.0).orders
        )
        == []
    )
    cancelled = tick(
        sched, [advice("big", range(100), p_soon=0.0), advice("x", range(100, 110))], 0.0
    )
    assert len(cancelled.cancels) == 1 and len(prefetches(cancelled.orders)) == 1


def test_advice_holds_between_pages_until_forgotten_or_stale() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(10))
    sched = Scheduler(store, config(), advice_ttl_seconds=60.0)
    tick(sched, [advice("a", [0, 1]), advice("b", [5])], 0.0)
    assert sched.tracked_sessions == 2
    assert (
        tick(sched, [advice("c", [7], p_soon=0.0)], 1.0).cancels == []
    )  # another page: a, b stand
    sched.forget("a", routed_to="gpu-0")
    assert (
        len(sched.plan(2.0).cancels) == 1
    )  # a's order: its session is back, its blocks load on demand
    assert sched.plan(61.5).cancels != [] and sched.tracked_sessions == 0  # b and c went stale


def test_a_new_turn_is_pinned_again() -> None:
    store = store_with(free_bytes={"gpu-0": 0}, hbm={"gpu-0": [1, 2, 3]})
    sched = Scheduler(store, config())
    assert [
        o.kind for o in tick(sched, [advice("k", [1, 2], p_keep=0.6, retention="keep")], 0.0).orders
    ] == ["pin"]
    grown = advice("k", [1, 2, 3], p_keep=0.6, retention="keep")  # the next turn, 40 s later
    (pin,) = tick(sched, [grown], 40.0).orders
    assert pin.block_hashes == [1, 2, 3]


def test_room_made_once_is_not_counted_twice() -> None:
    store = store_with(free_bytes={"gpu-0": 0}, pool=range(100), hbm={"gpu-0": [50, 51]})
    plan = tick(
        Scheduler(store, config()),
        [
            advice("x", [0, 1], p_soon=0.9),
            advice("y", [2, 3], p_soon=0.8),
            advice("cold", [50, 51], p_soon=0.0, p_keep=0.05),
        ],
        0.0,
    )
    assert [o.session_ids for o in prefetches(plan.orders)] == [["x"]]  # cold's two blocks fit one


def test_a_started_order_its_session_comes_back_to_is_used_not_wasted() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(10))
    sched = Scheduler(store, config())
    (order,) = tick(sched, [advice("a", [0, 1])], 0.0).orders
    sched.on_progress(order.order_id, "accepted")
    sched.forget("a", routed_to="gpu-0")
    assert sched.plan(1.0).cancels == [] and sched.totals.bytes_wasted == 0


def test_landed_prefetches_are_used_when_their_session_comes_back_there_else_unused() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(10))
    sched = Scheduler(store, config())
    orders = {
        o.session_ids[0]: o
        for o in tick(sched, [advice("a", [0, 1]), advice("b", [5]), advice("c", [7])], 0.0).orders
    }
    for o in orders.values():
        sched.on_progress(o.order_id, "completed")
    store.apply(
        [
            KvBlocksStored(
                event_id="a-in", ts=1.0, tier="hbm", instance_id="gpu-0", block_hashes=[0, 1]
            )
        ]
    )
    sched.forget("a", routed_to="gpu-0")  # back where its context waits
    sched.forget("b", routed_to="gpu-1")  # back elsewhere
    sched.forget("c")  # closed
    t = sched.totals
    # b's and c's wait for a request (another session's may use them) until their hold ends.
    assert (t.bytes_used, t.bytes_waiting, t.bytes_wasted) == (2 * BLOCK_BYTES, 2 * BLOCK_BYTES, 0)
    sched.forget("a", routed_to="gpu-0")  # a later turn: nothing counted twice
    assert sched.totals.bytes_used == 2 * BLOCK_BYTES
    sched.plan(1000.0)
    assert (t.bytes_used, t.bytes_wasted, t.bytes_unused) == (2 * BLOCK_BYTES,) * 3


def test_a_prefetch_its_session_met_while_moving_is_used_when_it_lands() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(10))
    sched = Scheduler(store, config())
    (o,) = tick(sched, [advice("a", [0, 1])], 0.0).orders
    sched.on_progress(o.order_id, "accepted")
    sched.forget("a", routed_to="gpu-0")
    sched.on_progress(o.order_id, "completed")
    assert (sched.totals.bytes_used, sched.totals.bytes_unused) == (2 * BLOCK_BYTES, 0)


def test_room_is_made_from_a_context_s_own_blocks_never_its_shared_head() -> None:
    store = store_with(free_bytes={"gpu-0": 0}, pool=range(100), hbm={"gpu-0": [50, 51, 52]})
    cold = replace(advice("cold", [50, 51, 52], p_soon=0.0, p_keep=0.05), shared_blocks=1)
    plan = tick(Scheduler(store, config()), [advice("hot", [0, 1], p_soon=0.9), cold], 0.0)
    (demote,) = [o for o in plan.orders if o.kind == "demote"]
    assert demote.block_hashes == [51, 52]  # block 50 is other sessions' too: it stays
    assert [o.block_hashes for o in prefetches(plan.orders)] == [[0, 1]]


def test_needed_by_follows_the_advice_s_arrival_curve() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(10))
    sched = Scheduler(store, config(lead_seconds=30.0, pool_link_bytes_per_second=1e6))
    transfer_seconds = 2 * BLOCK_BYTES / (1e6 * sched.config.link_share)
    (soon,) = tick(sched, [replace(advice("soon", [0, 1]), needed_in_seconds=20.0)], 50.0).orders
    assert soon.needed_by_ts == 70.0
    assert soon.start_by_ts == pytest.approx(70.0 - 0.25 - transfer_seconds)
    # Due sooner than it can land: it starts at once, and says when it can land.
    (now,) = tick(sched, [replace(advice("now", [2, 3]), needed_in_seconds=0.5)], 50.0).orders
    assert now.start_by_ts == 50.0
    assert now.needed_by_ts == pytest.approx(50.0 + transfer_seconds + 0.25)


def test_a_planner_taking_over_orders_nothing_its_predecessor_ordered() -> None:
    store = store_with(free_bytes={"gpu-0": 100 * BLOCK_BYTES}, pool=range(10), hbm={"gpu-0": [20]})
    old = Scheduler(store, config())
    old.take_over(1, {})
    moving = advice("a", [0, 1, 2])
    keep = advice("k", [20], p_soon=0.1, p_keep=0.6, retention="keep")
    first = tick(old, [moving, keep], 0.0)
    assert sorted(o.kind for o in first.orders) == ["pin", "prefetch"]
    assert all(o.order_id.endswith(f"-{TERM_GENERATIONS + 1}") for o in first.orders)

    new = Scheduler(store, config())
    assert new.take_over(2, old.handover_state()) == 1
    assert tick(new, [moving, keep], 1.0).orders == []  # open, and pinned: nothing again
    assert [e.order_id for e in new.open_orders()] == [o.order_id for o in prefetches(first.orders)]
    # Its completion, reported to the new planner, closes it there.
    (taken,) = prefetches(first.orders)
    new.on_progress(taken.order_id, "completed")
    assert new.open_orders() == []
    # A later order for the same blocks is the new term's: an id no sink has seen.
    new.forget("a")
    again = tick(new, [moving], 2.0)
    assert [o.order_id.rsplit("-", 1)[1] for o in again.orders] == [str(2 * TERM_GENERATIONS + 2)]


def test_an_unreadable_handover_entry_is_skipped() -> None:
    sched = Scheduler(store_with(free_bytes={"gpu-0": 0}), config())
    assert sched.take_over(3, {"o:x": "1{not json", "p:s": "[", "zz": "?"}) == 0
    assert sched.open_orders() == []


class _Counting(MemoryStore):
    """A memory store that counts the instance views its reads hand out."""

    views = 0

    def instances(self, **kw):
        out = super().instances(**kw)
        self.views += len(out)
        return out


def test_a_tick_reads_the_instances_it_may_send_to_not_the_fleet() -> None:
    store = _Counting(bytes_per_token=BLOCK_BYTES // 512, block_tokens=512)
    store.apply(
        [
            InstanceStatus(
                event_id=f"f{i}", ts=0.0, instance_id=f"gpu-{i}", free_kv_bytes=BLOCK_BYTES * 100
            )
            for i in range(2000)
        ]
        + [KvBlocksStored(event_id="p", ts=0.0, tier="pool", block_hashes=[1, 2])]
    )
    sched = Scheduler(store, config())
    idle = tick(sched, [], 1.0)
    assert (idle.orders, store.views) == ([], 0)
    plan = tick(sched, [advice("a", [1, 2], instance_id="gpu-7")], 2.0)
    assert [o.instance_id for o in prefetches(plan.orders)] == ["gpu-7"]
    assert store.views == 1


def test_a_full_destination_takes_a_likely_prefetch_by_its_own_eviction() -> None:
    """No free room and nothing advised there to demote: what the tier's LRU evicts next is
    content no advice keeps, so a candidate more likely back than keep_min_p may take it (up to
    the destination's KV bytes a tick); one less likely may not."""
    store = store_with(free_bytes={"gpu-0": 0}, pool=range(100), hbm={"gpu-0": [50, 51, 52]})
    store.apply(
        [
            InstanceStatus(
                event_id=f"e{next(_ids)}",
                ts=0.0,
                instance_id="gpu-0",
                free_kv_bytes=0,
                total_kv_bytes=3 * BLOCK_BYTES,
            )
        ]
    )
    sched = Scheduler(store, config(prefetch_min_p=0.1, keep_min_p=0.2))
    likely = advice("likely", [0, 1], p_soon=0.9)
    unlikely = replace(advice("unlikely", [10, 11], p_soon=0.15), prefetch=True)
    big = advice("big", [20, 21, 22], p_soon=0.8)
    plan = tick(sched, [likely, unlikely, big], 0.0)
    # likely fits in the tier's eviction; big would pass the destination's KV bytes this tick.
    assert [o.session_ids for o in prefetches(plan.orders)] == [["likely"]]
    assert not [o for o in plan.orders if o.kind == "demote"]  # the tier evicts: nothing named


def test_a_spread_router_s_candidate_is_judged_on_its_chance_of_coming_back_at_all() -> None:
    """p_soon 0.225 at the last instance (0.9 back within the lead, a quarter of returns land
    there): ordered into free room, and not cancelled as if its chance had fallen."""
    store = store_with(free_bytes={"gpu-0": 10 * BLOCK_BYTES}, pool=range(100))
    sched = Scheduler(store, config(prefetch_min_p=0.35, cancel_below_p=0.25))
    spread = replace(advice("s", [0, 1], p_soon=0.225), prefetch=True, p_routed=0.25)
    plan = tick(sched, [spread], 0.0)
    assert [o.session_ids for o in prefetches(plan.orders)] == [["s"]]
    again = tick(sched, [spread], 0.1)
    assert again.cancels == [] and sched.inflight_bytes("gpu-0") == 2 * BLOCK_BYTES


def test_withdrawing_an_instances_demotes_alone_leaves_its_pins_and_pin_advice() -> None:
    """The guard turned gpu-0's demotes off (they cost more than their room kept): its demote is
    cancelled and its demote advice not yet acted on dropped; its pin, and pin advice not yet
    acted on, stand."""
    store = store_with(free_bytes={"gpu-0": 0}, hbm={"gpu-0": [1, 2, 3, 5, 6]})
    sched = Scheduler(store, config())
    keep = advice("k", [1, 2], p_soon=0.1, p_keep=0.6, retention="keep")
    drop = advice("d", [3], p_soon=0.0, p_keep=0.01, retention="demote")
    first = tick(sched, [keep, drop], 0.0)
    ids = {o.kind: o.order_id for o in first.orders}
    for order_id in ids.values():
        sched.on_progress(order_id, "completed")
    later_keep = advice("k2", [5], p_soon=0.1, p_keep=0.6, retention="keep")
    later_drop = advice("d2", [6], p_soon=0.0, p_keep=0.01, retention="demote")
    sched.advise([later_keep, later_drop], 5.0)  # advised, not acted on yet
    withdrawn = sched.withdraw("gpu-0", 10.0, kinds=("demote",))
    plan = sched.plan(10.0)
    assert [c.order_id for c in plan.cancels] == [ids["demote"]] and withdrawn == plan.cancels
    assert [(o.kind, o.session_ids) for o in plan.orders] == [("pin", ["k2"])]
    assert sched.book.pins_held == 1


def test_withdrawing_an_instance_cancels_its_pins_and_demotes_once_and_forgets_them() -> None:
    """The LRU guard turned gpu-0's advice off: its pin (confirmed) and demote (not yet) are
    cancelled with the next plan; gpu-1's pin, and what gpu-0 advice had not been acted on, are
    left alone or dropped, never cancelled."""
    store = store_with(free_bytes={"gpu-0": 0, "gpu-1": 0}, hbm={"gpu-0": [1, 2, 3], "gpu-1": [4]})
    sched = Scheduler(store, config())
    keep = advice("k", [1, 2], p_soon=0.1, p_keep=0.6, retention="keep")
    drop = advice("d", [3], p_soon=0.0, p_keep=0.01, retention="demote")
    other = advice("o", [4], p_soon=0.1, p_keep=0.6, retention="keep", instance_id="gpu-1")
    first = tick(sched, [keep, drop, other], 0.0)
    ids = {(o.kind, o.instance_id): o.order_id for o in first.orders}
    sched.on_progress(ids[("pin", "gpu-0")], "completed")
    sched.on_progress(ids[("pin", "gpu-1")], "completed")
    late = advice("late", [2], p_soon=0.1, p_keep=0.6, retention="keep")
    sched.advise([late], 5.0)  # advised, not acted on yet
    withdrawn = sched.withdraw("gpu-0", 10.0)
    plan = sched.plan(10.0)
    assert sorted(c.order_id for c in plan.cancels) == sorted(
        [ids[("pin", "gpu-0")], ids[("demote", "gpu-0")]]
    )
    assert withdrawn == plan.cancels and plan.orders == []
    assert sched.plan(11.0).cancels == []  # once
    sched.on_progress(ids[("demote", "gpu-0")], "completed")  # its news no longer matters
    assert sched.book.pins_held == 1  # gpu-1's
    assert sorted(f for f in sched.handover_state() if f[0] in "pd") == ["p:o"]
    # Back on (trial): decided again, as if never ordered.
    again = tick(sched, [keep, drop], 20.0)
    assert sorted((o.kind, o.instance_id) for o in again.orders) == [
        ("demote", "gpu-0"),
        ("pin", "gpu-0"),
    ]


def crowd(store: MemoryStore, instance_id: str, queued: int, total_blocks: int, ts: float) -> None:
    """The instance reports `queued` calls waiting and its KV size."""
    store.apply(
        [
            InstanceStatus(
                event_id=f"e{next(_ids)}",
                ts=ts,
                instance_id=instance_id,
                free_kv_bytes=0,
                total_kv_bytes=total_blocks * BLOCK_BYTES,
                queue_depth=queued,
            )
        ]
    )


def test_where_pins_hold_room_a_pin_is_priced_against_the_calls_waiting_for_it() -> None:
    """A 2-block context pinned for 300 s on a 10-block instance: with calls waiting it would
    keep each from a fifth of the room for five minutes, far more than the reload it saves
    (chance 0.6 of a fraction of a second): not pinned, and a pin held from before the queue
    formed is released. Nothing waiting, or pins that do not hold room: pinned as before."""
    keep = advice("k", [1, 2], p_soon=0.1, p_keep=0.6, retention="keep")
    for hold_room, queued, pinned in ((True, 0, True), (True, 2, False), (False, 2, True)):
        store = store_with(free_bytes={"gpu-0": 0}, hbm={"gpu-0": [1, 2]})
        crowd(store, "gpu-0", queued, 10, ts=0.0)
        sched = Scheduler(store, config(pins_hold_room=hold_room))
        plan = tick(sched, [keep], 0.0)
        assert [o.kind for o in plan.orders] == (["pin"] if pinned else []), (hold_room, queued)
    store = store_with(free_bytes={"gpu-0": 0}, hbm={"gpu-0": [1, 2]})
    crowd(store, "gpu-0", 0, 10, ts=0.0)
    sched = Scheduler(store, config(pins_hold_room=True))
    [pin] = tick(sched, [keep], 0.0).orders
    sched.on_progress(pin.order_id, "completed")
    crowd(store, "gpu-0", 3, 10, ts=1.0)  # a queue forms behind it
    plan = sched.plan(1.0)
    assert [c.order_id for c in plan.cancels] == [pin.order_id]
    assert sched.plan(2.0).cancels == []  # once


def test_where_pins_hold_room_a_prefetch_is_held_through_its_lead_alone() -> None:
    for hold_room, held in ((False, 300.0), (True, 30.0)):
        store = store_with(free_bytes={"gpu-0": 10 * BLOCK_BYTES}, pool=range(10))
        sched = Scheduler(store, config(pins_hold_room=hold_room, lead_seconds=30.0))
        cand = replace(advice("s", [0, 1], p_keep=0.6, retention="keep"), prefetch=True)
        [order] = prefetches(tick(sched, [cand], 0.0).orders)
        assert order.ttl_seconds == held


def test_a_pin_of_a_context_whose_tool_call_outlasts_its_reload_is_not_worth_a_queue() -> None:
    """Holding against reloading, priced: a pin just worth the calls waiting for its room when
    the session may be back at any moment is worth nothing when its tool call (runs of 100 s and
    more, 1 s in) will outlast a reload started now: the context can leave and come back before
    the call returns. A call just started that returns within the reload (a fraction of a
    millisecond for two blocks here) keeps its pin."""
    from app.predict.tool_durations import ToolDurations
    from kvprefetch_client.events import SessionSignal

    def signal(session: str, ts: float, kind: str, tool: str) -> SessionSignal:
        return SessionSignal(
            event_id=f"{session}-{kind}-{ts}", ts=ts, session_id=session, kind=kind, tool=tool
        )

    tools = ToolDurations()
    for k in range(20):
        for tool, seconds in (("build", 100.0 + k), ("echo", 1e-5)):
            tools.observe([signal(f"{tool}{k}", 10.0 * k, "tool_started", tool)])
            tools.observe([signal(f"{tool}{k}", 10.0 * k + seconds, "tool_finished", tool)])
    keep = advice("k", [1, 2], p_soon=0.1, p_keep=0.6, retention="keep")
    reload_seconds = Scheduler(store_with(free_bytes={}), config()).room.stall_avoided(
        "pool", 2, 2 * BLOCK_BYTES
    )
    # One call waiting on an instance this large: the pin holds it 1/2 of the reload it saves.
    total_blocks = round(2 * 300.0 / (0.6 * reload_seconds / 2))
    for tool, since, pinned in ((None, 0.0, True), ("build", 999.0, False), ("echo", 1000.0, True)):
        if tool is not None:
            tools.observe([signal("k", since, "tool_started", tool)])
            assert tools.outlooks((reload_seconds,), 1000.0, ["k"]), tool
        store = store_with(free_bytes={"gpu-0": 0}, hbm={"gpu-0": [1, 2]})
        crowd(store, "gpu-0", 1, total_blocks, ts=0.0)
        sched = Scheduler(store, config(pins_hold_room=True), tools=tools)
        plan = tick(sched, [keep], 1000.0)
        assert [o.kind for o in plan.orders] == (["pin"] if pinned else []), tool
        if tool is not None:
            tools.observe([signal("k", 1000.5, "tool_finished", tool)])


def test_a_pin_is_released_when_its_session_is_back_or_closed_but_not_when_advice_expires() -> None:
    """Where pins hold room, a pin holds a context for its session's return: once the session
    is routed (wherever it lands: the engine holds what a running request uses) or closed, the
    next plan cancels it, rather than leave it to hold the room for its TTL. Advice that merely
    expires leaves the pin to its TTL; so does every return where pins are soft."""
    for back, hold_room in (
        ("here", True),
        ("elsewhere", True),
        ("closed", True),
        ("expired", True),
        ("elsewhere", False),
    ):
        store = store_with(free_bytes={"gpu-0": 0}, hbm={"gpu-0": [1, 2]})
        sched = Scheduler(store, config(pins_hold_room=hold_room), advice_ttl_seconds=60.0)
        keep = advice("k", [1, 2], p_soon=0.1, p_keep=0.6, retention="keep")
        [pin] = tick(sched, [keep], 0.0).orders
        sched.on_progress(pin.order_id, "completed")
        if back == "expired":
            plan = sched.plan(100.0)
        else:
            routed_to = {"here": "gpu-0", "elsewhere": "gpu-1", "closed": None}[back]
            sched.forget("k", routed_to=routed_to)
            plan = sched.plan(1.0)
        released = [c.order_id for c in plan.cancels]
        assert released == ([pin.order_id] if hold_room and back != "expired" else []), back
        assert sched.plan(2.0).cancels == []  # once
