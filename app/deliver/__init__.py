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
from app.core.redact import mask_url
from app.deliver.base import (
    OrderSink,
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
    "stream_key",
]


def build_sink(
    settings: Settings, *, transport: httpx.AsyncBaseTransport | None = None
) -> OrderSink:
    """The sink KVP_ORDER_SINK names; call it on the event loop that will use it (the Redis,
    webhook and lmcache sinks' clients belong to that loop). `transport` is the HTTP sinks', for
    tests."""
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
    if kind == "lmcache":
        url = settings.lmcache_coordinator_url
        if not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"KVP_LMCACHE_COORDINATOR_URL must be an http:// or https:// URL, not "
                f"{mask_url(url, keep_path=False)!r}"
            )
        if not settings.lmcache_model_name:
            raise ConfigError(
                "KVP_ORDER_SINK=lmcache needs KVP_LMCACHE_MODEL_NAME, the model name LMCache's "
                "servers registered their KV layout under (vLLM's --model)"
            )
        # Its report (where order_progress goes) is bound by the engine that builds it.
        return LmcacheSink(
            url,
            model_name=settings.lmcache_model_name,
            world_size=settings.lmcache_world_size,
            cache_salt=settings.lmcache_cache_salt,
            tokens=TokenIndex(settings.lmcache_token_index_max_tokens),
            demote_tier=settings.lmcache_demote_tier,
            poll_interval_seconds=settings.lmcache_poll_interval_seconds,
            prefetch_timeout_seconds=settings.lmcache_prefetch_timeout_seconds,
            timeout_seconds=settings.lmcache_timeout_seconds,
            max_attempts=settings.lmcache_max_attempts,
            backoff_seconds=settings.lmcache_backoff_seconds,
            max_backoff_seconds=settings.lmcache_max_backoff_seconds,
            pin_check_seconds=settings.lmcache_pin_check_seconds,
            dedupe_seconds=dedupe,
            transport=transport,
        )
    raise ConfigError(
        f"KVP_ORDER_SINK={kind!r} is not one of memory, webhook, redis, pull, lmcache"
    )
