"""The service's planner and scheduler driving the cluster model: the `scheduled` policy.

Every tick the engines report their free KV bytes (instance_status events, as real engines do on
a timer; the cluster also reports at every finish), the planner advises on every idle live session, and the scheduler
(app/engine/scheduler.py) turns the advice into orders. The cluster model is the transfer layer:
it starts a prefetch at its start_by unless cancelled first, pins with the order's TTL, demotes,
and its landed blocks come back as kv_blocks_stored events, which retire the order. A finish
is advised on at once; an arrival makes the scheduler forget the session's advice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from app.engine.orders import Order
from app.engine.planner import MAX_IDLE_SECONDS, Planner
from app.engine.routing import RouteTracker
from app.engine.scheduler import Scheduler
from app.engine.state.base import SessionView
from sim.policies import Policy

if TYPE_CHECKING:
    from sim.cluster import SimRequest


class ScheduledPolicy(Policy):
    tick_seconds = 20.0

    def __init__(self, planner: Planner, scheduler: Scheduler, session_view: Callable[[str], SessionView | None],
                 name: str = "scheduled") -> None:
        self.planner = planner
        self.scheduler = scheduler
        self.name = name
        self._session_view = session_view
        self._idle: set[str] = set()
        self._cancelled: set[str] = set()
        # Feeds the planner's estimate of where returns land.
        self.routes = RouteTracker(planner.routes) if planner.routes is not None else None

    def on_arrival(self, r: SimRequest, now: float) -> None:
        self._idle.discard(r.session_id)
        instance_id = self.cluster.instances[r.instance].instance_id
        self.scheduler.forget(r.session_id, routed_to=instance_id)
        if self.routes is not None:
            self.routes.routed(r.session_id, instance_id)

    def on_finished(self, r: SimRequest, now: float) -> None:
        self._idle.add(r.session_id)
        self._plan([r.session_id], now)

    def on_tick(self, now: float) -> None:
        for inst in self.cluster.instances:
            self.cluster.report_status(inst)
        self._plan(sorted(self._idle), now)

    def _plan(self, session_ids: list[str], now: float) -> None:
        views = [v for v in (self._session_view(s) for s in session_ids) if v is not None]
        cutoff = now - MAX_IDLE_SECONDS
        for v in views:
            if v.state != "idle" or v.last_activity_ts < cutoff:
                self._idle.discard(v.session_id)
                self.scheduler.forget(v.session_id)
        self.scheduler.advise(self.planner.advise(views, now), now)
        plan = self.scheduler.plan(now)
        self._cancelled.update(c.order_id for c in plan.cancels)
        for order in plan.orders:
            self._carry_out(order, now)

    def _carry_out(self, order: Order, now: float) -> None:
        cluster = self.cluster
        idx = int(order.instance_id.rsplit("-", 1)[1])
        blocks = list(order.block_hashes)
        if order.kind == "pin":
            cluster.keep(idx, blocks, now + (order.ttl_seconds or 0.0))  # type: ignore[arg-type]
        elif order.kind == "demote":
            cluster.demote(idx, blocks)  # type: ignore[arg-type]
        elif order.start_by_ts > now:
            cluster.call_at(order.start_by_ts, lambda: self._start(order, idx, blocks))
        else:
            self._start(order, idx, blocks)

    def _start(self, order: Order, idx: int, blocks: list[int]) -> None:
        if order.order_id in self._cancelled:
            self._cancelled.discard(order.order_id)
            return
        if self.cluster.prefetch(idx, blocks):
            if order.ttl_seconds:
                self.cluster.keep(idx, blocks, self.cluster.now + order.ttl_seconds)
            self.scheduler.on_progress(order.order_id, "accepted")
        elif all(b in self.cluster.instances[idx].hbm for b in blocks):
            self.scheduler.on_progress(order.order_id, "completed")  # it arrived some other way
        else:
            self.scheduler.on_progress(order.order_id, "failed")  # no room after all
