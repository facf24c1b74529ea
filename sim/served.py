"""The `service` policy: a running service's own orders drive the simulated cluster.

`kvprefetch replay --via URL --speed X --policy service`. With the other policies an over-HTTP
replay decides in the simulator and the service only watches; here the simulator decides nothing.
The cluster is what a deployment's engines and transfer agents would be to the service:

- its engines report each instance's room (instance_status: total and free KV bytes, queue,
  running requests) at every finish, as the cluster does for any policy, and at every poll, as an
  engine does on a timer;
- every poll (`poll_seconds` of the trace) it leases each instance's orders from the service's
  pull queue (GET /v1/orders, as the reference agent's
  PullSource does) and carries them out in the simulated tiers: a prefetch starts at its
  start_by (the cluster's `prefetch`: over the instance's simulated link, making room by its
  eviction order, and held on landing for the order's ttl with `keep`), a pin is `keep` for its
  ttl, a demote is `demote`; an order cancelled before it started is dropped;
- it reports each order's progress as an agent does: `accepted` when it starts, `completed` (bytes
  moved, time to last byte) when its last block has landed, or `failed` (no room); the landed
  blocks themselves reach the service as the cluster's kv_blocks_stored events.

So the service's scheduler sees its orders issued, accepted, landed and, when a session comes back
where they went, used: the totals of GET /v1/scheduler and the dashboard's prefetch charts are the
service's own, from its own orders. Times cross over as in sim/remote.py: the orders' times are
translated back to the trace's, their durations (ttl) are scaled to the trace's, and a completed
order's seconds are the service's.

It needs a paced run (`--speed X`): the service plans on its own clock. Start the service with
KVP_CLOCK_SPEED=X too (as `make demo` does), so that its clock runs at the trace's pace and what it
reads (idle times, a signal's age, its lead and TTLs, link time) are the trace's durations; on the
wall clock every trace second would last 1/X of its seconds, and its model and thresholds, made
for live traffic, would see a world X times faster than the one they were made for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sim.policies import Policy

if TYPE_CHECKING:
    from kvprefetch_client.orders import Order
    from sim.cluster import Cluster
    from sim.remote import RemoteService

# How often the cluster asks for orders, in the trace's seconds (at --speed 20, 20 polls of each
# instance a wall-clock second): well within a signal's lead of seconds.
DEFAULT_POLL_SECONDS = 1.0
ORDERS_PER_PULL = 1000  # GET /v1/orders' most


@dataclass(slots=True)
class _Landing:
    """A prefetch started and not yet landed: the blocks still to land."""

    idx: int
    waiting: set[int]
    nbytes: int
    started_at: float


@dataclass(slots=True)
class ServedTotals:
    """What the cluster did with the service's orders (the replay's summary, `service_orders`)."""

    pulled: dict[str, int] = field(default_factory=lambda: {"prefetch": 0, "pin": 0, "demote": 0})
    accepted: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0  # withdrawn by the service before they started
    bytes_landed: int = 0


class ServicePolicy(Policy):
    """The cluster as the service's transfer layer. `remote` is the replay's engine (sim/remote.py),
    paced; the cluster emits through it."""

    name = "service"

    def __init__(
        self, remote: RemoteService, *, poll_seconds: float = DEFAULT_POLL_SECONDS
    ) -> None:
        if remote.speed is None:
            raise ValueError(
                "the service policy runs on the service's clock: pace the replay with --speed"
            )
        if not 0 < poll_seconds < float("inf"):
            raise ValueError(f"poll_seconds {poll_seconds!r}: a positive number of seconds")
        self.remote = remote
        self.tick_seconds = poll_seconds
        self.totals = ServedTotals()
        self._seen: set[str] = set()  # order ids taken: a lease that ran out hands one out again
        self._cancelled: set[str] = set()
        self._landing: dict[str, _Landing] = {}
        self._index: dict[str, int] = {}
        remote.listeners.append(self._heard)

    def attach(self, cluster: Cluster) -> None:
        super().attach(cluster)
        # The cluster ticks from 0; a trace's slice may start much later, and a tick's status
        # reports would pace the run through the empty stretch before it.
        self._first_arrival = min((r.arrival for r in cluster.requests), default=0.0)

    def on_tick(self, now: float) -> None:
        cluster = self.cluster
        if now < self._first_arrival:
            return
        if not self._index:
            self._index = {inst.instance_id: inst.idx for inst in cluster.instances}
        for inst in cluster.instances:  # paced: this is what waits for the tick's wall time
            cluster.report_status(inst)
        for inst in cluster.instances:
            orders, cancelled = self.remote.pull_orders(inst.instance_id, ORDERS_PER_PULL)
            self._cancelled.update(cancelled)
            for order in orders:
                if order.order_id not in self._seen:
                    self._seen.add(order.order_id)
                    self._take(order, inst.idx, now)

    def summary(self) -> dict[str, Any]:
        t = self.totals
        return {
            "service_orders": {
                "pulled": dict(t.pulled),
                "accepted": t.accepted,
                "completed": t.completed,
                "failed": t.failed,
                "cancelled": t.cancelled,
                "bytes_landed": t.bytes_landed,
            }
        }

    # -- carrying orders out -----------------------------------------------------------------

    def _take(self, order: Order, idx: int, now: float) -> None:
        self.totals.pulled[order.kind] += 1
        blocks = [int(b) for b in order.block_hashes]
        if order.kind == "prefetch":
            self.cluster.call_at(order.start_by_ts, lambda: self._start(order, idx, blocks))
            return
        hbm = self.cluster.instances[idx].hbm
        there = [b for b in dict.fromkeys(blocks) if b in hbm]
        if order.kind == "pin":
            self.cluster.keep(idx, blocks, now + (order.ttl_seconds or 0.0))
        else:
            self.cluster.demote(idx, blocks)
        self._progress(order.order_id, "accepted")
        self._progress(
            order.order_id, "completed", bytes=len(there) * self.cluster.block_bytes, seconds=0.0
        )

    def _start(self, order: Order, idx: int, blocks: list[int]) -> None:
        cluster = self.cluster
        if order.order_id in self._cancelled:
            self._cancelled.discard(order.order_id)
            self.totals.cancelled += 1
            return
        inst = cluster.instances[idx]
        # Blocks to wait for: absent (and in the pool: the scheduler orders only those), or
        # landing already by some other transfer.
        wanted = [b for b in dict.fromkeys(blocks) if b not in inst.hbm and b in cluster.written]
        moved = cluster.prefetch(idx, blocks)
        if wanted and not moved:
            self._progress(order.order_id, "failed", reason="no room at the destination")
            return
        if order.ttl_seconds:  # held for the return it was fetched for
            cluster.keep(idx, blocks, cluster.now + order.ttl_seconds)
        self._progress(order.order_id, "accepted")
        waiting = {b for b in blocks if b in inst.inflight}
        nbytes = moved * cluster.block_bytes
        if not waiting:
            self._completed(order.order_id, nbytes, 0.0)
            return
        self._landing[order.order_id] = _Landing(idx, waiting, nbytes, cluster.now)

    def _heard(self, kind: str, ts: float, fields: dict[str, Any]) -> None:
        """Every event the cluster emits: an instance's blocks landing finish its prefetches."""
        if kind != "kv_blocks_stored" or fields.get("tier") != "hbm" or not self._landing:
            return
        idx = self._index.get(fields.get("instance_id") or "")
        landed = set(fields["block_hashes"])
        for order_id, landing in list(self._landing.items()):
            if landing.idx != idx:
                continue
            landing.waiting -= landed
            if not landing.waiting:
                del self._landing[order_id]
                self._completed(order_id, landing.nbytes, ts - landing.started_at)

    def _completed(self, order_id: str, nbytes: int, trace_seconds: float) -> None:
        self.totals.bytes_landed += nbytes
        seconds = trace_seconds / self.remote.trace_seconds_per_service_second
        self._progress(order_id, "completed", bytes=nbytes, seconds=seconds)

    def _progress(self, order_id: str, status: str, **fields: Any) -> None:
        if status == "accepted":
            self.totals.accepted += 1
        elif status == "completed":
            self.totals.completed += 1
        elif status == "failed":
            self.totals.failed += 1
        self.remote.post_progress(self.cluster.now, order_id, status, **fields)
