"""The server's edge against the real service process (app/api/edge.py): connections that send
nothing or half a request line cannot starve /healthz, a client past its own limit is refused
while others are served, and an oversized batch is refused without being parsed. Latencies and
memory are printed, never asserted."""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import orjson
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


PROBE = """
import sys, time, httpx
while True:
    started = time.perf_counter()
    try:
        status = httpx.get(sys.argv[1] + "/healthz", timeout=30).status_code
    except httpx.HTTPError:
        status = 0
    print(status, (time.perf_counter() - started) * 1e3, flush=True)
    time.sleep(0.02)
"""


class Prober:
    """GET /healthz over and over, each on a new connection, from a process of its own (so the
    test's own threads never delay it), until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.proc: subprocess.Popen[str] | None = None
        self.statuses: list[int] = []
        self.ms: list[float] = []

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PROBE, self.url], stdout=subprocess.PIPE, text=True
        )

    def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=30)
        for line in out.splitlines():
            status, _, ms = line.partition(" ")
            with suppress(ValueError):
                self.ms.append(float(ms))
                self.statuses.append(int(status))

    def summary(self) -> str:
        ms = sorted(self.ms)
        return (
            f"GET /healthz meanwhile: {len(ms)} probes, median {ms[len(ms) // 2]:.0f} ms, "
            f"max {ms[-1]:.0f} ms, statuses {Counter(self.statuses)}"
        )


def huge_event(kind: str) -> bytes:
    """About 28.6 MiB: one event whose bulk is an unknown field of 15M numbers, or one string;
    or four events, each under the event limit, of 3.5M numbers each."""
    event = {"type": "session_closed", "event_id": "huge", "ts": 1.0, "session_id": "s1"}
    if kind == "medium events":
        medium = orjson.dumps(event)[:-1] + b',"junk":[' + b"7," * 3_500_000 + b"7]}"
        return b'{"events":[' + b",".join([medium] * 4) + b"]}"
    if kind == "numbers":
        return (
            b'{"events":[' + orjson.dumps(event)[:-1] + b',"junk":[' + b"7," * 15_000_000 + b"7]}]}"
        )
    return orjson.dumps({"events": [dict(event, session_id="s" * 30_000_000)]})


def test_huge_events_from_three_clients_are_refused_and_healthz_stays_served(
    service: ServiceProcess,
) -> None:
    """The issue's numbers: one event with an unknown field of 15M numbers (28.6 MiB) fits under
    the body limit, and was parsed whole before its 422, holding /healthz for 1.4 s a post; two
    clients kept it over 1 s. One client each: the numbers, one string, and four events each
    under the limit (parsed a slice at a time, the loop running between)."""
    bodies = {kind: huge_event(kind) for kind in ("numbers", "string", "medium events")}
    prober = Prober(service.url)
    answers: list[tuple[str, int, dict[str, str], float]] = []

    def post(kind: str) -> None:
        for _ in range(3):
            r, ms = timed(
                lambda: httpx.post(
                    f"{service.url}/v1/events",
                    content=bodies[kind],
                    headers={"content-type": "application/json"},
                    timeout=120,
                )
            )
            answers.append((kind, r.status_code, r.json(), ms))

    clients = [threading.Thread(target=post, args=(kind,)) for kind in bodies]
    prober.start()
    try:
        for c in clients:
            c.start()
        for c in clients:
            c.join()
    finally:
        prober.stop()
    for kind, status, _, ms in answers:
        print(f"\n{len(bodies[kind]) / 2**20:.1f} MiB, {kind}: {status} in {ms:.0f} ms")
    print(prober.summary())
    assert len(answers) == 9
    for kind, status, body, _ in answers:
        if kind == "medium events":  # each parsed, a slice at a time, and rejected
            assert status == 422, body
            assert [r["field"] for r in body["rejected"]] == [f"events[{i}].junk" for i in range(4)]
        else:
            assert (status, body["field"]) == (413, "events[0]"), body
            assert "KVP_MAX_EVENT_BYTES" in body["detail"]
    assert set(prober.statuses) == {200}


HELD_PER_CLIENT = 64  # KVP_MAX_REQUESTS_PER_CLIENT's default
TRICKLERS = [f"127.0.0.{i}" for i in range(2, 10)]


def test_bodies_trickled_from_eight_addresses_hold_no_slot_healthz_or_a_client_needs(
    service_factory: Callable[..., ServiceProcess],
) -> None:
    """The issue's flood: 1,040 requests whose bodies trickle at 2 bytes/s from 127.0.0.2-9 made
    /healthz and POST /v1/events answer 503 until the request timeout (60 s). Default limits,
    but a grace of 20 s before the bodies' minimum rate holds: room for a busy machine to take
    every request's headers while the flood is held."""
    svc = service_factory(env={"KVP_BODY_TIMEOUT_SECONDS": "20"})
    svc.start()
    head = (
        b"POST /v1/events HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b'content-length: 100000\r\n\r\n{"events": ['
    )
    flood: list[socket.socket] = []
    answers: dict[int, bytes] = {}
    received: dict[int, bytes] = {}
    posts: list[tuple[int, dict[str, Any], float]] = []
    prober = Prober(svc.url)

    def collect() -> None:
        """Reads what came, without blocking (select() takes no fd past 1023); a connection the
        server closed is answered."""
        for i, s in enumerate(flood):
            while i not in answers:
                try:
                    chunk = s.recv(65536)
                except BlockingIOError:
                    break
                except OSError:  # reset: closed with our bytes unread
                    chunk = b""
                if not chunk:
                    answers[i] = received.pop(i, b"")
                else:
                    received[i] = received.get(i, b"") + chunk

    try:
        started = time.monotonic()
        for i in range(1040):
            s = socket.create_connection(
                ("127.0.0.1", svc.port), timeout=10, source_address=(TRICKLERS[i % 8], 0)
            )
            with suppress(OSError):  # refused at once: what it was told is read below
                s.sendall(head)
            s.setblocking(False)  # a socket with a timeout waits for data before recv
            flood.append(s)
        print(f"\n{len(flood)} requests from {len(TRICKLERS)} addresses sent their headers")
        prober.start()
        event = {"type": "session_closed", "event_id": "t-0", "ts": 1.0, "session_id": "s1"}
        # Each address past its requests in flight is answered 503 at once; the rest trickle a
        # byte each half second until answered.
        refused_at_least = len(flood) - len(TRICKLERS) * HELD_PER_CLIENT
        held_at: float | None = None
        while len(answers) < len(flood) and time.monotonic() - started < 240:
            for i, s in enumerate(flood):
                if i not in answers:
                    with suppress(OSError):
                        s.send(b" ")
            if len(posts) < 5:
                event["event_id"] = f"t-{len(posts)}"
                r, ms = timed(
                    lambda: httpx.post(f"{svc.url}/v1/events", json={"events": [event]}, timeout=30)
                )
                posts.append((r.status_code, r.json(), ms))
            time.sleep(0.5)
            collect()
            if held_at is None and len(answers) >= refused_at_least:
                held_at = time.monotonic() - started
                print(f"after {held_at:.1f} s: {len(answers)} answered, the rest held")
        cut = time.monotonic() - started
        prober.stop()
        print(
            "POST /v1/events from 127.0.0.1 meanwhile: "
            + ", ".join(f"{status} in {ms:.0f} ms" for status, _, ms in posts)
        )
        print(prober.summary())
        print(f"{len(answers)} of the trickled requests answered by {cut:.1f} s")
        statuses = [data[:12].decode() for data in answers.values()]
        print(f"the trickled requests' answers: {Counter(statuses)}")
        assert set(prober.statuses) == {200}
        assert [(status, body["accepted"]) for status, body, _ in posts] == [
            (200, [f"t-{i}"]) for i in range(5)
        ]
        assert len(answers) == len(flood), f"{len(flood) - len(answers)} still held"
        refused = [data for data in answers.values() if data.startswith(b"HTTP/1.1 503")]
        cut_off = [data for data in answers.values() if data.startswith(b"HTTP/1.1 408")]
        assert len(refused) + len(cut_off) == len(flood)
        assert len(refused) >= refused_at_least
        for data in refused:
            assert b'"field":"requests"' in data or b'"field":"connections"' in data, data
        for data in cut_off:
            assert b"KVP_MIN_BODY_BYTES_PER_SECOND" in data, data[:300]
        # Held, then cut off by the minimum rate: each address's share, but for a few that
        # were counted while a refusal of the same address was still being answered.
        assert len(cut_off) >= len(TRICKLERS) * (HELD_PER_CLIENT - 4)
    finally:
        prober.stop()
        for s in flood:
            s.close()
