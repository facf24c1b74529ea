"""Per-client token buckets: a client may spend `rate` units a second, `burst_seconds` of them
at once."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

# Idle buckets are dropped past this many clients, the least recently seen first: a client
# forgotten this way starts again with a full bucket, which only errs on the generous side.
MAX_CLIENTS = 10_000


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class RateLimiter:
    def __init__(
        self,
        rate_per_second: float,
        burst_seconds: float,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        max_clients: int = MAX_CLIENTS,
    ) -> None:
        self.rate = rate_per_second
        self.capacity = max(1.0, rate_per_second * burst_seconds)
        self._now = monotonic
        self._max_clients = max_clients
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def take(self, client: str, cost: float = 1.0) -> float:
        """Spend `cost` of the client's bucket; 0 when allowed, else the seconds until it would be.

        A refused take spends nothing, so a client that backs off as told gets through. A cost
        larger than the whole bucket is charged against a full one (it waits for a full refill
        and then overdraws) rather than being refused forever.
        """
        if not self.enabled:
            return 0.0
        now = self._now()
        bucket = self._buckets.get(client)
        if bucket is None:
            bucket = self._buckets[client] = _Bucket(self.capacity, now)
            if len(self._buckets) > self._max_clients:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(client)
            bucket.tokens = min(self.capacity, bucket.tokens + (now - bucket.at) * self.rate)
            bucket.at = now
        needed = min(cost, self.capacity)
        if bucket.tokens >= needed:
            bucket.tokens -= cost
            return 0.0
        return (needed - bucket.tokens) / self.rate

    async def spend(self, client: str, cost: float = 1.0) -> float:
        """`take`, as the routes call a limiter (the fleet's one awaits Redis)."""
        return self.take(client, cost)


class Limiter(Protocol):
    """What the routes charge: a limiter in this replica or the fleet's (fleet_ratelimit.py)."""

    @property
    def enabled(self) -> bool: ...

    async def spend(self, client: str, cost: float = 1.0) -> float: ...


def retry_after(wait_seconds: float) -> str:
    """Retry-After in whole seconds, never 0 (a client told 0 retries at once, and is refused
    again)."""
    return str(max(1, math.ceil(wait_seconds)))
