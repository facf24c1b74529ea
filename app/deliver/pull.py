"""PullQueue: orders wait in this process until their instance's agent pulls them
(`GET /v1/orders?instance_id=...`).

The queues live in memory, one per instance, in *this replica*: an agent must pull from the
replica that made its orders (with several replicas behind a balancer, use the Redis stream
sink). A restart loses what was queued; the scheduler plans again from the live state.

An order's life here:

- **pending**: submitted, handed out by `lease()` at most `limit` at a time, highest `priority`
  first, then earliest `start_by_ts`, then oldest. A lease lasts `lease_seconds`; an order whose
  lease ran out without word from the agent is handed out again (at least once: run an id once).
  An agent that names itself (`agent`) keeps what it leased by `renew()` while it holds it
  (waiting for its start, or behind a long transfer): the reference agent renews a third of
  a lease apart, so only an agent that stopped renewing (dead, or cut off) loses its orders. A
  renewal of an order another agent has leased since, or that is gone, is refused: the order is
  `lost` to the renewing agent, which must not start it.
- **started**: an `order_progress` event with status `accepted` arrived. It is never handed out
  again, lease or not; if the agent dies mid-transfer, no completion comes: the scheduler gives
  the order up `overdue_seconds` (KVP_ORDER_OVERDUE_SECONDS) past its needed_by and may plan
  its blocks again (a new generation, so a new id).
- **done**: `completed` or `failed` arrived; the order is forgotten (its id stays in the dedupe
  window, so a resubmission is still dropped).
- **expired**: held `lease_seconds` past its `needed_by_ts` without finishing: too late to be of
  use, dropped (counted in `stats["expired"]`) at the next lease of any instance, by its `now`,
  or at a later submit, by the newest `created_ts` submitted (the scheduler's clock, the one
  `now` and `needed_by_ts` come from). The submit side is what bounds the memory of an instance
  whose agent never pulls (or vanished): without it, its orders piled up until a pull.

A cancel of a held order removes it unless it has started (one moving finishes), and its id is
reported once, in `cancelled`, to the next lease of its instance, unless the order's expiry
comes first (it is moot then, and an instance nobody pulls for would pile reports up). A cancel
or a progress event for an order this queue does not hold (another replica's, done, or expired)
is a no-op.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import orjson

from app.deliver._dedupe import RecentIds
from app.deliver.base import OrderSink, SinkClosed
from kvprefetch_client.events import Event, OrderProgress
from kvprefetch_client.orders import Cancel, Order

DEFAULT_LEASE_SECONDS = 30.0


@dataclass(slots=True)
class _Held:
    order: Order
    seq: int
    leased_until: float | None = None
    holder: str | None = None  # the agent that leased it last, when it said
    started: bool = False
    cancelled: bool = False


@dataclass(frozen=True, slots=True)
class Lease:
    """What one pull hands an agent: orders to run, and ids of orders withdrawn since its last
    pull."""

    orders: list[Order] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    lease_seconds: float | None = None

    def to_json(self) -> bytes:
        """`{"orders": [...], "cancelled": [...], "lease_seconds": s}`, each order exactly its
        `Order.to_json()` (no `lease_seconds` where None)."""
        tail = (
            b',"lease_seconds":' + orjson.dumps(self.lease_seconds)
            if self.lease_seconds is not None
            else b""
        )
        return (
            b'{"orders":['
            + b",".join(o.to_json() for o in self.orders)
            + b'],"cancelled":'
            + orjson.dumps(self.cancelled)
            + tail
            + b"}"
        )


class PullQueue(OrderSink):
    """All methods are synchronous and meant for one thread (the service's event loop); `submit`
    and `cancel` are the OrderSink coroutines over `submit_nowait` and `cancel_nowait`."""

    def __init__(
        self,
        *,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        dedupe_seconds: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lease_seconds = lease_seconds
        self._by_instance: dict[str, dict[str, _Held]] = {}
        self._instance_of: dict[str, str] = {}
        # Cancelled ids to report, per instance: id -> when it expires (its order's expiry).
        self._to_report: dict[str, dict[str, float]] = {}
        # (expiry, seq, order id, instance) of every order submitted, soonest first; an entry
        # whose order is gone (done, cancelled) stays until its time or the next compaction.
        self._expiries: list[tuple[float, int, str, str]] = []
        self._compact_at = 1024
        self._submitted_now = -math.inf
        self._orders = RecentIds(dedupe_seconds, clock=clock)
        self._seq = 0
        self._closed = False
        self.stats = {
            "submitted": 0,
            "leased": 0,
            "renewed": 0,
            "lost": 0,
            "cancelled": 0,
            "started": 0,
            "done": 0,
            "expired": 0,
        }

    async def submit(self, orders: Sequence[Order]) -> list[str]:
        return self.submit_nowait(orders)

    async def cancel(self, cancels: Sequence[Cancel]) -> list[str]:
        return self.cancel_nowait(cancels)

    async def close(self) -> None:
        self._closed = True

    def submit_nowait(self, orders: Sequence[Order]) -> list[str]:
        self._check_open()
        added = []
        for order in orders:
            if order.created_ts > self._submitted_now:
                self._submitted_now = order.created_ts
            if not self._orders.add(order.order_id):
                continue
            self._seq += 1
            self._by_instance.setdefault(order.instance_id, {})[order.order_id] = _Held(
                order, self._seq
            )
            self._instance_of[order.order_id] = order.instance_id
            heapq.heappush(
                self._expiries,
                (
                    order.needed_by_ts + self.lease_seconds,
                    self._seq,
                    order.order_id,
                    order.instance_id,
                ),
            )
            added.append(order.order_id)
        self.stats["submitted"] += len(added)
        # At most a few expiries per order submitted (each order expires once, so this keeps up)
        # so a submit never stalls on a backlog.
        self._expire(self._submitted_now, limit=2 * len(orders) + 16)
        return added

    def cancel_nowait(self, cancels: Sequence[Cancel]) -> list[str]:
        self._check_open()
        done = []
        for c in cancels:
            held = self._held(c.order_id)
            if held is None or held.cancelled:
                continue
            held.cancelled = True
            instance = held.order.instance_id
            if not held.started:
                self._forget(c.order_id)
            self._to_report.setdefault(instance, {})[c.order_id] = (
                held.order.needed_by_ts + self.lease_seconds
            )
            done.append(c.order_id)
        self.stats["cancelled"] += len(done)
        return done

    def lease(self, instance_id: str, limit: int, now: float, agent: str | None = None) -> Lease:
        """Up to `limit` orders for `instance_id` not leased or whose lease ran out, leased until
        `now + lease_seconds` (to `agent`, which may renew them); and every cancel for it not
        reported yet."""
        self._check_open()
        self._expire(now)
        queue = self._by_instance.get(instance_id, {})
        free = [
            h
            for h in queue.values()
            if not h.started
            and not h.cancelled
            and (h.leased_until is None or h.leased_until <= now)
        ]
        free.sort(key=lambda h: (-h.order.priority, h.order.start_by_ts, h.seq))
        chosen = free[:limit]
        for h in chosen:
            h.leased_until, h.holder = now + self.lease_seconds, agent
        self.stats["leased"] += len(chosen)
        return Lease(
            [h.order for h in chosen],
            list(self._to_report.pop(instance_id, {})),
            self.lease_seconds,
        )

    def renew(
        self, instance_id: str, agent: str, order_ids: Sequence[str], now: float
    ) -> tuple[list[str], list[str]]:
        """Extend `agent`'s leases of `order_ids` to `now + lease_seconds`: (renewed, lost).

        Renewed: still this agent's (its lease may have run out, if nobody leased it since), or
        started (it needs no lease). Lost: gone (done, cancelled, expired, unknown, another
        instance's) or leased to another agent since: the caller must not start it."""
        self._check_open()
        self._expire(now)
        renewed, lost = [], []
        for order_id in dict.fromkeys(order_ids):
            held = self._held(order_id)
            if held is None or held.order.instance_id != instance_id or held.cancelled:
                lost.append(order_id)
            elif held.started:
                renewed.append(order_id)
            elif held.holder != agent or held.leased_until is None:
                lost.append(order_id)
            else:
                held.leased_until = max(held.leased_until, now + self.lease_seconds)
                renewed.append(order_id)
        self.stats["renewed"] += len(renewed)
        self.stats["lost"] += len(lost)
        return renewed, lost

    def observe(self, events: Sequence[Event]) -> None:
        """The ingest observer: order_progress moves an order to started or done."""
        for e in events:
            if type(e) is not OrderProgress:
                continue
            held = self._held(e.order_id)
            if held is None:
                continue
            if e.status == "accepted":
                if not held.started:
                    held.started = True
                    self.stats["started"] += 1
            else:
                self._forget(e.order_id)
                self.stats["done"] += 1

    def owner(self, order_id: str) -> tuple[str, str | None] | None:
        """A held order's instance and the agent it was leased to last (None: unnamed or not
        leased yet); None when this queue does not hold it."""
        held = self._held(order_id)
        return None if held is None else (held.order.instance_id, held.holder)

    def held(self, instance_id: str | None = None) -> int:
        """Orders held (pending or started), for one instance or all."""
        if instance_id is None:
            return len(self._instance_of)
        return len(self._by_instance.get(instance_id, {}))

    def _held(self, order_id: str) -> _Held | None:
        instance = self._instance_of.get(order_id)
        return None if instance is None else self._by_instance[instance].get(order_id)

    def _expire(self, now: float, limit: float = math.inf) -> None:
        """Drop the orders, and the cancel reports, whose expiry is before `now`: up to `limit`
        entries of the expiry heap."""
        expiries = self._expiries
        while expiries and expiries[0][0] < now and limit > 0:
            _, seq, order_id, instance = heapq.heappop(expiries)
            limit -= 1
            if self._holds(order_id, seq):
                self._forget(order_id)
                self.stats["expired"] += 1
            reports = self._to_report.get(instance)
            if reports is not None and reports.pop(order_id, None) is not None and not reports:
                del self._to_report[instance]
        if len(expiries) > self._compact_at:
            # Rebuild from the orders held and the reports pending; amortised, since at least as
            # many entries as were kept must be pushed before the next rebuild.
            kept = [
                e
                for e in expiries
                if self._holds(e[2], e[1]) or e[2] in self._to_report.get(e[3], ())
            ]
            heapq.heapify(kept)
            self._expiries = kept
            self._compact_at = 2 * len(kept) + 1024

    def _holds(self, order_id: str, seq: int) -> bool:
        """Whether the order submitted as `seq` is still held (not a later one of the same id)."""
        held = self._held(order_id)
        return held is not None and held.seq == seq

    def _forget(self, order_id: str) -> None:
        instance = self._instance_of.pop(order_id)
        queue = self._by_instance[instance]
        del queue[order_id]
        if not queue:
            del self._by_instance[instance]

    def _check_open(self) -> None:
        if self._closed:
            raise SinkClosed("the pull order queue is closed")
