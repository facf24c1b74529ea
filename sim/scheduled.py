"""The service's engine driving the cluster model: the `scheduled` policy.

The engine is the service's own (app/engine.py), under the replay's simulated clock: every tick
the engines report their free KV bytes (instance_status events, as real engines do on a timer;
the cluster also reports at every finish) and the engine's scoring tick advises on every idle
live session (as in sim/planned.py), recording the advice in its ledger and handing it to its
scheduler; its planning tick turns the advice into orders and delivers them to the order sink
here, which is the cluster model as the transfer layer: it starts a prefetch at its start_by
unless cancelled first, pins with the order's TTL, demotes, and reports each order's progress
back as order_progress events, through the engine's ingest like an agent's. Its landed blocks
come back as kv_blocks_stored events, which retire the order. A finish is advised on at once;
an arrival (request_routed, through the engine's feedback observer) makes the scheduler forget
the session's advice.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar, cast

from app.decide.advisor import Advisor
from app.engine import Engine
from app.state.base import SessionView
from kvprefetch_client.orders import Cancel, Order
from sim.planned import PlannedPolicy

T = TypeVar("T")


def run_now(step: Coroutine[Any, Any, T]) -> T:
    """A coroutine that never waits, run to its end here: the replay's planning tick, whose
    sink (ClusterSink) and store (in memory, no store thread) answer at once. An event loop per
    tick would cost more than the tick."""
    try:
        step.send(None)
    except StopIteration as done:
        return done.value
    step.close()
    raise RuntimeError("the replay's planning tick waited on something: it must answer at once")


class ClusterSink:
    """An order sink (app/deliver/base.py OrderSink) that the cluster model carries out: the
    replay's transfer layer. Bound to its policy once the policy is made."""

    def __init__(self) -> None:
        self.policy: ScheduledPolicy | None = None

    async def submit(self, orders: Sequence[Order]) -> list[str]:
        if self.policy is not None:
            for order in orders:
                self.policy.carry_out(order)
        return [o.order_id for o in orders]

    async def cancel(self, cancels: Sequence[Cancel]) -> list[str]:
        if self.policy is not None:
            self.policy.cancelled.update(c.order_id for c in cancels)
        return [c.order_id for c in cancels]

    async def close(self) -> None:
        pass


class ScheduledPolicy(PlannedPolicy):
    """`engine`: the replay's own, built with a ClusterSink as its order sink (sim/replay.py
    sim_engine); `session_view` reads its store."""

    def __init__(
        self,
        engine: Engine,
        session_view: Callable[[str], SessionView | None],
        name: str = "scheduled",
    ) -> None:
        # The advisor the engine's scorer runs: the serving model, the settings' thresholds, the
        # engine's estimate of where returns land.
        super().__init__(
            Advisor(
                engine.models.serving.predictor,
                routes=engine.routes.estimate,
                popularity=engine.popularity,
                deployment=engine.deployment,
                **engine.thresholds.advisor_options(),
            ),
            session_view,
            name,
        )
        # The engine's route tracker hears of each request_routed event (its feedback observer).
        self.routes = None
        self.engine = engine
        self.scheduler = engine.scheduler
        self.cancelled: set[str] = set()
        sink = engine.order_sink
        if not isinstance(sink, ClusterSink):
            raise ValueError(
                "the scheduled policy carries out the engine's orders: build the engine "
                "with a ClusterSink (sim.replay.sim_engine)"
            )
        sink.policy = self

    def on_tick(self, now: float) -> None:
        for inst in self.cluster.instances:
            self.cluster.report_status(inst)
        super().on_tick(now)

    def _dropped(self, session_id: str) -> None:
        self.scheduler.forget(session_id)

    def _act(self, session_ids: list[str], now: float) -> None:
        # What the engine's observers derive (the scheduler's feedback, the routes, the ledger)
        # caught up first: `_views` may tell the scheduler too, and must come after.
        self.engine.drain()
        views = self._views(session_ids, now)
        clock = self.engine.clock
        if now > clock.now():
            clock.set(now)  # type: ignore[attr-defined]
        self.engine.score_tick(views=views)  # as just read: not read again
        run_now(self.engine.plan_tick())

    def carry_out(self, order: Order) -> None:
        cluster = self.cluster
        now = cluster.now
        idx = self._instance_index(order.instance_id)
        if idx is None:
            return  # not an instance of this cluster
        # The traces' hash_ids are checked to be ints, so the orders name int blocks.
        blocks = cast("list[int]", list(order.block_hashes))
        if order.kind == "pin":
            cluster.keep(idx, blocks, now + (order.ttl_seconds or 0.0))
        elif order.kind == "demote":
            cluster.demote(idx, blocks)
        elif order.start_by_ts > now:
            cluster.call_at(order.start_by_ts, lambda: self._start(order, idx, blocks))
        else:
            self._start(order, idx, blocks)

    def _start(self, order: Order, idx: int, blocks: list[int]) -> None:
        if order.order_id in self.cancelled:
            self.cancelled.discard(order.order_id)
            return
        if self.cluster.prefetch(idx, blocks):
            if order.ttl_seconds:
                self.cluster.keep(idx, blocks, self.cluster.now + order.ttl_seconds)
            self._progress(order, "accepted")
        elif all(b in self.cluster.instances[idx].hbm for b in blocks):
            self._progress(order, "completed")  # it arrived some other way
        else:
            self._progress(order, "failed")  # no room after all

    def _progress(self, order: Order, status: str) -> None:
        """What an agent reports: an order_progress event, through the engine's ingest."""
        fields: dict[str, object] = {"order_id": order.order_id, "status": status}
        if status == "completed":
            fields.update(bytes=0, seconds=0.0)  # nothing moved for it
        elif status == "failed":
            fields["reason"] = "no room at the destination"
        self.cluster.emit("order_progress", self.cluster.now, fields)
