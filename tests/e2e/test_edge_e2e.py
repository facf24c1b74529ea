"""The server's edge against the real service process (app/api/edge.py): connections that send
nothing or half a request line cannot starve /healthz, a client past its own limit is refused
while others are served, and an oversized batch is refused without being parsed. Latencies and
memory are printed, never asserted."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psutil
import pytest

from tests.e2e.conftest import redis_workers

if TYPE_CHECKING:
    from tests.e2e.conftest import ServiceProcess

pytestmark = pytest.mark.slow

MAX_CONNECTIONS = 64
HEADER_TIMEOUT_SECONDS = 5.0


def open_flood(port: int, n: int) -> list[tuple[socket.socket, bool]]:
    """n connections, every other one having sent half a request line;
    (socket, sent half a line)."""
    flood = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        half = i % 2 == 1
        if half:
            s.sendall(b"GET /heal")
        flood.append((s, half))
    return flood


def closed_by_server(s: socket.socket) -> bytes | None:
    """What the server sent before closing, or None while the connection is still open."""
    data = b""
    while select.select([s], [], [], 0)[0]:
        try:
            chunk = s.recv(4096)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
    return None


def timed(call: Callable[[], httpx.Response]) -> tuple[httpx.Response, float]:
    started = time.perf_counter()
    r = call()
    return r, (time.perf_counter() - started) * 1e3


def test_a_flood_of_idle_and_half_sent_connections_does_not_starve_healthz(
    service_factory: Callable[..., ServiceProcess],
) -> None:
    svc = service_factory(
        env={
            "KVP_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
            "KVP_HEADER_TIMEOUT_SECONDS": str(HEADER_TIMEOUT_SECONDS),
        }
    )
    svc.start()
    flood = open_flood(svc.port, 3 * MAX_CONNECTIONS)
    try:
        opened = time.monotonic()
        # New connections, each past the limit: the longest-idle flood connections make room.
        health, health_ms = timed(lambda: httpx.get(f"{svc.url}/healthz", timeout=10))
        event = {"type": "session_closed", "event_id": "edge-1", "ts": 1.0, "session_id": "s1"}
        posted, post_ms = timed(
            lambda: httpx.post(f"{svc.url}/v1/events", json={"events": [event]}, timeout=10)
        )
        print(
            f"\nwith {3 * MAX_CONNECTIONS} flood connections open (limit {MAX_CONNECTIONS}): "
            f"GET /healthz {health.status_code} in {health_ms:.1f} ms, "
            f"POST /v1/events {posted.status_code} in {post_ms:.1f} ms"
        )
        assert health.status_code == 200, health.text
        assert posted.status_code == 200 and posted.json()["accepted"] == ["edge-1"], posted.text
        evicted = sum(closed_by_server(s) is not None for s, _ in flood)
        print(f"closed to make room: {evicted} of {len(flood)}")
        assert evicted >= 2 * MAX_CONNECTIONS  # the limit holds: the oldest went first

        # The rest are closed once the header timeout runs out; those that sent part of a
        # request hear why.
        answers: dict[int, bytes] = {}
        while len(answers) < len(flood) and time.monotonic() - opened < HEADER_TIMEOUT_SECONDS + 20:
            for i, (s, _) in enumerate(flood):
                if i not in answers and (data := closed_by_server(s)) is not None:
                    answers[i] = data
            time.sleep(0.1)
        waited = time.monotonic() - opened
        print(
            f"every flood connection closed by the server after {waited:.1f} s "
            f"(KVP_HEADER_TIMEOUT_SECONDS {HEADER_TIMEOUT_SECONDS:g})"
        )
        assert len(answers) == len(flood), (
            f"{len(flood) - len(answers)} flood connections still open"
        )
        timeouts = [answers[i] for i, (_, half) in enumerate(flood) if half and answers[i]]
        assert timeouts, "no half-sent request was answered 408"
        for data in timeouts:
            assert data.startswith(b"HTTP/1.1 408"), data[:200]
            assert b'"field":"headers"' in data
        assert all(answers[i] == b"" for i, (_, half) in enumerate(flood) if not half)
    finally:
        for s, _ in flood:
            s.close()
    assert httpx.get(f"{svc.url}/healthz", timeout=10).status_code == 200


def test_a_client_over_its_own_limit_is_refused_and_others_are_served(
    service_factory: Callable[..., ServiceProcess],
) -> None:
    per_client = 8
    svc = service_factory(
        env={
            "KVP_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
            "KVP_MAX_CONNECTIONS_PER_CLIENT": str(per_client),
        }
    )
    svc.start()
    held = []
    try:
        # From another loopback address: requests in flight (their bodies trickling) are never
        # closed to make room.
        for _ in range(per_client):
            s = socket.create_connection(
                ("127.0.0.1", svc.port), timeout=10, source_address=("127.0.0.2", 0)
            )
            s.sendall(
                b"POST /v1/events HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b'content-length: 1000\r\n\r\n{"events": ['
            )
            held.append(s)
        time.sleep(0.2)
        extra = socket.create_connection(
            ("127.0.0.1", svc.port), timeout=10, source_address=("127.0.0.2", 0)
        )
        held.append(extra)
        answer = b""
        while chunk := extra.recv(4096):
            answer += chunk
        status_line = answer.split(b"\r\n")[0].decode()
        print(f"\nconnection {per_client + 1} of 127.0.0.2: {status_line}")
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        assert b'"field":"connections"' in answer
        health, health_ms = timed(lambda: httpx.get(f"{svc.url}/healthz", timeout=10))
        print(f"GET /healthz from 127.0.0.1: {health.status_code} in {health_ms:.1f} ms")
        assert health.status_code == 200
    finally:
        for s in held:
            s.close()


def test_a_flood_of_empty_events_is_refused_without_being_parsed(service: ServiceProcess) -> None:
    body = b'{"events":[' + b",".join([b"{}"] * 5_000_000) + b"]}"
    proc = psutil.Process(service.proc.pid)  # type: ignore[union-attr]
    rss_before = proc.memory_info().rss
    peak = [rss_before]
    health_ms: list[float] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            _, ms = timed(lambda: httpx.get(f"{service.url}/healthz", timeout=30))
            health_ms.append(ms)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r, post_ms = timed(
            lambda: httpx.post(
                f"{service.url}/v1/events",
                content=body,
                headers={"content-type": "application/json"},
                timeout=120,
            )
        )
    finally:
        done.set()
        watcher.join()
    peak[0] = max(peak[0], proc.memory_info().rss)
    print(
        f"\n{len(body) / 2**20:.1f} MiB of 5,000,000 empty events: "
        f"{r.status_code} in {post_ms:.0f} ms; "
        f"service RSS {rss_before / 2**20:.0f} MiB before, peak {peak[0] / 2**20:.0f} MiB "
        f"(+{(peak[0] - rss_before) / 2**20:.0f} MiB); GET /healthz meanwhile: "
        f"max {max(health_ms, default=0):.0f} ms over {len(health_ms)} probes"
    )
    assert r.status_code == 413
    assert r.json() == {
        "detail": "a batch holds at most 10000 events, got more than 10000",
        "field": "events",
    }


@pytest.mark.redis
def test_with_workers_the_edge_holds_in_each_worker(
    tmp_path: Path, redis_url: str, clean_redis: str
) -> None:
    """`kvprefetch serve --workers 2` runs the same server (app/api/edge.py) in each worker."""
    (tmp_path / "prom").mkdir()
    flood: list[tuple[socket.socket, bool]] = []
    extra = {"KVP_MAX_CONNECTIONS": str(MAX_CONNECTIONS), "KVP_HEADER_TIMEOUT_SECONDS": "30"}
    with redis_workers(tmp_path, redis_url, clean_redis, tmp_path / "prom", extra) as url:
        try:
            # More than both workers' limits together, whichever worker each lands on.
            flood = open_flood(httpx.URL(url).port or 0, 6 * MAX_CONNECTIONS)
            statuses = []
            for _ in range(8):  # new connections: the kernel hands them to either worker
                r, ms = timed(lambda: httpx.get(f"{url}/healthz", timeout=10))
                statuses.append(r.status_code)
                print(
                    f"GET /healthz with {len(flood)} flood connections open: "
                    f"{r.status_code} in {ms:.1f} ms"
                )
            assert statuses == [200] * 8
        finally:
            for s, _ in flood:
                s.close()
