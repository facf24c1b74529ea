"""No test or benchmark picks a port free and binds it later: on a busy machine another process
takes it meanwhile ("Address already in use"), and a verdict then hangs on what else runs. Each
server is handed a socket already bound (`--fd`), binds port 0 and says which it got, or binds a
quiet port and is started again on another when it was taken (tests/ports.py)."""

from __future__ import annotations

import re
import socket
from pathlib import Path

from tests.ports import Refuser, dead_port, listener, port_of, quiet_port, retry_in_use

REPO = Path(__file__).resolve().parent.parent
# Where a bound socket's port is read while the socket is kept (and handed to its server).
READS_A_KEPT_SOCKET = {
    "tests/ports.py",
    "tests/conftest.py",
    "tests/api/test_edge.py",
    "bench/_util.py",
    "bench/profile_ingest.py",
}
PICKED = re.compile(r"\bfree_ports?\b|_free_port\b|getsockname\(\)\[1\]")


def test_no_port_is_picked_before_it_is_bound() -> None:
    offenders = []
    for top in ("tests", "bench"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if "vendor" in path.parts or rel == "tests/test_ports.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if PICKED.search(line) and rel not in READS_A_KEPT_SOCKET:
                    offenders.append(f"{rel}:{n}: {line.strip()}")
    assert offenders == []


def test_a_dead_port_refuses_and_cannot_be_taken_while_held() -> None:
    with dead_port() as port:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            raise AssertionError("a connection was taken on a dead port")
        except ConnectionRefusedError:
            pass
        with socket.socket() as other:
            try:
                other.bind(("127.0.0.1", port))
                raise AssertionError("another socket bound a held port")
            except OSError:
                pass


def test_a_refuser_resets_connections_while_no_server_takes_them() -> None:
    with listener() as sock:
        refuser = Refuser(sock)
        refuser.start()
        try:
            got = b""
            try:
                # The reset can come before connect() has read its own result (a connect with a
                # timeout polls, then asks the socket's error), so it may raise there too.
                with socket.create_connection(("127.0.0.1", port_of(sock)), timeout=5) as conn:
                    conn.settimeout(5)
                    got = conn.recv(1)
            except ConnectionResetError:
                pass
            assert got == b""  # reset or closed at once: nothing is served
        finally:
            refuser.stop()


def test_a_start_on_a_taken_port_is_tried_again_on_another() -> None:
    tried: list[int] = []

    def start(port: int) -> int:
        tried.append(port)
        if len(tried) == 1:
            raise RuntimeError(f"bind: Address already in use (port {port})")
        return port

    assert retry_in_use(start) == tried[-1] and len(tried) == 2
    low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert all(not low <= p <= high for p in tried)  # outside the kernel's own range
    assert not low <= quiet_port() <= high
