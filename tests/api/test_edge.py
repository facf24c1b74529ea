"""The edge's connection registry (app/api/edge.py): which connection makes room, and when a new
one is refused; and the protocol in a server of its own, in this process."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request

from app.api.edge import (
    PROBE_CONNECTIONS,
    ConnectionRegistry,
    EdgeConfig,
    EdgeLimits,
    client_key,
)


class FakeConnection:
    def __init__(self, client: str) -> None:
        self.client_key = client
        self.evicted = False
        self.requests_in_flight = 0
        self.probes_only = False

    def evict(self) -> None:
        self.evicted = True


def registry(total: int, per_client: int, requests_per_client: int = 64) -> ConnectionRegistry:
    return ConnectionRegistry(
        EdgeLimits(
            header_timeout_seconds=1.0,
            max_connections=total,
            max_connections_per_client=per_client,
            max_requests_per_client=requests_per_client,
        )
    )


def test_the_longest_idle_connection_makes_room() -> None:
    reg = registry(total=3, per_client=3)
    a, b, c, d = (FakeConnection("10.0.0.1") for _ in range(4))
    for conn in (a, b, c):
        assert reg.admit(conn)  # type: ignore[arg-type]
    reg.mark_busy(a)  # type: ignore[arg-type]
    reg.mark_busy(b)  # type: ignore[arg-type]
    reg.mark_idle(b)  # type: ignore[arg-type]  # b idled again after c did: c is the longest idle
    assert reg.admit(d)  # type: ignore[arg-type]
    assert (a.evicted, b.evicted, c.evicted) == (False, False, True)
    assert reg.open == 3 and reg.evicted == 1


def test_with_every_connection_busy_a_new_one_serves_probes_then_is_refused() -> None:
    reg = registry(total=2, per_client=2 + PROBE_CONNECTIONS + 1)
    a, b, c = (FakeConnection("10.0.0.1") for _ in range(3))
    for conn in (a, b):
        assert reg.admit(conn)  # type: ignore[arg-type]
        reg.mark_busy(conn)  # type: ignore[arg-type]
        assert not conn.probes_only
    probes = [FakeConnection("10.0.0.1") for _ in range(PROBE_CONNECTIONS)]
    for conn in probes:
        assert reg.admit(conn)  # type: ignore[arg-type]
        reg.mark_busy(conn)  # type: ignore[arg-type]
        assert conn.probes_only
    assert not reg.admit(c)  # type: ignore[arg-type]
    assert reg.refused == 1 and not a.evicted and not b.evicted
    reg.remove(a)  # type: ignore[arg-type]
    reg.remove(probes[0])  # type: ignore[arg-type]
    assert reg.admit(c)  # type: ignore[arg-type]


def test_requests_in_flight_are_counted_per_address_until_done_or_lost() -> None:
    reg = registry(total=10, per_client=10)
    a, b, c = FakeConnection("10.0.0.1"), FakeConnection("10.0.0.1"), FakeConnection("10.0.0.2")
    for conn in (a, b, c):
        assert reg.admit(conn)  # type: ignore[arg-type]
    counts = []
    for conn in (a, a, b, c):
        conn.requests_in_flight += 1
        counts.append(reg.request_started(conn))  # type: ignore[arg-type]
    assert counts == [1, 2, 3, 1]
    b.requests_in_flight -= 1
    reg.request_done(b)  # type: ignore[arg-type]
    assert reg.requests_by_client == {"10.0.0.1": 2, "10.0.0.2": 1}
    reg.remove(a)  # type: ignore[arg-type]  # lost with two requests in flight
    reg.remove(a)  # type: ignore[arg-type]  # and told again: counted once
    reg.request_done(a)  # type: ignore[arg-type]  # a late answer of a lost connection
    assert reg.requests_by_client == {"10.0.0.2": 1}


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("127.0.0.2", "127.0.0.2"),
        ("::ffff:127.0.0.2", "127.0.0.2"),
        ("::1", "::/64"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("/run/kvp.sock", "/run/kvp.sock"),
    ],
)
def test_an_ipv6_host_counts_as_its_64(host: str, key: str) -> None:
    assert client_key(host) == key


def test_a_client_at_its_limit_makes_room_among_its_own() -> None:
    reg = registry(total=10, per_client=2)
    other = FakeConnection("10.0.0.9")
    # The longest idle of all, but not its address.
    assert reg.admit(other)  # type: ignore[arg-type]
    mine = [FakeConnection("10.0.0.1") for _ in range(3)]
    for conn in mine:
        assert reg.admit(conn)  # type: ignore[arg-type]
    assert [c.evicted for c in mine] == [True, False, False] and not other.evicted
    for conn in mine[1:]:
        reg.mark_busy(conn)  # type: ignore[arg-type]
    assert not reg.admit(FakeConnection("10.0.0.1"))  # type: ignore[arg-type]
    assert reg.admit(FakeConnection("10.0.0.2"))  # type: ignore[arg-type]


@contextmanager
def serving(app: FastAPI, limits: EdgeLimits) -> Iterator[tuple[int, Any]]:
    """`app` behind the edge on a port of its own (bound here, then served): (port, server)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = EdgeConfig(app, limits=limits, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    try:
        yield port, server
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def probe_app() -> FastAPI:
    app = FastAPI()

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    return app


@pytest.fixture
def edge_server() -> Iterator[tuple[int, Any]]:
    limits = EdgeLimits(
        header_timeout_seconds=30.0, max_connections=4, max_connections_per_client=4
    )
    with serving(probe_app(), limits) as served:
        yield served


def trickle(port: int, source: str) -> socket.socket:
    """A POST whose headers and first body byte came, and whose body then stops."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    s.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
    return s


def answer(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    return data


def in_flight(server: Any, n: int) -> None:
    """Waits (up to a generous deadline) for the server to hold n requests in flight."""
    deadline = time.monotonic() + 30
    while True:
        registry = getattr(server.server_state, "kvp_connections", None)  # made by a connection
        if registry is not None and sum(registry.requests_by_client.values()) >= n:
            return
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_an_address_past_its_requests_in_flight_gets_503_and_others_are_served() -> None:
    limits = EdgeLimits(
        header_timeout_seconds=30.0,
        max_connections=8,
        max_connections_per_client=8,
        max_requests_per_client=2,
    )
    held: list[socket.socket] = []
    with serving(probe_app(), limits) as (port, server):
        try:
            held += [trickle(port, "127.0.0.2") for _ in range(2)]
            in_flight(server, 2)
            extra = trickle(port, "127.0.0.2")
            held.append(extra)
            refused = answer(extra)
            status_line = refused.split(b"\r\n")[0].decode()
            print(f"\nrequest 3 of 127.0.0.2: {status_line}")
            assert refused.startswith(b"HTTP/1.1 503"), refused[:300]
            assert b"connection: close" in refused and b"retry-after: 1" in refused
            assert refused.endswith(
                b'{"detail":"too many requests in flight from your address '
                b'(KVP_MAX_REQUESTS_PER_CLIENT)","field":"requests"}'
            )
            url = f"http://127.0.0.1:{port}"
            with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.3")) as other:
                assert other.post(f"{url}/echo", content=b"x" * 10).json() == {"bytes": 10}
            local = httpx.HTTPTransport(local_address="127.0.0.2")
            with httpx.Client(transport=local) as same:
                assert same.get(f"{url}/healthz").status_code == 200  # exempt
                assert same.post(f"{url}/healthz").status_code == 503  # a probe GETs
        finally:
            for s in held:
                s.close()


def test_with_every_slot_held_healthz_is_served_and_other_requests_get_503() -> None:
    limits = EdgeLimits(
        header_timeout_seconds=30.0,
        max_connections=4,
        max_connections_per_client=4,
        max_requests_per_client=4,
    )
    held: list[socket.socket] = []
    with serving(probe_app(), limits) as (port, server):
        try:
            held += [trickle(port, f"127.0.0.{2 + i % 2}") for i in range(4)]
            in_flight(server, 4)
            url = f"http://127.0.0.1:{port}"
            for _ in range(2 * PROBE_CONNECTIONS):  # each on a connection of its own
                assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
            r = httpx.post(f"{url}/echo", content=b"x", timeout=10)
            assert r.status_code == 503 and r.json()["field"] == "connections", r.text
        finally:
            for s in held:
                s.close()


def test_upgrade_requests_leave_no_connection_behind(edge_server: tuple[int, Any]) -> None:
    port, server = edge_server
    for _ in range(12):  # three times the limit
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(
                b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
                b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n"
            )
            s.recv(4096)
    r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
    assert r.status_code == 200
    time.sleep(0.2)
    assert server.server_state.kvp_connections.open == 0  # every connection above is gone


def test_a_connection_that_sends_nothing_makes_room(edge_server: tuple[int, Any]) -> None:
    port, server = edge_server
    silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(8)]
    try:
        with httpx.Client() as client:
            for _ in range(3):  # a keep-alive client: its connection is reused, and stays
                assert client.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200
        registry = server.server_state.kvp_connections
        assert registry.open <= 4 and registry.evicted >= 5 and registry.refused == 0
    finally:
        for s in silent:
            s.close()
