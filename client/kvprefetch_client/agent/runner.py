"""The agent's loop: take orders, wait for their start time, move the bytes, report, then ack.

One order runs at a time (a transfer is bound by one link's throughput; running two at once
would only make both late). Between transfers the loop reads new messages, so a Cancel that
arrives while its order waits for `start_by_ts` withdraws it; one for a pin or demote already
completed has the tier undo it (`Tier.withdraw`: the pin released, the demoted blocks back in LRU
order), as the service does when the LRU guard turns the instance's advice off.

What is promised, and how:

- At-least-once: a message is acked only after the service has answered for the events that
  report its outcome (`Reporter.flush`). An agent that dies before that leaves the message
  pending, and another agent takes it over and does it again.
- Done once, as far as anyone can see: progress event ids are derived from the order id
  (`progress_event_id`), so a second agent's report of the same order is a duplicate the service
  acknowledges and ignores; this agent also keeps a done-set, so a redelivered order it finished
  is acked without being done again.
- Never stuck on a message: one that does not parse is logged and acked (redelivering it would
  fail the same way, for ever); an order that cannot be done is reported failed, with a reason.

Time comes from injected functions (`clock` for event timestamps and start times, `timer` for
measuring a transfer), so the tests drive it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel

from kvprefetch_client.agent.buffer import HbmBuffer, PoolDir
from kvprefetch_client.agent.consumer import Delivery, OrderSource
from kvprefetch_client.agent.tier import BufferTier, Done, Tier
from kvprefetch_client.events import (
    BlockHash,
    KvBlocksCleared,
    KvBlocksRemoved,
    KvBlocksStored,
    OrderProgress,
)
from kvprefetch_client.orders import Cancel, Order

log = logging.getLogger("kvprefetch.agent")

# Event ids are at most 128 characters; longer order ids are hashed into them.
_MAX_ORDER_ID_IN_EVENT_ID = 100


class Reporter(Protocol):
    """Where events go: `KvpClient` is one (its background sender retries with the same ids)."""

    def send(self, event: BaseModel) -> None: ...

    def flush(self, timeout: float | None = None) -> bool:
        """True once the service has answered for every event sent before the call."""
        ...


def _because(reason: str) -> str:
    return f" ({reason})" if reason else ""


def progress_event_id(order_id: str, status: str) -> str:
    """The same for every agent that reports this order's status: the service counts it once."""
    if len(order_id) > _MAX_ORDER_ID_IN_EVENT_ID:
        order_id = "h-" + hashlib.blake2b(order_id.encode(), digest_size=16).hexdigest()
    return f"order-{order_id}-{status}"


@dataclass(frozen=True, slots=True)
class Outcome:
    status: Literal["completed", "failed"]
    bytes: int = 0
    seconds: float = 0.0
    reason: str | None = None


@dataclass(slots=True)
class AgentStats:
    completed: int = 0
    failed: int = 0
    withdrawn: int = 0  # cancelled before they started
    undone: int = 0  # pins and demotes completed, then cancelled (the tier undid them)
    repeats: int = 0  # deliveries of an order already pending or done
    malformed: int = 0
    foreign: int = 0  # orders for another instance (misrouted), acked and dropped
    bytes_moved: int = 0
    last_ttlb_seconds: float | None = None
    last_bytes: int | None = None


@dataclass(slots=True)
class _Pending:
    order: Order
    due_ts: float
    seq: int
    deliveries: list[Delivery] = field(default_factory=list)


class _BoundedSet:
    """Remembers the last `capacity` keys (order ids): enough to recognise a redelivery."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._keys: OrderedDict[str, str] = OrderedDict()

    def add(self, key: str, value: str = "") -> None:
        self._keys[key] = value
        self._keys.move_to_end(key)
        while len(self._keys) > self._capacity:
            self._keys.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def get(self, key: str) -> str | None:
        return self._keys.get(key)


class Agent:
    """A transfer agent for one instance: fills its tier (`tier`, or a BufferTier made of `pool`
    and `buffer`), reporting to the service."""

    def __init__(
        self,
        *,
        instance_id: str,
        source: OrderSource,
        reporter: Reporter,
        tier: Tier | None = None,
        pool: PoolDir | None = None,
        buffer: HbmBuffer | None = None,
        clock: Callable[[], float] = time.time,
        timer: Callable[[], float] = time.perf_counter,
        start_margin_seconds: float = 0.05,
        poll_seconds: float = 0.5,
        flush_timeout_seconds: float = 2.0,
        done_capacity: int = 100_000,
        on_change: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.instance_id = instance_id
        source.bind(instance_id)  # a stream source reads this instance's stream
        self.source = source
        if tier is None:
            if pool is None or buffer is None:
                raise ValueError("an Agent needs a tier, or a pool and a buffer")
            tier = BufferTier(instance_id, pool, buffer, timer)
        self.tier = tier
        self.reporter = reporter
        self._clock = clock
        self._timer = timer
        self._margin = start_margin_seconds
        self._poll = poll_seconds
        self._flush_timeout = flush_timeout_seconds
        self._on_change = on_change
        self._pending: dict[str, _Pending] = {}
        self._seq = 0
        self._done = _BoundedSet(done_capacity)
        self._cancelled = _BoundedSet(done_capacity)
        # Pins and demotes completed, which a Cancel may still undo: order id -> the order.
        self._retained: OrderedDict[str, Order] = OrderedDict()
        self._retained_capacity = done_capacity
        self._foreign_logged = _BoundedSet(1000)
        self._to_ack: list[Delivery] = []
        self._settle_failing = False
        self._dirty = False
        self.stats = AgentStats()

    # -- the loop ---------------------------------------------------------------------------

    def start(self) -> None:
        """Say the instance tier is empty: this buffer starts so, whatever an earlier agent left."""
        self._send(
            KvBlocksCleared(
                event_id=f"agent-{uuid.uuid4().hex}",
                ts=self._clock(),
                tier="hbm",
                instance_id=self.instance_id,
            )
        )
        self._changed()
        self._publish()

    def run(self, stop: threading.Event) -> None:
        self.start()
        failing = False
        while not stop.is_set():
            try:
                self.run_once()
            except Exception as exc:
                # One traceback per outage, not one per poll.
                if not failing:
                    log.exception("agent loop failed (trying again every %.2f s)", self._poll)
                else:
                    log.debug("agent loop failed again: %s", exc)
                failing = True
                stop.wait(self._poll)
                continue
            if failing:
                log.info("agent loop going again")
                failing = False
        try:
            self._settle()  # what is reported by now need not be redone by another agent
        except Exception as exc:
            log.warning("could not ack on the way out (%s): another agent will redo them", exc)
        self._publish()

    def run_once(self) -> None:
        """One turn: ack what is reported, take what arrived (waiting at most until the next
        order is due), run what is due."""
        self._settle()
        for delivery in self.source.poll(self._wait_seconds()):
            self._take(delivery)
        self._run_due()
        self._settle()
        self._publish()

    def pending_order_ids(self) -> list[str]:
        return sorted(self._pending, key=lambda k: self._pending[k].seq)

    def status(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "pending_orders": self.pending_order_ids(),
            **self.tier.status(),
            **asdict(self.stats),
        }

    # -- taking messages ----------------------------------------------------------------------

    def _wait_seconds(self) -> float:
        if not self._pending:
            return self._poll
        next_due = min(p.due_ts for p in self._pending.values())
        return max(0.0, min(self._poll, next_due - self._clock()))

    def _take(self, d: Delivery) -> None:
        if d.message is None:
            self.stats.malformed += 1
            log.warning(
                "malformed orders message %s (%s): acked and dropped, since it would "
                "fail the same way every time; it was %r",
                d.token or "(pulled)",
                d.error,
                d.raw[:200],
            )
            self._to_ack.append(d)
        elif isinstance(d.message, Cancel):
            self._take_cancel(d, d.message)
        else:
            self._take_order(d, d.message)
        self._changed()

    def _take_cancel(self, d: Delivery, cancel: Cancel) -> None:
        self._to_ack.append(d)
        order_id = cancel.order_id
        if order_id in self._done:
            # Started already: a started order finishes; a pin or demote done is undone.
            retained = self._retained.pop(order_id, None)
            if retained is not None:
                self.tier.withdraw(retained, self._clock())
                self.stats.undone += 1
                log.info("%s %s undone%s", retained.kind, order_id, _because(cancel.reason))
            return
        self._cancelled.add(order_id)
        pending = self._pending.pop(order_id, None)
        if pending is not None:
            self._withdraw(pending.order, pending.deliveries, cancel.reason)

    def _withdraw(self, order: Order, deliveries: list[Delivery], reason: str) -> None:
        # No progress event: the service withdrew the order and knows it.
        self.stats.withdrawn += 1
        self._done.add(order.order_id, "withdrawn")
        self._to_ack.extend(deliveries)
        log.info("order %s withdrawn before it started%s", order.order_id, _because(reason))

    def _take_order(self, d: Delivery, order: Order) -> None:
        order_id = order.order_id
        if order_id in self._done:
            self.stats.repeats += 1
            self._to_ack.append(d)  # done (or withdrawn) already: a no-op
        elif order.instance_id != self.instance_id:
            # Someone else's, which neither source hands over unless misconfigured (a writer that
            # bypassed the sink put it in this instance's stream): no agent of its instance reads
            # this stream, so leaving it unacked would only pass it round this instance's agents.
            # Acked and dropped, without a progress event (this agent did not try it).
            self.stats.foreign += 1
            if order_id not in self._foreign_logged:
                self._foreign_logged.add(order_id)
                log.warning(
                    "order %s is for instance %s, not %s: misrouted, acked and dropped",
                    order_id,
                    order.instance_id,
                    self.instance_id,
                )
            self._to_ack.append(d)
        elif order_id in self._cancelled:
            self._withdraw(order, [d], "cancelled before it arrived")
        elif order_id in self._pending:
            self.stats.repeats += 1
            self._pending[order_id].deliveries.append(d)
        else:
            self._seq += 1
            self._pending[order_id] = _Pending(
                order, order.start_by_ts - self._margin, self._seq, [d]
            )

    # -- running orders -----------------------------------------------------------------------

    def _run_due(self) -> None:
        while True:
            now = self._clock()
            due = [p for p in self._pending.values() if p.due_ts <= now]
            if not due:
                return
            # Everything due is late or on time: the most valuable goes first.
            p = min(due, key=lambda p: (-p.order.priority, p.due_ts, p.seq))
            self._execute(p)
            if len(due) > 1:
                # A cancel may have come in for what is still waiting.
                for delivery in self.source.poll(0):
                    self._take(delivery)

    def _cancelled_elsewhere(self, order_id: str) -> bool:
        try:
            return self.source.is_cancelled(order_id)
        except Exception as exc:
            log.warning(
                "could not check whether order %s was cancelled (%s): starting it", order_id, exc
            )
            return False

    def _execute(self, p: _Pending) -> None:
        order = p.order
        del self._pending[order.order_id]
        if self._cancelled_elsewhere(order.order_id):
            # Another agent read the Cancel; the stream's cancel key says so.
            self._withdraw(order, p.deliveries, "cancelled")
            self._changed()
            return
        self._send(
            OrderProgress(
                event_id=progress_event_id(order.order_id, "accepted"),
                ts=self._clock(),
                order_id=order.order_id,
                status="accepted",
            )
        )
        try:
            outcome = self._perform(order)
        except Exception as exc:
            log.exception("order %s failed unexpectedly", order.order_id)
            outcome = Outcome("failed", reason=f"agent error: {type(exc).__name__}: {exc}")
        if outcome.status == "completed":
            self.stats.completed += 1
            self.stats.bytes_moved += outcome.bytes
            self.stats.last_ttlb_seconds = outcome.seconds
            self.stats.last_bytes = outcome.bytes
            self._send(
                OrderProgress(
                    event_id=progress_event_id(order.order_id, "completed"),
                    ts=self._clock(),
                    order_id=order.order_id,
                    status="completed",
                    bytes=outcome.bytes,
                    seconds=outcome.seconds,
                )
            )
            rate = outcome.bytes / outcome.seconds / 1e9 if outcome.seconds > 0 else 0.0
            log.info(
                "order %s (%s, %d blocks) completed: %d bytes in %.4f s (%.2f GB/s)",
                order.order_id,
                order.kind,
                len(order.block_hashes),
                outcome.bytes,
                outcome.seconds,
                rate,
            )
        else:
            self.stats.failed += 1
            self._send(
                OrderProgress(
                    event_id=progress_event_id(order.order_id, "failed"),
                    ts=self._clock(),
                    order_id=order.order_id,
                    status="failed",
                    reason=outcome.reason,
                )
            )
            log.warning("order %s (%s) failed: %s", order.order_id, order.kind, outcome.reason)
        self._done.add(order.order_id, outcome.status)
        if outcome.status == "completed" and order.kind != "prefetch":
            self._retained[order.order_id] = order
            while len(self._retained) > self._retained_capacity:
                self._retained.popitem(last=False)
        self._to_ack.extend(p.deliveries)
        self._changed()

    def _perform(self, order: Order) -> Outcome:
        where = self.tier.where
        if order.tier != "hbm":
            return Outcome("failed", reason=f"this agent holds {where} only, not {order.tier}")
        if order.kind == "prefetch" and order.source_tier != "pool":
            return Outcome("failed", reason=f"this agent reads the pool, not {order.source_tier}")
        now = self._clock()
        done: Done
        if order.kind == "prefetch":
            done = self.tier.prefetch(order, now)
        elif order.kind == "pin":
            done = self.tier.pin(order, now)
        else:
            done = self.tier.demote(order, now)
        self._report_residency(done.landed, done.removed)
        if done.failure is not None:
            return Outcome("failed", reason=done.failure)
        return Outcome("completed", done.bytes, done.seconds)

    def _report_residency(self, landed: list[BlockHash], evicted: list[BlockHash]) -> None:
        ts = self._clock()
        if evicted:
            self._send(
                KvBlocksRemoved(
                    event_id=f"agent-{uuid.uuid4().hex}",
                    ts=ts,
                    tier="hbm",
                    instance_id=self.instance_id,
                    block_hashes=evicted,
                )
            )
        if landed:
            self._send(
                KvBlocksStored(
                    event_id=f"agent-{uuid.uuid4().hex}",
                    ts=ts,
                    tier="hbm",
                    instance_id=self.instance_id,
                    block_hashes=landed,
                )
            )

    # -- reporting and acking -----------------------------------------------------------------

    def _send(self, event: BaseModel) -> None:
        self.reporter.send(event)

    def _settle(self) -> None:
        """Ack what has been reported, once the service has answered for it."""
        if not self._to_ack:
            return
        if not self.reporter.flush(timeout=self._flush_timeout):
            if not self._settle_failing:
                log.warning(
                    "the service has not answered for %d messages' reports yet: they stay "
                    "unacked (and held) until it does",
                    len(self._to_ack),
                )
            self._settle_failing = True
            return
        self._settle_failing = False
        # Cleared only once acked: an ack that raises is tried again next turn (XACK is idempotent).
        self.source.ack(self._to_ack)
        self._to_ack = []
        self._changed()

    def _changed(self) -> None:
        self._dirty = True

    def _publish(self) -> None:
        if self._dirty and self._on_change is not None:
            self._dirty = False
            self._on_change(self.status())


# -- wiring for `kvprefetch agent` -------------------------------------------------------------


def write_status_file(path: Path) -> Callable[[dict[str, Any]], None]:
    """An `on_change` that keeps `path` holding the agent's status as JSON (replaced atomically,
    so a reader never sees half of it)."""
    import orjson

    def write(status: dict[str, Any]) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(orjson.dumps(status))
        tmp.replace(path)

    return write


def run_agent(
    *,
    instance_id: str,
    source: OrderSource,
    service_url: str,
    stop: threading.Event,
    pool_dir: Path | None = None,
    capacity_bytes: int | None = None,
    tier: Tier | None = None,
    status_file: Path | None = None,
    start_margin_seconds: float = 0.05,
    poll_seconds: float = 0.5,
    token: str | None = None,
) -> AgentStats:
    """Run an agent until `stop` is set, filling `tier` (or a BufferTier of `pool_dir` and
    `capacity_bytes`); closes the source, the tier and the reports on the way out."""
    from kvprefetch_client.client import KvpClient

    # Small linger: an agent's reports are few, and an ack waits on them.
    reporter = KvpClient(service_url, batch_size=100, flush_interval_seconds=0.005, token=token)
    try:
        # Inside: binding the source to the instance can fail (Redis away), and both still close.
        if tier is None:
            if pool_dir is None or capacity_bytes is None:
                raise ValueError("run_agent needs a tier, or a pool_dir and a capacity_bytes")
            tier = BufferTier(
                instance_id, PoolDir(pool_dir), HbmBuffer(capacity_bytes), time.perf_counter
            )
        agent = Agent(
            instance_id=instance_id,
            source=source,
            tier=tier,
            reporter=reporter,
            start_margin_seconds=start_margin_seconds,
            poll_seconds=poll_seconds,
            on_change=write_status_file(status_file) if status_file else None,
        )
        log.info("agent for %s: %s", instance_id, tier.where)
        agent.run(stop)
    finally:
        source.close()
        reporter.close()
        if tier is not None:
            tier.close()
    return agent.stats
