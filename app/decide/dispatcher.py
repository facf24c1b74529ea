"""The service's planning loop: the scheduler's orders to the sink, and what comes back to it.

Every `plan_interval_seconds` the Dispatcher asks the scheduler for a plan (app/decide/
scheduler.py) and hands its orders and cancels to the configured sink (app/deliver/).
An order the sink could not take is reported to the scheduler as failed, so a later tick plans
it again (once the order book's backoff for its sessions passed) rather than count it as on its
way. While the store is unavailable every tick
fails; that is logged once per outage, and what a failed tick decided goes out with the next
tick that completes (Scheduler.plan).

`feedback_observer` is the ingest observer that tells the scheduler what happened: a request
routed (its session's advice is void; its order, if it went where the order goes, is used), a
session closed, an order's progress, blocks an engine reports gone (kv_blocks_removed and
kv_blocks_cleared, vLLM's own batches too: a delivered prefetch of them no longer stands, see
app/decide/order_book.py); and tells the route tracker where returns land.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from app.core.clock import Clock
from app.core.errors import StoreError
from app.decide.lease import PlanningLease
from app.decide.popularity import PrefixPopularity
from app.decide.routing import RouteTracker
from app.decide.scheduler import Plan, Scheduler
from app.deliver import OrderSink, SinkError
from app.ingest.ingestor import Observer
from app.state.storethread import Offload
from kvprefetch_client.events import (
    Event,
    KvBlocksCleared,
    KvBlocksRemoved,
    OrderProgress,
    RequestRouted,
    RequestStarted,
    SessionClosed,
    VllmBlockStored,
    VllmKvEvents,
)
from kvprefetch_client.orders import Order

log = logging.getLogger(__name__)


class Dispatcher:
    """`observe_seconds`, when given, is told how long each plan took (the metrics' latency
    histogram); delivery is not in it, since a sink's network time is not planning. `offload`,
    when given, runs what touches the scheduler (on the store thread, app/state/storethread.py);
    delivery stays on the loop."""

    def __init__(
        self,
        scheduler: Scheduler,
        sink: OrderSink,
        clock: Clock,
        *,
        observe_seconds: Callable[[float], None] | None = None,
        offload: Offload | None = None,
        lease: PlanningLease | None = None,
        skipped: Callable[[], None] | None = None,
        planned: Callable[[Sequence[Order]], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        # Told each plan's orders as decided (the LRU guard prices demotes by them).
        self.planned = planned
        # With a planning lease (several replicas, decisions.md 23) a tick plans only while this
        # replica holds it; `skipped` is told of each tick it did not.
        self.lease = lease
        self.skipped = skipped
        self.sink = sink
        self.clock = clock
        self.observe_seconds = observe_seconds
        self.offload = offload
        self.undelivered = 0

    async def _run(self, fn: Callable[..., Any], *args: Any, fail_fast: bool = True) -> Any:
        if self.offload is None:
            return fn(*args)
        return await self.offload(fn, *args, fail_fast=fail_fast)

    def _plan(self) -> Plan:
        started = time.perf_counter()
        plan = self.scheduler.plan(self.clock.now())
        if self.planned is not None and plan.orders:
            self.planned(plan.orders)
        if self.observe_seconds is not None:
            self.observe_seconds(time.perf_counter() - started)
        return plan

    def _failed(self, plan: Plan) -> None:
        for order in plan.orders:
            self.scheduler.on_progress(order.order_id, "failed")

    async def tick(self) -> Plan:
        """Plan now (by the injected clock) and deliver; returns the plan. With a lease, only
        while this replica holds it: the hand-over state is written before the orders go out, so
        a planning replica taking over after a crash between the two knows them (it may count an
        order open that never went out: given up once overdue, it is ordered again; never
        twice)."""
        lease = self.lease
        if lease is not None and not lease.held:
            if self.skipped is not None:
                self.skipped()
            return Plan(orders=[], cancels=[])
        plan: Plan = await self._run(self._plan)
        if lease is not None:
            state = await self._run(self.scheduler.handover_state)
            if not lease.held or not await lease.write_state(state):
                # Lost the lease while planning: the next planner takes over from the state the
                # last tick wrote, and this replica's own is replaced when it plans again.
                log.warning("planning lease lost mid-tick: %d orders not sent", len(plan.orders))
                # Not out: planned again by whoever plans next (this replica, once it holds the
                # lease again, starts from the hand-over state anyway).
                await self._run(self._failed, plan, fail_fast=False)
                return Plan(orders=[], cancels=[])
        if plan.cancels:
            try:
                await self.sink.cancel(plan.cancels)
            except (
                SinkError
            ) as exc:  # the agent may still start it; the scheduler counts it as cancelled
                log.warning("%d cancels not delivered: %s", len(plan.cancels), exc)
        if plan.orders:
            try:
                await self.sink.submit(plan.orders)
            except SinkError as exc:
                self.undelivered += len(plan.orders)
                log.warning(
                    "%d orders not delivered (planned again after a backoff): %s",
                    len(plan.orders),
                    exc,
                )
                await self._run(self._failed, plan, fail_fast=False)  # needs no store
        return plan

    async def run(self, interval_seconds: float) -> None:
        store_down = False
        while True:
            await asyncio.sleep(interval_seconds)
            try:
                await self.tick()
            except StoreError as exc:
                # An outage fails every tick until it ends: one warning for it, not ten a second
                # with a traceback each. What a failed tick decided goes out with the next one.
                if not store_down:
                    log.warning("planning paused: %s", exc)
                    store_down = True
                continue
            except Exception:  # one bad tick must not end planning for the life of the process
                log.exception("planning tick failed")
                continue
            if store_down:
                # A tick with nothing to plan may not touch the store at all: its success says
                # nothing of the outage, the store's own answer does.
                try:
                    await self._run(self.scheduler.store.ping)
                except StoreError:
                    continue
                log.info("planning again: the store answers")
                store_down = False


def feedback_observer(
    scheduler: Scheduler, routes: RouteTracker, popularity: PrefixPopularity | None = None
) -> Observer:
    touched, see = routes.touched, routes.see

    def observe(events: Sequence[Event]) -> None:
        # By type name, which says the class (cheaper than isinstance on the ingest path).
        for e in events:
            kind = e.type
            if kind == "request_started" or kind == "request_finished":
                touched(cast(RequestStarted, e).session_id, e.ts)
            elif kind == "request_routed":
                routed = cast(RequestRouted, e)
                routes.routed(routed.session_id, routed.instance_id, routed.ts)
                if popularity is not None and routed.block_hashes:
                    popularity.routed(routed.session_id, routed.block_hashes, routed.ts)
                scheduler.forget(
                    routed.session_id,
                    routed_to=routed.instance_id,
                    block_hashes=routed.block_hashes,
                )
            elif kind == "session_closed":
                closed = cast(SessionClosed, e)
                routes.closed(closed.session_id, closed.ts)
                scheduler.forget(closed.session_id)
            else:
                see(e.ts)  # every event moves the store's cutoff
                if kind == "order_progress":
                    progress = cast(OrderProgress, e)
                    scheduler.on_progress(progress.order_id, progress.status, progress.bytes)
                elif kind == "kv_blocks_removed":
                    removed = cast(KvBlocksRemoved, e)
                    scheduler.blocks_removed(
                        removed.tier, removed.instance_id, removed.block_hashes
                    )
                elif kind == "kv_blocks_cleared":
                    cleared = cast(KvBlocksCleared, e)
                    scheduler.blocks_cleared(cleared.tier, cleared.instance_id)
                elif kind == "vllm_kv_events" and scheduler.holds_landed:
                    batch = cast(VllmKvEvents, e)
                    # Expanded only when it removes something (most batches only store) and a
                    # landed prefetch could be among it: the vLLM intake's hot path.
                    if not all(isinstance(x, VllmBlockStored) for x in batch.events):
                        for sub in batch.expand():
                            if isinstance(sub, KvBlocksRemoved):
                                scheduler.blocks_removed(
                                    sub.tier, sub.instance_id, sub.block_hashes
                                )
                            elif isinstance(sub, KvBlocksCleared):
                                scheduler.blocks_cleared(sub.tier, sub.instance_id)

    return observe
