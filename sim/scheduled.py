"""The service's planner and scheduler driving the cluster model: the `scheduled` policy.

Every tick the engines report their free KV bytes (instance_status events, as real engines do on
a timer; the cluster also reports at every finish), the planner advises on every idle live
session (as in sim/planned.py), and the scheduler (app/decide/scheduler.py) turns the advice
into orders. The cluster model is the transfer layer:
it starts a prefetch at its start_by unless cancelled first, pins with the order's TTL, demotes,
and its landed blocks come back as kv_blocks_stored events, which retire the order. A finish
is advised on at once; an arrival makes the scheduler forget the session's advice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvprefetch_client.orders import Order
from app.decide.advisor import Advisor
from app.decide.scheduler import Scheduler
from app.state.base import SessionView
from sim.planned import PlannedPolicy

if TYPE_CHECKING:
    from sim.cluster import SimRequest


class ScheduledPolicy(PlannedPolicy):
    def __init__(self, planner: Advisor, scheduler: Scheduler, session_view: Callable[[str], SessionView | None],
                 name: str = "scheduled") -> None:
        super().__init__(planner, session_view, name)
        self.scheduler = scheduler
        self._cancelled: set[str] = set()

    def on_arrival(self, r: SimRequest, now: float) -> None:
        super().on_arrival(r, now)
        self.scheduler.forget(r.session_id, routed_to=self.cluster.instances[r.instance].instance_id)

    def on_tick(self, now: float) -> None:
        for inst in self.cluster.instances:
            self.cluster.report_status(inst)
        super().on_tick(now)

    def _dropped(self, session_id: str) -> None:
        self.scheduler.forget(session_id)

    def _act(self, session_ids: list[str], now: float) -> None:
        views = self._views(session_ids, now)
        self.scheduler.advise(self.planner.advise(views, now), now)
        plan = self.scheduler.plan(now)
        self._cancelled.update(c.order_id for c in plan.cancels)
        for order in plan.orders:
            self._carry_out(order, now)

    def _carry_out(self, order: Order, now: float) -> None:
        cluster = self.cluster
        idx = self._instance_index(order.instance_id)
        if idx is None:
            return  # not an instance of this cluster
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
