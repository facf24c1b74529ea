"""The one interface every order sink implements, and the sink errors.

Delivery contract, the same for every sink (tests/deliver/test_sink_contract.py checks it on
each one):

- **Once per order id at the sink.** `submit` hands an order id to its transport at most once per
  dedupe window (`KVP_ORDER_DEDUPE_SECONDS`); a resubmission of the same id is dropped there and
  is not in what `submit` returns. The same holds for a `Cancel` per order id. A new plan for the
  same blocks gets a new id (`order_id_for`'s generation), so it is never taken for a resend.
- **At least once past the sink.** The transports may hand the same message over again (a webhook
  retry whose first try did land, a stream entry claimed from a consumer that died, a pull lease
  that expired). Consumers recognise a repeat by its `order_id` (and the webhook's
  `Idempotency-Key`): executing an id twice is the same as once
  (client/kvprefetch_client/orders.py).
- **A failed submit leaves what it did not deliver unmarked.** When `submit` raises, the ids it
  had not delivered yet are not remembered (those of batches that went before are), so
  submitting them again retries them.
- `close()` is idempotent; `submit` and `cancel` after it raise `SinkClosed`.

Errors, under app.core.errors.KvpError:

    KvpError
    +-- SinkError            an order sink failed
        +-- SinkUnavailable  the transport did not answer in time (retries spent): retry later
        +-- SinkRejected     the receiver refused the messages (HTTP 4xx other than 429): do not
        |                    retry them as they are
        +-- SinkClosed       the sink was closed
        +-- SinkFenced       this replica no longer holds the planning lease: nothing sent
                             (app/deliver/fence.py)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from app.core.errors import KvpError
from kvprefetch_client.orders import Cancel, Order


class SinkError(KvpError):
    pass


class SinkUnavailable(SinkError):
    pass


class SinkRejected(SinkError):
    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class SinkClosed(SinkError):
    pass


class SinkFenced(SinkError):
    pass


@runtime_checkable
class OrderSink(Protocol):
    """Where the scheduler's orders and cancels go; every method is a coroutine."""

    async def submit(self, orders: Sequence[Order]) -> list[str]:
        """Deliver orders; returns the ids delivered now (not the resubmissions dropped)."""
        ...

    async def cancel(self, cancels: Sequence[Cancel]) -> list[str]:
        """Deliver cancels; returns the order ids whose cancel was delivered now."""
        ...

    async def close(self) -> None:
        """Release the transport; idempotent."""
        ...
