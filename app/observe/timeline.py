"""The dashboard's memory: the service's counters, sampled every few seconds into a ring buffer.

A `Timeline` reads, at each `sample()` (by the injected clock), what the service has counted so
far: the advice ledger's counts per model slot (app/observe/ledger.py), the scheduler's totals and
open orders (app/decide/scheduler.py), and the stall the prefetches saved. It keeps the last
`capacity` snapshots (an hour at the default 2 s; `KVP_DASHBOARD_SAMPLE_SECONDS`), and `series()`
turns a stretch of them into columns a chart draws directly.

Every figure in a snapshot is a running total since the process started (the ledger's since its
model was put in its slot), so a sample missed costs resolution, never a count. Rates over time
(the recent hit rate, bytes per second) are differences between snapshots.

**Stall saved.** Two figures, each labelled with what it is:

- *measured* (`MeasuredStall`, when the service judges each arriving request against what was
  resident for it, app/observe/outcomes.py): the stall its resident reused blocks would have cost
  (load from the pool, or recompute if sooner), summed; and the stall its missing ones did cost.
  This credits residency, whatever put the blocks there (a prefetch, a pin, or LRU luck);
- *expected* (`LandedPrefetches`, always): the sum, over the prefetch orders an agent reported
  completed, of the order's `priority`, which is P(the session is back there in time) x the stall
  the blocks avoid: the scheduler's own expectation for its prefetches, not checked on arrivals.

`stall_seconds_saved` is the measured figure when the service measures, else the expected one;
`stall_basis` says which.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from app.core.clock import Clock
from app.decide.scheduler import Scheduler
from app.observe.ledger import AdviceLedger
from app.observe.outcomes import RequestOutcome
from app.predict.slots import ModelSlots
from app.state.base import StateStore
from kvprefetch_client.events import Event, OrderProgress

log = logging.getLogger(__name__)

# How far back the dashboard looks: the service keeps this long of snapshots (an hour: 1,800 at
# the default 2 s interval, ~0.5 KB each), and GET /v1/dashboard/series serves at most this long.
HISTORY_SECONDS = 3600.0
DEFAULT_CAPACITY = 1800
# However short the interval, no more snapshots than this are kept.
MAX_CAPACITY = 36_000
# The "recent" hit rate counts the requests scored within this long before each point.
RECENT_SECONDS = 60.0

StallBasis = Literal["measured", "expected"]


@dataclass(frozen=True, slots=True)
class StallFigures:
    """Stall seconds saved so far (GPU seconds a request did not wait), on what basis, and the
    stall incurred (known only when measured)."""

    seconds_saved: float
    basis: StallBasis
    seconds_incurred: float | None = None


StallSource = Callable[[], StallFigures]


@dataclass(frozen=True, slots=True)
class SlotSnapshot:
    version: str | None
    # Bumped when the slot's counts start afresh (a model swapped in), so differences never span
    # two models.
    epoch: int
    predictions: int
    keep_predictions: int
    hits: int
    misses: int
    unscored: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    ts: float
    live: SlotSnapshot
    shadow: SlotSnapshot | None
    orders_prefetch: int
    orders_pin: int
    orders_demote: int
    bytes_ordered: int
    completed: int
    failed: int
    cancelled: int
    bytes_wasted: int
    # The scheduler's landed prefetch bytes (as ordered) and those a request used.
    bytes_landed: int
    bytes_used: int
    open_orders: int
    inflight_bytes: int
    # Prefetches the agents reported completed: their bytes and transfer seconds.
    landed_prefetches: int
    landed_bytes: int
    transfer_seconds: float
    expected_stall_seconds: float
    stall_seconds_saved: float
    stall_seconds_incurred: float | None
    stall_basis: StallBasis


def capacity_for(interval_seconds: float) -> int:
    """Enough snapshots for HISTORY_SECONDS at the sampling interval (within MAX_CAPACITY); the
    default when sampling is off (tests that sample by hand)."""
    if interval_seconds <= 0:
        return DEFAULT_CAPACITY
    return min(max(1, math.ceil(HISTORY_SECONDS / interval_seconds)), MAX_CAPACITY)


class MeasuredStall:
    """Sums the stall of arriving requests as judged on arrival (app/observe/outcomes.py);
    `record_outcomes` is outcome_observer's callback."""

    def __init__(self) -> None:
        self.requests = 0
        self.saved_seconds = 0.0
        self.incurred_seconds = 0.0

    def record_outcomes(self, outcomes: Iterable[RequestOutcome]) -> None:
        for o in outcomes:
            self.requests += 1
            self.saved_seconds += o.stall_avoided_seconds
            self.incurred_seconds += o.stall_seconds

    def stall(self) -> StallFigures:
        return StallFigures(self.saved_seconds, "measured", self.incurred_seconds)


class LandedPrefetches:
    """An ingest observer counting the prefetch orders agents report completed, with what the
    scheduler expected each to save (its `priority`). Must run before the scheduler's own
    observer, which forgets a completed order."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.orders = 0
        self.bytes = 0
        self.transfer_seconds = 0.0
        self.expected_stall_seconds = 0.0

    def observe(self, events: Sequence[Event]) -> None:
        done = [e for e in events if isinstance(e, OrderProgress) and e.status == "completed"]
        if not done:
            return
        open_orders = {o.order_id: o for o in self.scheduler.open_orders()}
        for e in done:
            order = open_orders.pop(e.order_id, None)  # popped: a second report counts once
            if order is None or order.kind != "prefetch":
                continue  # a pin or a demote, or an order this replica does not hold
            self.orders += 1
            self.bytes += e.bytes if e.bytes is not None else order.size_bytes
            self.transfer_seconds += e.seconds or 0.0
            self.expected_stall_seconds += order.priority

    def stall(self) -> StallFigures:
        return StallFigures(self.expected_stall_seconds, "expected")


class Timeline:
    def __init__(
        self,
        ledger: AdviceLedger,
        scheduler: Scheduler,
        models: ModelSlots,
        clock: Clock,
        *,
        landed: LandedPrefetches | None = None,
        stall: StallSource | None = None,
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self.ledger = ledger
        self.scheduler = scheduler
        self.models = models
        self.clock = clock
        self.landed = landed if landed is not None else LandedPrefetches(scheduler)
        self.stall = stall if stall is not None else self.landed.stall
        self.capacity = capacity
        self._snapshots: deque[Snapshot] = deque(maxlen=capacity)
        self._epochs = {"live": 0, "shadow": 0}

    def __len__(self) -> int:
        return len(self._snapshots)

    def sample(self) -> Snapshot:
        """Take a snapshot now (by the injected clock) and keep it."""
        now = self.clock.now()
        last = self._snapshots[-1] if self._snapshots else None
        serving, shadow = self.models.serving, self.models.shadow
        live = self._slot("live", serving.version, last.live if last else None)
        shadow_snap = (
            self._slot("shadow", shadow.version, last.shadow if last else None)
            if shadow is not None
            else None
        )
        t = self.scheduler.totals
        open_orders = self.scheduler.open_orders()
        stall = self.stall()
        snap = Snapshot(
            ts=now,
            live=live,
            shadow=shadow_snap,
            orders_prefetch=t.orders.get("prefetch", 0),
            orders_pin=t.orders.get("pin", 0),
            orders_demote=t.orders.get("demote", 0),
            bytes_ordered=t.bytes_ordered,
            completed=t.completed,
            failed=t.failed,
            cancelled=t.cancelled,
            bytes_wasted=t.bytes_wasted,
            bytes_landed=t.bytes_landed,
            bytes_used=t.bytes_used,
            open_orders=len(open_orders),
            inflight_bytes=sum(o.size_bytes for o in open_orders if o.kind == "prefetch"),
            landed_prefetches=self.landed.orders,
            landed_bytes=self.landed.bytes,
            transfer_seconds=self.landed.transfer_seconds,
            expected_stall_seconds=self.landed.expected_stall_seconds,
            stall_seconds_saved=stall.seconds_saved,
            stall_seconds_incurred=stall.seconds_incurred,
            stall_basis=stall.basis,
        )
        self._snapshots.append(snap)
        return snap

    def _slot(self, slot: str, version: str | None, last: SlotSnapshot | None) -> SlotSnapshot:
        s = self.ledger.stats(slot)
        counts = (s.predictions, s.keep_predictions, s.hits, s.misses, s.unscored)
        if (
            last is None
            or last.version != version
            or any(
                now < before
                for now, before in zip(
                    counts,
                    (
                        last.predictions,
                        last.keep_predictions,
                        last.hits,
                        last.misses,
                        last.unscored,
                    ),
                )
            )
        ):
            self._epochs[slot] += 1  # a new model in the slot (or the slot restarted): count afresh
        return SlotSnapshot(version, self._epochs[slot], *counts)

    def since(self, ts: float) -> list[Snapshot]:
        """The snapshots taken at or after `ts`, oldest first."""
        out: list[Snapshot] = []
        for snap in reversed(self._snapshots):
            if snap.ts < ts:
                break
            out.append(snap)
        out.reverse()
        return out

    async def run(self, interval_seconds: float) -> None:
        """Sample every `interval_seconds` until cancelled."""
        while True:
            await asyncio.sleep(interval_seconds)
            try:
                self.sample()
            except Exception:  # a failed sample costs one point, never the sampling
                log.exception("dashboard sample failed")


def _rate(hits: int, misses: int) -> float | None:
    scored = hits + misses
    return hits / scored if scored else None


def _recent(points: Sequence[Snapshot], slot: str, window: float) -> list[float | None]:
    """Per point, the slot's hit rate over the requests scored in the `window` seconds before it:
    the difference from the newest earlier snapshot at least `window` old, of the same model
    (from zero when the model came in within the window). `points` must start at least `window`
    before the first point wanted, or the first points cover less."""
    out: list[float | None] = []
    base = 0  # index of the newest snapshot at or before ts - window
    for i, p in enumerate(points):
        cur: SlotSnapshot | None = getattr(p, slot)
        if cur is None:
            out.append(None)
            continue
        while base + 1 <= i and points[base + 1].ts <= p.ts - window:
            base += 1
        ref: SlotSnapshot | None = (
            getattr(points[base], slot) if points[base].ts <= p.ts - window else None
        )
        if ref is None or ref.epoch != cur.epoch:
            out.append(_rate(cur.hits, cur.misses))  # the model came in within the window
        else:
            out.append(_rate(cur.hits - ref.hits, cur.misses - ref.misses))
    return out


SERIES_FIELDS = (
    "orders_prefetch",
    "orders_pin",
    "orders_demote",
    "bytes_ordered",
    "completed",
    "failed",
    "cancelled",
    "bytes_wasted",
    "bytes_landed",
    "bytes_used",
    "open_orders",
    "inflight_bytes",
    "landed_prefetches",
    "landed_bytes",
    "transfer_seconds",
    "expected_stall_seconds",
    "stall_seconds_saved",
    "stall_seconds_incurred",
)
SLOT_FIELDS = ("predictions", "keep_predictions", "hits", "misses", "unscored")


def series(
    timeline: Timeline,
    since_seconds: float,
    *,
    window: float = RECENT_SECONDS,
    gpu_hour_price: float | None = None,
) -> dict[str, Any]:
    """The snapshots of the last `since_seconds` as columns: `ts`, and under `series` one list per
    figure, each as long as `ts` (null where a figure has no value, e.g. the shadow's when none
    was set, or a hit rate before the first scored request)."""
    now = timeline.clock.now()
    # Read from `window` earlier, so the first points' recent hit rate covers a whole window.
    wide = timeline.since(now - since_seconds - window)
    first = next((i for i, p in enumerate(wide) if p.ts >= now - since_seconds), len(wide))
    points = wide[first:]
    cols: dict[str, list[Any]] = {
        name: [getattr(p, name) for p in points] for name in SERIES_FIELDS
    }
    for slot in ("live", "shadow"):
        snaps: list[SlotSnapshot | None] = [getattr(p, slot) for p in points]
        for name in SLOT_FIELDS:
            cols[f"{slot}_{name}"] = [getattr(s, name) if s is not None else None for s in snaps]
        cols[f"{slot}_version"] = [s.version if s is not None else None for s in snaps]
        cols[f"{slot}_hit_rate"] = [
            _rate(s.hits, s.misses) if s is not None else None for s in snaps
        ]
        cols[f"{slot}_recent_hit_rate"] = _recent(wide, slot, window)[first:]
    cols["stall_cost_saved"] = (
        [s * gpu_hour_price / 3600.0 for s in cols["stall_seconds_saved"]]
        if gpu_hour_price is not None
        else [None] * len(points)
    )
    return {
        "now": now,
        "since_seconds": since_seconds,
        "recent_window_seconds": window,
        "count": len(points),
        "stall_basis": points[-1].stall_basis if points else timeline.stall().basis,
        "ts": [p.ts for p in points],
        "series": cols,
    }


def top_sessions(
    scheduler: Scheduler, limit: int, now: float, bytes_per_block: int
) -> list[dict[str, Any]]:
    """The `limit` sessions most likely back soonest, by the serving model's latest advice:
    highest P(back within the 30 s lead) first, then P(within 300 s), then the session id."""
    advice: Iterable[tuple[Any, float]] = scheduler.latest_advice()
    best = heapq.nsmallest(
        limit, advice, key=lambda item: (-item[0].p_soon, -item[0].p_keep, item[0].session_id)
    )
    return [
        {
            "session_id": a.session_id,
            "instance_id": a.instance_id,
            "p_soon": a.p_soon,
            "p_keep": a.p_keep,
            "p_return": a.p_return,
            "retention": a.retention,
            "prefetch": a.prefetch,
            "context_bytes": len(a.block_hashes) * bytes_per_block,
            "advised_seconds_ago": max(now - made, 0.0),
        }
        for a, made in best
    ]


def instance_queues(
    scheduler: Scheduler, store: StateStore, limit: int
) -> tuple[list[dict[str, Any]], int]:
    """Per instance (every one that reported, and any with open orders): its open orders by kind,
    the prefetch bytes on their way, and how long its links' prefetch share is booked for them
    (`link_backlog_seconds`: each open prefetch's bytes at its source link's prefetch rate);
    with its last status. Those with the most bytes on their way first, at most `limit`; and how
    many there are in all."""
    cfg = scheduler.config
    rows: dict[str, dict[str, Any]] = {}

    def row(instance_id: str) -> dict[str, Any]:
        r = rows.get(instance_id)
        if r is None:
            r = rows[instance_id] = {
                "instance_id": instance_id,
                "open_orders": {"prefetch": 0, "pin": 0, "demote": 0},
                "inflight_bytes": 0,
                "link_backlog_seconds": 0.0,
                "free_kv_bytes": None,
                "total_kv_bytes": None,
                "hbm_bytes": 0,
                "queue_depth": None,
                "running_requests": None,
            }
        return r

    for o in scheduler.open_orders():
        r = row(o.instance_id)
        r["open_orders"][o.kind] += 1
        if o.kind == "prefetch":
            r["inflight_bytes"] += o.size_bytes
            rate = cfg.link_bytes_per_second(o.source_tier or "pool") * cfg.link_share
            r["link_backlog_seconds"] += o.size_bytes / rate
    # Those with orders come first; the rest tie and go by id, so the first `limit` of the
    # store's beside them are all the page can hold: it costs the orders and the page, not the
    # fleet.
    ordered = list(rows)
    known, held = store.known_instances(ordered)
    total = held + sum(1 for k in known if not k)
    views = store.instances(ids=ordered) if ordered else []
    views += store.instances(limit=limit + len(ordered))
    for view in views:
        r = row(view.instance_id)
        r.update(
            free_kv_bytes=view.free_kv_bytes,
            total_kv_bytes=view.total_kv_bytes,
            hbm_bytes=view.resident_bytes.get("hbm", 0),
            queue_depth=view.queue_depth,
            running_requests=view.running_requests,
        )
    ranked = sorted(
        rows.values(),
        key=lambda r: (-r["inflight_bytes"], -sum(r["open_orders"].values()), r["instance_id"]),
    )
    return ranked[:limit], total
