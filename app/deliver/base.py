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

A sink declares itself to the engine (no `isinstance` on sink types there): its `name` under
KVP_ORDER_SINK and `from_settings` (build_sink finds it by name), whether every replica reaches
its orders (`fleet_wide`: then a planning lease may move planning between replicas, and the
engine sets its `fence`), what it needs to hear of the accepted events (`attach` returns its
ingest observers, in the engine's one list of them) and which orders it holds (`owner`).

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

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from app.core.errors import ConfigError, KvpError
from kvprefetch_client.events import Event, OrderProgress
from kvprefetch_client.orders import Cancel, Order

if TYPE_CHECKING:
    import httpx

    from app.core.config import Settings
    from app.deliver.fence import Fence

# What an ingest observer is (app/ingest/ingestor.py's Observer): told each accepted batch.
SinkObserver = Callable[[Sequence[Event]], None]


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


@dataclass(frozen=True)
class SinkBinding:
    """What the engine hands a sink once it has built its parts (`OrderSink.attach`)."""

    # Where a sink's own order_progress goes: ingested as posted events are.
    report: Callable[[Sequence[OrderProgress]], Awaitable[None]]
    # The service's counters (a sink counts what it does there) and its clock.
    metrics: Any
    now: Callable[[], float]
    # An observer wrapped to be told on the engine's event loop, in order (what a sink whose
    # state belongs to the loop needs when the ingest runs on the store's thread).
    on_loop: Callable[[SinkObserver], SinkObserver]


class OrderSink(ABC):
    """Where the scheduler's orders and cancels go; `submit`, `cancel` and `close` are
    coroutines. Subclass it: the contract suite (tests/deliver/test_sink_contract.py) finds every
    subclass under app/ and runs the delivery contract on each."""

    # KVP_ORDER_SINK's value for it; None: a sink its caller builds (the replay's, a test's).
    name: ClassVar[str | None] = None
    # Every replica reaches its orders (Redis streams, a webhook, LMCache): a planning lease may
    # hand planning between replicas, and the engine sets `fence` so a lapsed term sends nothing.
    fleet_wide: ClassVar[bool] = False
    fence: Fence | None = None

    @classmethod
    def from_settings(
        cls, settings: Settings, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> OrderSink:
        """The sink as KVP_ settings configure it (`transport`: the HTTP sinks', for tests);
        a ConfigError, naming the setting, when they do not."""
        raise ConfigError(f"{cls.__name__} is not built from settings")

    def attach(self, binding: SinkBinding) -> list[SinkObserver]:
        """Take what the engine hands over; the ingest observers this sink needs (none by
        default), told in the engine's one order of them (app/engine.py, Engine.observers)."""
        return []

    def owner(self, order_id: str) -> tuple[str | None, str | None] | None:
        """A held order's instance and the agent it is leased to; None for an order this sink
        does not hold (the default: a sink that hands orders on and keeps none)."""
        return None

    @abstractmethod
    async def submit(self, orders: Sequence[Order]) -> list[str]:
        """Deliver orders; returns the ids delivered now (not the resubmissions dropped)."""

    @abstractmethod
    async def cancel(self, cancels: Sequence[Cancel]) -> list[str]:
        """Deliver cancels; returns the order ids whose cancel was delivered now."""

    @abstractmethod
    async def close(self) -> None:
        """Release the transport; idempotent."""
