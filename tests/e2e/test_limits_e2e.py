"""Limits on the real service process: a stalled body is cut off with 408, and a router client over
its rate limit is slowed down by 429s without losing an event."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx
import pytest

from kvprefetch_client.client import KvpClient

if TYPE_CHECKING:
    from tests.e2e.conftest import ServiceProcess

pytestmark = pytest.mark.slow


def test_a_stalled_body_gets_408_and_the_service_serves_on(
    service_factory: Callable[..., ServiceProcess],
) -> None:
    svc = service_factory(env={"KVP_BODY_TIMEOUT_SECONDS": "0.5"})
    svc.start()
    with socket.create_connection(("127.0.0.1", svc.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/events HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 1000\r\n\r\n{"events": ['
        )
        started = time.monotonic()
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
        waited = time.monotonic() - started
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b'"field":"body"' in body
    # It waited for the body as long as configured: timed here from after the send, there from
    # the first bytes read, so this side's count may be short by the send's own time.
    assert waited >= 0.5 - 0.05
    r = httpx.post(
        f"{svc.url}/v1/events",
        json={
            "events": [{"type": "session_closed", "event_id": "e1", "ts": 1.0, "session_id": "s1"}]
        },
        timeout=5,
    )
    assert r.status_code == 200 and r.json()["accepted"] == ["e1"]


def test_a_client_over_its_rate_is_slowed_by_429s_and_loses_nothing(
    service_factory: Callable[..., ServiceProcess],
) -> None:
    svc = service_factory(
        env={"KVP_RATE_LIMIT_REQUESTS_PER_SECOND": "10", "KVP_RATE_LIMIT_BURST_SECONDS": "0.1"}
    )
    svc.start()
    n = 16
    with KvpClient(
        svc.url, batch_size=2, flush_interval_seconds=0.0, max_backoff_seconds=1.0
    ) as kvp:
        for i in range(n):
            kvp.session_closed(session_id=f"s{i}")
        assert kvp.flush(60)
        stats = kvp.stats
    assert (stats.sent, stats.rejected, stats.dropped) == (n, 0, 0)
    assert stats.retries > 0 and "429" in (stats.last_error or "")
    metrics = httpx.get(f"{svc.url}/metrics", timeout=5).text
    assert 'kvprefetch_events_ingested_total{type="session_closed"} 16.0' in metrics
