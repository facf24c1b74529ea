"""Fakes for the agent's seams: a clock, a scripted source, a recording reporter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from kvprefetch_client.agent.consumer import Delivery, parse
from kvprefetch_client.orders import Cancel, Order

T0 = 1_767_000_000.0


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeSource:
    """Hands over each scripted message once the clock reaches its arrival time; a poll with
    nothing to hand over "blocks" by moving the clock on."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.inbox: list[tuple[float, Delivery]] = []
        self.acked: list[str] = []
        self.bound: list[str] = []
        self.cancelled_elsewhere: set[str] = set()
        self._n = 0

    def add(self, message: Order | Cancel | bytes, at: float | None = None) -> str:
        self._n += 1
        token = f"{self._n}-0"
        raw = message if isinstance(message, bytes) else message.to_json()
        self.inbox.append((self.clock.now if at is None else at, parse(token, raw)))
        return token

    def bind(self, instance_id: str) -> None:
        self.bound.append(instance_id)

    def poll(self, max_wait_seconds: float) -> list[Delivery]:
        ready = [d for t, d in self.inbox if t <= self.clock.now]
        if ready:
            self.inbox = [(t, d) for t, d in self.inbox if t > self.clock.now]
            return ready
        later = [t for t, _ in self.inbox if t > self.clock.now]
        step = max_wait_seconds if not later else min(max_wait_seconds, min(later) - self.clock.now)
        self.clock.now += step
        return []

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        self.acked.extend(d.token for d in deliveries)

    def is_cancelled(self, order_id: str) -> bool:
        return order_id in self.cancelled_elsewhere

    def close(self) -> None:
        pass


class FakeReporter:
    def __init__(self) -> None:
        self.events: list[BaseModel] = []
        self.answering = True
        self.flushes = 0

    def send(self, event: BaseModel) -> None:
        self.events.append(event)

    def flush(self, timeout: float | None = None) -> bool:
        self.flushes += 1
        return self.answering

    def of_type(self, type_: str) -> list[Any]:
        return [e for e in self.events if getattr(e, "type", None) == type_]

    def progress(self, order_id: str | None = None) -> list[tuple[str, str]]:
        return [
            (e.order_id, e.status)
            for e in self.of_type("order_progress")
            if order_id is None or e.order_id == order_id
        ]


def order(
    order_id: str,
    blocks: list[Any],
    *,
    kind: str = "prefetch",
    start_in: float = 0.0,
    instance_id: str = "gpu-0",
    ttl_seconds: float | None = None,
    priority: float = 0.0,
    source_tier: str | None = "pool",
    now: float = T0,
) -> Order:
    return Order(
        order_id=order_id,
        kind=kind,
        instance_id=instance_id,
        source_tier=source_tier if kind == "prefetch" else None,
        block_hashes=blocks,
        size_bytes=0,
        created_ts=now,
        start_by_ts=now + start_in,
        needed_by_ts=now + start_in + 5.0,
        ttl_seconds=ttl_seconds,
        priority=priority,
    )
