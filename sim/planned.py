"""The service's engine driving the cluster model: the `heuristic`, `learned` and `clairvoyant`
policies, which differ only in the model the engine serves.

There is one planner, the service's: the engine (app/engine.py) under the replay's simulated
clock scores sessions with its serving model (app/decide/scorer.py), hands the advice to its
scheduler (app/decide/scheduler.py), and its planning tick delivers the orders to the order sink
here, the cluster model as the transfer layer. Nothing here decides what to keep, demote or
fetch: this module says *when* the engine looks (the driver's part) and carries its orders out
(the tier's part).

When: every tick the engines report their free KV bytes (instance_status events, as real engines
do on a timer; the cluster also reports at every finish) and the engine advises on every idle
live session; a finish, a queued arrival and a session_signal are advised on at once.

Carrying out: a prefetch starts at its start_by unless cancelled first, reading the tier its
order names (its source_tier: the link the scheduler booked), a pin keeps its blocks for the
order's TTL, a demote marks them first to go, and a cancel of either undoes it for exactly its
blocks (the LRU guard turned the instance's advice off); each order's progress comes back as an
agent's order_progress event, through the engine's ingest. Landed blocks come back as
kv_blocks_stored events, which retire the order. An arrival (request_routed, through the
engine's feedback observer) makes the scheduler forget the session's advice.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from app.decide.advisor import MAX_IDLE_SECONDS
from app.deliver.base import OrderSink
from app.engine import Engine
from app.predict.predictors import Predictor
from app.predict.slots import Serving
from app.state.base import SessionView
from kvprefetch_client.orders import Cancel, Order
from sim.policies import Policy

if TYPE_CHECKING:
    from sim.cluster import Cluster, SimRequest

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


class ClusterSink(OrderSink):
    """An order sink (app/deliver/base.py OrderSink) that the cluster model carries out: the
    replay's transfer layer. Bound to its policy once the policy is made."""

    def __init__(self) -> None:
        self.policy: PlannedPolicy | None = None

    async def submit(self, orders: Sequence[Order]) -> list[str]:
        if self.policy is not None:
            for order in orders:
                self.policy.carry_out(order)
        return [o.order_id for o in orders]

    async def cancel(self, cancels: Sequence[Cancel]) -> list[str]:
        if self.policy is not None:
            for c in cancels:
                self.policy.withdraw(c.order_id)
        return [c.order_id for c in cancels]

    async def close(self) -> None:
        pass


class PlannedPolicy(Policy):
    """`engine`: the replay's own, built with a ClusterSink as its order sink (sim/replay.py
    sim_engine); `session_view` reads its store; `predictor`, when given, is the model the
    engine serves instead of the one it loaded (the heuristic, a clairvoyant)."""

    tick_seconds = 20.0

    def __init__(
        self,
        engine: Engine,
        session_view: Callable[[str], SessionView | None],
        name: str,
        *,
        predictor: Predictor | None = None,
    ) -> None:
        self.name = name
        self.engine = engine
        self.scheduler = engine.scheduler
        self._session_view = session_view
        self._idle: set[str] = set()
        self.cancelled: set[str] = set()
        # Pins and demotes carried out and maybe still in force: order id -> (kind, instance
        # index, blocks, a pin's end), so a cancel undoes exactly those blocks' advice.
        self.retained: dict[str, tuple[str, int, list[int], float]] = {}
        if predictor is not None:
            engine.models.serving = Serving(predictor, name, None)
        sink = engine.order_sink
        if not isinstance(sink, ClusterSink):
            raise ValueError(
                f"the {name} policy carries out the engine's orders: build the engine "
                "with a ClusterSink (sim.replay.sim_engine)"
            )
        sink.policy = self

    def summary(self) -> dict[str, Any]:
        """What the LRU guard saw (app/decide/guard.py): its fallbacks, and the blocks the demotes
        cost and the room they made kept, over the whole replay."""
        guard = self.engine.guard
        if guard is None:
            return {}
        return {
            "lru_guard": {
                "fallbacks": guard.fallbacks_total,
                "demote_cost_blocks": guard.demote_cost_blocks_total,
                "demote_gain_blocks": guard.demote_gain_blocks_total,
                "demote_suspensions": guard.demote_suspensions_total,
            }
        }

    # -- when the engine looks -------------------------------------------------------------

    def on_arrival(self, r: SimRequest, now: float) -> None:
        self._idle.discard(r.session_id)
        if r.admitted_at is None:  # queued for a slot: the planner fetches its context now
            self._act([r.session_id], now)

    def on_finished(self, r: SimRequest, now: float) -> None:
        self._idle.add(r.session_id)
        self._act([r.session_id], now)

    def on_tick(self, now: float) -> None:
        for inst in self.cluster.instances:
            self.cluster.report_status(inst)
        self._forget_spent(now)
        self._act(sorted(self._idle), now)

    def on_signal(self, session_id: str, kind: str, now: float) -> None:
        # A signal is news about the next request: the session is advised at once (its view
        # holds the signal: the engine took it before the policy hears of it), however long it
        # has been idle. A session with a request in flight has nothing to fetch ahead of.
        if session_id not in self._idle:
            view = self._session_view(session_id)
            if view is None or view.state != "idle":
                return
        self._act([session_id], now)

    def _views(self, session_ids: list[str], now: float) -> list[SessionView]:
        """The sessions' views; those no longer idle, or idle past what the planner scores, leave
        the idle set and the scheduler forgets them."""
        views = [v for v in (self._session_view(s) for s in session_ids) if v is not None]
        cutoff = now - MAX_IDLE_SECONDS
        for v in views:
            if v.state != "idle" or v.last_activity_ts < cutoff:
                self._idle.discard(v.session_id)
                self.scheduler.forget(v.session_id)
        return views

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

    # -- the transfer layer ----------------------------------------------------------------

    def _instance_index(self, instance_id: str) -> int | None:
        return next(
            (inst.idx for inst in self.cluster.instances if inst.instance_id == instance_id), None
        )

    def carry_out(self, order: Order) -> None:
        cluster = self.cluster
        now = cluster.now
        idx = self._instance_index(order.instance_id)
        if idx is None:
            return  # not an instance of this cluster
        # The traces' hash_ids are checked to be ints, so the orders name int blocks.
        blocks = cast("list[int]", list(order.block_hashes))
        if order.kind == "pin":
            until = now + (order.ttl_seconds or 0.0)
            cluster.keep(idx, blocks, until)
            self.retained[order.order_id] = ("pin", idx, blocks, until)
            self._progress(order, "completed")  # held: the order book counts a pin once confirmed
        elif order.kind == "demote":
            cluster.demote(idx, blocks)
            self.retained[order.order_id] = ("demote", idx, blocks, 0.0)
            self._progress(order, "completed")
        elif order.start_by_ts > now:
            cluster.call_at(order.start_by_ts, lambda: self._start(order, idx, blocks))
        else:
            self._start(order, idx, blocks)

    def withdraw(self, order_id: str) -> None:
        """A Cancel: a pin carried out is released now (its blocks in plain LRU order again), a
        demote's blocks go back to their places in LRU order; a prefetch not started never
        starts."""
        retained = self.retained.pop(order_id, None)
        if retained is None:
            self.cancelled.add(order_id)
            return
        kind, idx, blocks, _ = retained
        if kind == "pin":
            self.cluster.unkeep(idx, blocks)
        else:
            self.cluster.undemote(idx, blocks)

    def _forget_spent(self, now: float) -> None:
        """Pins past their end and demotes none of whose blocks is still demoted: nothing of
        them left to withdraw."""
        instances = self.cluster.instances
        spent = [
            order_id
            for order_id, (kind, idx, blocks, until) in self.retained.items()
            if (
                until <= now
                if kind == "pin"
                else not any(map(instances[idx].hbm.is_demoted, blocks))
            )
        ]
        for order_id in spent:
            del self.retained[order_id]

    def _start(self, order: Order, idx: int, blocks: list[int]) -> None:
        if order.order_id in self.cancelled:
            self.cancelled.discard(order.order_id)
            return
        if self.cluster.prefetch(idx, blocks, order.source_tier):
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


class ClairvoyantPolicy(PlannedPolicy):
    """The planner fed each session's true next arrival (sim/clairvoyant.py): learned from the
    cluster's requests when attached."""

    def attach(self, cluster: Cluster) -> None:
        super().attach(cluster)
        learn = getattr(self.engine.models.serving.predictor, "learn", None)
        if learn is not None:
            learn(cluster.requests)
