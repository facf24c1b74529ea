"""Order sinks: where the scheduler's prefetch, pin and demote orders (and their cancels) go.

One interface (`OrderSink`: `submit`, `cancel`, `close`, all coroutines) and one delivery
contract, documented in `base.py`: once per order id at the sink, at least once past it. The
sinks:

- `InProcessSink` (KVP_ORDER_SINK=memory): a list, drained synchronously; the simulator's and the
  tests'.
- `WebhookSink` (webhook): JSON batches POSTed to KVP_ORDER_WEBHOOK_URL, retried with backoff.
- `RedisStreamSink` (redis): a Redis stream per instance, read by agents with a consumer group
  (`kvprefetch_client.agent.StreamSource` is the agents' side).
- `PullQueue` (pull, the default): per-instance queues in this replica, leased to agents by
  GET /v1/orders. Not with a planning lease: a fleet's agents read the Redis streams.
- `LmcacheSink` (lmcache): carried out by LMCache's coordinator over HTTP, each order's blocks
  turned into tokens by a `TokenIndex` fed from kv_blocks_stored events; outcomes come back as
  order_progress events (the engine binds where they go).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.core.errors import ConfigError
from app.deliver.base import (
    OrderSink,
    SinkBinding,
    SinkClosed,
    SinkError,
    SinkFenced,
    SinkRejected,
    SinkUnavailable,
)
from app.deliver.fence import Fence
from app.deliver.lmcache import LmcacheSink
from app.deliver.memory import InProcessSink
from app.deliver.pull import Lease, PullQueue
from app.deliver.redis_stream import (
    GROUP,
    RedisStreamSink,
    cancel_key,
    stream_key,
)
from app.deliver.token_index import TokenIndex, UnknownTokens
from app.deliver.webhook import WebhookSink

if TYPE_CHECKING:
    import httpx

    from app.core.config import Settings

__all__ = [
    "GROUP",
    "Fence",
    "InProcessSink",
    "Lease",
    "LmcacheSink",
    "OrderSink",
    "PullQueue",
    "RedisStreamSink",
    "SinkBinding",
    "SinkClosed",
    "SinkError",
    "SinkFenced",
    "SinkRejected",
    "SinkUnavailable",
    "TokenIndex",
    "UnknownTokens",
    "WebhookSink",
    "build_sink",
    "cancel_key",
    "sink_classes",
    "stream_key",
]


def sink_classes() -> dict[str, type[OrderSink]]:
    """Every sink KVP_ORDER_SINK can name, by that name: the OrderSink subclasses that declare
    one themselves (a subclass of a sink, a test's, inherits the name but is not that sink;
    each module above is imported, so each is found)."""
    found: dict[str, type[OrderSink]] = {}
    stack = list(OrderSink.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        name = cls.__dict__.get("name")
        if name is None:
            continue
        if name in found and found[name] is not cls:
            raise ConfigError(f"two order sinks are named {name!r}: {found[name]} and {cls}")
        found[name] = cls
    return found


def build_sink(
    settings: Settings, *, transport: httpx.AsyncBaseTransport | None = None
) -> OrderSink:
    """The sink KVP_ORDER_SINK names; call it on the event loop that will use it (the Redis,
    webhook and lmcache sinks' clients belong to that loop). `transport` is the HTTP sinks', for
    tests."""
    sinks = sink_classes()
    kind = settings.order_sink
    if kind not in sinks:
        raise ConfigError(f"KVP_ORDER_SINK={kind!r} is not one of {', '.join(sorted(sinks))}")
    return sinks[kind].from_settings(settings, transport=transport)
