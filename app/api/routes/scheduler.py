"""GET /v1/scheduler: what the scheduler holds and has done (for operators and dashboards)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from app.api.deps import EngineDep, SchedulerDep, StoreThreadDep
from app.decide.scheduler import Scheduler

router = APIRouter(tags=["orders"])


class SchedulerStatus(BaseModel):
    # Whether this replica plans: it holds the planning lease (KVP_PLANNING_LEASE_SECONDS), or
    # plans without one. Only the planner's open orders and totals grow (decisions.md, 23).
    planning: bool
    tracked_sessions: int
    candidates: int
    open_orders: int
    inflight_bytes: int
    orders: dict[str, int]
    bytes_ordered: int
    completed: int
    failed: int
    cancelled: int
    # Landed prefetch bytes: used + wasted + waiting = landed (app/decide/order_book.py).
    bytes_landed: int
    bytes_used: int
    # Evicted, demoted or past their hold before a request used them.
    bytes_wasted: int
    bytes_waiting: int
    # The same as bytes_wasted (the replay's name).
    bytes_unused: int
    # Pins their tier confirmed and not lapsed, and pins ordered and not confirmed yet.
    pins_held: int
    pins_pending: int


@router.get(
    "/scheduler", response_model=SchedulerStatus, summary="The scheduler's state and totals"
)
async def scheduler_status(
    engine: EngineDep, scheduler: SchedulerDep, store_thread: StoreThreadDep
) -> SchedulerStatus:
    planning = engine.lease is None or engine.lease.held
    # Where the planning side runs (app/state/storethread.py): one consistent view of it.
    return await store_thread.run(_status, scheduler, planning, fail_fast=False)


def _status(scheduler: Scheduler, planning: bool) -> SchedulerStatus:
    t = scheduler.totals
    open_orders = scheduler.open_orders()
    return SchedulerStatus(
        planning=planning,
        tracked_sessions=scheduler.tracked_sessions,
        candidates=scheduler.candidates,
        open_orders=len(open_orders),
        inflight_bytes=sum(o.size_bytes for o in open_orders if o.kind == "prefetch"),
        orders=dict(t.orders),
        bytes_ordered=t.bytes_ordered,
        completed=t.completed,
        failed=t.failed,
        cancelled=t.cancelled,
        bytes_landed=t.bytes_landed,
        bytes_used=t.bytes_used,
        bytes_wasted=t.bytes_wasted,
        bytes_waiting=t.bytes_waiting,
        bytes_unused=t.bytes_unused,
        pins_held=scheduler.book.pins_held,
        pins_pending=scheduler.book.pins_pending,
    )
