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
  GET /v1/orders.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.core.errors import ConfigError
from app.core.redact import mask_url
from app.deliver.base import OrderSink, SinkClosed, SinkError, SinkRejected, SinkUnavailable
from app.deliver.memory import InProcessSink
from app.deliver.pull import Lease, PullQueue
from app.deliver.redis_stream import (
    GROUP,
    RedisStreamSink,
    cancel_key,
    stream_key,
)
from app.deliver.webhook import WebhookSink

if TYPE_CHECKING:
    import httpx

    from app.core.config import Settings

__all__ = [
    "GROUP",
    "InProcessSink",
    "Lease",
    "OrderSink",
    "PullQueue",
    "RedisStreamSink",
    "SinkClosed",
    "SinkError",
    "SinkRejected",
    "SinkUnavailable",
    "WebhookSink",
    "build_sink",
    "cancel_key",
    "stream_key",
]


def build_sink(
    settings: Settings, *, transport: httpx.AsyncBaseTransport | None = None
) -> OrderSink:
    """The sink KVP_ORDER_SINK names; call it on the event loop that will use it (the Redis and
    webhook sinks' clients belong to that loop). `transport` is the webhook's, for tests."""
    kind = settings.order_sink
    dedupe = settings.order_dedupe_seconds
    if kind == "pull":
        return PullQueue(lease_seconds=settings.order_lease_seconds, dedupe_seconds=dedupe)
    if kind == "memory":
        return InProcessSink(dedupe_seconds=dedupe)
    if kind == "webhook":
        secret = settings.order_webhook_url
        url = secret.get_secret_value() if secret is not None else ""
        if not url:
            raise ConfigError(
                "KVP_ORDER_SINK=webhook needs KVP_ORDER_WEBHOOK_URL, the URL the orders "
                "are POSTed to"
            )
        if not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"KVP_ORDER_WEBHOOK_URL must be an http:// or https:// URL, not "
                f"{mask_url(url, keep_path=False)!r}"
            )
        return WebhookSink(
            url,
            timeout_seconds=settings.order_webhook_timeout_seconds,
            max_attempts=settings.order_webhook_max_attempts,
            backoff_seconds=settings.order_webhook_backoff_seconds,
            max_backoff_seconds=settings.order_webhook_max_backoff_seconds,
            dedupe_seconds=dedupe,
            transport=transport,
        )
    if kind == "redis":
        return RedisStreamSink.from_url(
            settings.redis_url.get_secret_value(),
            settings.stream_prefix,
            timeout_seconds=settings.redis_timeout_seconds,
            maxlen=settings.order_stream_maxlen,
            dedupe_seconds=dedupe,
        )
    raise ConfigError(f"KVP_ORDER_SINK={kind!r} is not one of memory, webhook, redis, pull")
