"""The edge's connection registry (app/api/edge.py): which connection makes room, and when a new
one is refused; and the protocol in a server of its own, in this process."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from app.api.edge import ConnectionRegistry, EdgeConfig, EdgeLimits


class FakeConnection:
    def __init__(self, client: str) -> None:
        self.client_key = client
        self.evicted = False

    def evict(self) -> None:
        self.evicted = True


def registry(total: int, per_client: int) -> ConnectionRegistry:
    return ConnectionRegistry(
        EdgeLimits(
            header_timeout_seconds=1.0, max_connections=total, max_connections_per_client=per_client
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


def test_with_every_connection_busy_a_new_one_is_refused() -> None:
    reg = registry(total=2, per_client=2)
    a, b, c = (FakeConnection("10.0.0.1") for _ in range(3))
    for conn in (a, b):
        assert reg.admit(conn)  # type: ignore[arg-type]
        reg.mark_busy(conn)  # type: ignore[arg-type]
    assert not reg.admit(c)  # type: ignore[arg-type]
    assert reg.refused == 1 and not a.evicted and not b.evicted
    reg.remove(a)  # type: ignore[arg-type]
    assert reg.admit(c)  # type: ignore[arg-type]


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


@pytest.fixture
def edge_server() -> Iterator[tuple[int, Any]]:
    app = FastAPI()

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = EdgeConfig(
        app,
        limits=EdgeLimits(
            header_timeout_seconds=30.0, max_connections=4, max_connections_per_client=4
        ),
        host="127.0.0.1",
        port=port,
        log_level="warning",
    )
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
