"""`kvprefetch connect vllm`: a subscriber beside a vLLM engine, posting its batches to a running
service over HTTP (the light client, kvprefetch_client), where they take the same ingest path as
the service's own subscription (the same event ids: running both is harmless)."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence

from app.ingest.vllm.subscriber import IntakeTotals, VllmSubscriber
from app.ingest.vllm.wire import VllmEndpoint
from kvprefetch_client.client import KvpClient
from kvprefetch_client.events import VllmKvEvents

log = logging.getLogger(__name__)

_FLUSH_WAIT_SECONDS = 5.0


def client_delivery(client: KvpClient) -> Callable[[list[VllmKvEvents]], None]:
    """Post the batches and return once the service has acknowledged them (accepted, duplicate
    or rejected): the client retries failures itself, so this waits as long as it takes."""

    def deliver(batches: list[VllmKvEvents]) -> None:
        for batch in batches:
            client.send(batch)
        while not client.flush(_FLUSH_WAIT_SECONDS):
            log.warning(
                "the service has not acknowledged %d vLLM batches yet (%s); still trying",
                client.stats.queued,
                client.stats.last_error or "no answer",
            )

    return deliver


def connect(
    endpoints: Sequence[VllmEndpoint],
    service_url: str,
    *,
    token: str | None = None,
    replay_timeout_seconds: float = 2.0,
    stop: threading.Event | None = None,
) -> IntakeTotals:
    """Run until SIGINT or SIGTERM (or `stop` is set); returns what was taken."""
    stop = stop if stop is not None else threading.Event()
    client = KvpClient(service_url, token=token)
    subscriber = VllmSubscriber(
        endpoints, client_delivery(client), replay_timeout_seconds=replay_timeout_seconds
    )
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    subscriber.start()
    try:
        while not stop.wait(0.5):
            pass
    finally:
        subscriber.stop()
        client.close()
    return subscriber.totals
