"""InProcessSink: orders and cancels kept in a list, in the order they came; for the replay
simulator and tests, which read them back with the synchronous `drain()`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from app.deliver._dedupe import RecentIds
from app.deliver.base import OrderSink, SinkClosed
from kvprefetch_client.orders import Cancel, Order

DEFAULT_DEDUPE_SECONDS = 3600.0


class InProcessSink(OrderSink):
    """Delivery is the append: once per order id (and per cancelled id) within the window.

    `submit_nowait` and `cancel_nowait` are the same as `submit` and `cancel` without a loop, for
    synchronous callers such as the simulator.
    """

    def __init__(
        self,
        *,
        dedupe_seconds: float = DEFAULT_DEDUPE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._messages: list[Order | Cancel] = []
        self._orders = RecentIds(dedupe_seconds, clock=clock)
        self._cancels = RecentIds(dedupe_seconds, clock=clock)
        self._closed = False

    async def submit(self, orders: Sequence[Order]) -> list[str]:
        return self.submit_nowait(orders)

    async def cancel(self, cancels: Sequence[Cancel]) -> list[str]:
        return self.cancel_nowait(cancels)

    async def close(self) -> None:
        self._closed = True

    def submit_nowait(self, orders: Sequence[Order]) -> list[str]:
        self._check_open()
        fresh = [o for o in orders if self._orders.add(o.order_id)]
        self._messages.extend(fresh)
        return [o.order_id for o in fresh]

    def cancel_nowait(self, cancels: Sequence[Cancel]) -> list[str]:
        self._check_open()
        fresh = [c for c in cancels if self._cancels.add(c.order_id)]
        self._messages.extend(fresh)
        return [c.order_id for c in fresh]

    def drain(self) -> list[Order | Cancel]:
        """Everything delivered since the last drain, orders and cancels interleaved as they
        came."""
        messages, self._messages = self._messages, []
        return messages

    @property
    def pending(self) -> int:
        """Messages delivered and not drained yet."""
        return len(self._messages)

    def _check_open(self) -> None:
        if self._closed:
            raise SinkClosed("the in-process order sink is closed")
