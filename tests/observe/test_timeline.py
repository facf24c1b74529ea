"""The dashboard's timeline: snapshots in a ring, series with a recent hit rate that never spans
two models, and the stall figures with their basis."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from app.core.clock import ManualClock
from app.decide.advisor import SessionAdvice
from app.decide.scheduler import Scheduler, SchedulerConfig
from app.observe.ledger import AdviceLedger
from app.observe.timeline import (
    DEFAULT_CAPACITY,
    HISTORY_SECONDS,
    MAX_CAPACITY,
    LandedPrefetches,
    MeasuredStall,
    StallFigures,
    Timeline,
    capacity_for,
    instance_queues,
    series,
)
from app.state.memory import MemoryStore
from kvprefetch_client.events import InstanceStatus, KvBlocksStored, OrderProgress, RequestRouted

BLOCK_BYTES = 512 * 327_680


def _models(version: str | None = "v1", shadow: str | None = None) -> Any:
    return SimpleNamespace(
        serving=SimpleNamespace(version=version),
        shadow=SimpleNamespace(version=shadow) if shadow else None,
    )


def _advice(session: str, retention: str = "keep", instance: str = "gpu-0") -> SessionAdvice:
    return SessionAdvice(
        session,
        instance,
        (1, 2),
        retention,
        300.0,
        0.9,
        0.9,
        0.9,
        False,  # type: ignore[arg-type]
    )


def _routed(n: int, session: str, ts: float) -> RequestRouted:
    return RequestRouted(
        event_id=f"q{n}",
        ts=ts,
        session_id=session,
        request_id=f"r{n}",
        instance_id="gpu-0",
        prompt_tokens=100,
    )


@pytest.fixture
def parts() -> tuple[AdviceLedger, Scheduler, ManualClock]:
    store = MemoryStore(bytes_per_token=327_680, block_tokens=512)
    return (
        AdviceLedger(),
        Scheduler(store, SchedulerConfig(bytes_per_block=BLOCK_BYTES)),
        ManualClock(0.0),
    )


def test_the_ring_keeps_the_newest_snapshots(
    parts: tuple[AdviceLedger, Scheduler, ManualClock],
) -> None:
    ledger, scheduler, clock = parts
    timeline = Timeline(ledger, scheduler, _models(), clock, capacity=3)
    for _ in range(5):
        timeline.sample()
        clock.advance(1.0)
    assert len(timeline) == 3
    assert [s.ts for s in timeline.since(0.0)] == [2.0, 3.0, 4.0]
    assert [s.ts for s in timeline.since(3.0)] == [3.0, 4.0]
    assert timeline.since(10.0) == []
    with pytest.raises(ValueError):
        Timeline(ledger, scheduler, _models(), clock, capacity=0)


def test_capacity_covers_the_history_at_the_interval() -> None:
    assert capacity_for(2.0) == HISTORY_SECONDS / 2.0
    assert capacity_for(0.0) == DEFAULT_CAPACITY  # sampling by hand
    assert capacity_for(0.001) == MAX_CAPACITY
    assert capacity_for(10_000.0) == 1


def test_the_recent_hit_rate_counts_the_last_window_and_restarts_with_a_new_model(
    parts: tuple[AdviceLedger, Scheduler, ManualClock],
) -> None:
    ledger, scheduler, clock = parts
    models = _models("v1")
    timeline = Timeline(ledger, scheduler, models, clock)
    n = 0

    def arrive(retention: str) -> None:
        nonlocal n
        n += 1
        ledger.record("live", [_advice(f"s{n}", retention)], clock.now())
        ledger.observe([_routed(n, f"s{n}", clock.now())])

    # t=0..50: every request a hit; t=60..110: every one a miss (10 s apart, one request each).
    for k in range(12):
        arrive("keep" if k < 6 else "demote")
        timeline.sample()
        clock.advance(10.0)
    body = series(timeline, 600.0, window=30.0)
    s = body["series"]
    assert s["live_hit_rate"][5] == 1.0 and s["live_hit_rate"][11] == 0.5  # since the model came in
    # Over the 30 s before each point: (t-30, t], so the three requests at t-20, t-10 and t.
    assert s["live_recent_hit_rate"][5] == 1.0
    assert s["live_recent_hit_rate"][7] == pytest.approx(1 / 3)
    assert s["live_recent_hit_rate"][11] == 0.0
    assert s["live_recent_hit_rate"][0] == 1.0  # less than a window of history: since the start

    # A new model in the slot: its counts start afresh, and so does its recent rate.
    models.serving = SimpleNamespace(version="v2")
    ledger.start("live")
    arrive("keep")
    timeline.sample()
    s = series(timeline, 600.0, window=30.0)["series"]
    assert s["live_version"][-2:] == ["v1", "v2"]
    assert s["live_hits"][-1] == 1 and s["live_recent_hit_rate"][-1] == 1.0


def test_a_short_range_still_gets_a_whole_window_for_its_first_point(
    parts: tuple[AdviceLedger, Scheduler, ManualClock],
) -> None:
    ledger, scheduler, clock = parts
    timeline = Timeline(ledger, scheduler, _models(), clock)
    for k in range(10):
        ledger.record("live", [_advice(f"s{k}", "keep" if k < 5 else "lru")], clock.now())
        ledger.observe([_routed(k, f"s{k}", clock.now())])
        timeline.sample()
        clock.advance(10.0)
    # now = 100; the last 20 s hold the samples at 80 and 90, each over (t-30, t].
    body = series(timeline, 20.0, window=30.0)
    assert body["ts"] == [80.0, 90.0]
    assert body["series"]["live_recent_hit_rate"] == [0.0, 0.0]
    assert body["series"]["live_hit_rate"] == [5 / 9, 0.5]


def test_landed_prefetches_count_each_completed_prefetch_once(
    parts: tuple[AdviceLedger, Scheduler, ManualClock],
) -> None:
    _, scheduler, _ = parts
    store = scheduler.store
    from kvprefetch_client.events import InstanceStatus, KvBlocksStored

    store.apply(
        [
            KvBlocksStored(event_id="p", ts=0.0, tier="pool", block_hashes=[1, 2]),
            InstanceStatus(event_id="st", ts=0.0, instance_id="gpu-0", free_kv_bytes=10**12),
        ]
    )
    scheduler.advise([SessionAdvice("s", "gpu-0", (1, 2), "lru", 0.0, 0.9, 0.9, 0.9, True)], 1.0)
    (order,) = scheduler.plan(1.0).orders
    landed = LandedPrefetches(scheduler)

    def done(event_id: str, order_id: str, nbytes: int | None = 10) -> OrderProgress:
        return OrderProgress(
            event_id=event_id,
            ts=2.0,
            order_id=order_id,
            status="completed",
            bytes=nbytes,
            seconds=0.25,
        )

    landed.observe(
        [done("a", order.order_id), done("b", order.order_id), done("c", "pin-unknown-1")]
    )
    assert (landed.orders, landed.bytes, landed.transfer_seconds) == (1, 10, 0.25)
    assert landed.expected_stall_seconds == pytest.approx(order.priority) and order.priority > 0
    assert landed.stall() == StallFigures(order.priority, "expected")


def test_the_stall_basis_says_where_the_figure_comes_from(
    parts: tuple[AdviceLedger, Scheduler, ManualClock],
) -> None:
    ledger, scheduler, clock = parts
    assert Timeline(ledger, scheduler, _models(), clock).sample().stall_basis == "expected"
    measured = MeasuredStall()
    outcome: Any = SimpleNamespace(stall_avoided_seconds=0.5, stall_seconds=2.0)
    measured.record_outcomes([outcome, outcome])
    timeline = Timeline(ledger, scheduler, _models(), clock, stall=measured.stall)
    snap = timeline.sample()
    assert (snap.stall_basis, snap.stall_seconds_saved, snap.stall_seconds_incurred) == (
        "measured",
        1.0,
        4.0,
    )
    body = series(timeline, 60.0, gpu_hour_price=3.6)
    assert body["stall_basis"] == "measured" and body["series"]["stall_cost_saved"] == [
        pytest.approx(0.001)
    ]


def test_a_shadow_slot_is_null_until_a_shadow_is_set(
    parts: tuple[AdviceLedger, Scheduler, ManualClock],
) -> None:
    ledger, scheduler, clock = parts
    models = _models("v1")
    timeline = Timeline(ledger, scheduler, models, clock)
    timeline.sample()
    models.shadow = SimpleNamespace(version="v3")
    ledger.start("shadow")
    ledger.record("shadow", [_advice("s")], 0.0)
    clock.advance(1.0)
    timeline.sample()
    s = series(timeline, 60.0)["series"]
    assert s["shadow_version"] == [None, "v3"] and s["shadow_predictions"] == [None, 1]
    assert s["shadow_recent_hit_rate"] == [None, None]


class _Counting(MemoryStore):
    """A memory store that counts the instance views its reads hand out."""

    views = 0

    def instances(self, **kw):  # type: ignore[no-untyped-def,override]
        out = super().instances(**kw)
        self.views += len(out)
        return out


def test_the_instance_queues_cost_their_page_and_orders_not_the_fleet() -> None:
    store = _Counting(bytes_per_token=327_680, block_tokens=512)
    store.apply(
        [
            InstanceStatus(
                event_id=f"f{i}", ts=0.0, instance_id=f"gpu-{i:04d}", free_kv_bytes=10**12
            )
            for i in range(2000)
        ]
        + [KvBlocksStored(event_id="p", ts=0.0, tier="pool", block_hashes=[1, 2])]
    )
    sched = Scheduler(store, SchedulerConfig(bytes_per_block=BLOCK_BYTES))
    advice = SessionAdvice("a", "gpu-1500", (1, 2), "lru", 0.0, 0.9, 0.9, 0.9, True)
    sched.advise([advice], 1.0)
    assert sched.plan(1.0).orders
    store.views = 0
    rows, total = instance_queues(sched, store, 3)
    assert total == 2000
    assert [r["instance_id"] for r in rows] == ["gpu-1500", "gpu-0000", "gpu-0001"]
    assert rows[0]["open_orders"]["prefetch"] == 1 and rows[0]["free_kv_bytes"] == 10**12
    assert store.views <= 3 + 2 * 1
