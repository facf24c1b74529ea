"""Ports for the processes the tests start, with no window in which another process can take one.

A port picked free, closed and bound later by someone else can be taken meanwhile on a busy
machine ("Address already in use"), and the suite's verdict then hangs on what else runs. So:

- `listener()`: a listening socket the test holds; a service is handed it (`kvprefetch serve
  --fd`) and never binds, and a restart is handed the same socket, so the port cannot change
  hands between two processes. `Refuser` resets what connects while no process serves it, as
  the kernel would refuse a port nobody listens on.
- `dead_port()`: a port bound but never listening, held for the test: a connection is refused
  there, and no other process can start listening on it meanwhile.
- `quiet_port()` with `retry_in_use`: for a server that must bind a port itself (redis-server,
  LMCache's coordinator, the demo script). The port is drawn from outside the kernel's range of
  local ports, which it gives to outgoing connections and to port-0 binds, so only another
  process doing the same can take it; an "in use" at start is retried on another port.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from bench._util import quiet_port

__all__ = [
    "Refuser",
    "dead_port",
    "is_in_use",
    "listener",
    "port_of",
    "quiet_port",
    "retry_in_use",
    "unanswered_port",
]

T = TypeVar("T")

IN_USE = ("address already in use", "eaddrinuse", "errno 98", "address in use")
START_TRIES = 8


def listener(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound to a port of the kernel's choosing and listening, inheritable by a child
    process (pass its fileno in `pass_fds`)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def port_of(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


class Refuser:
    """While started, accepts each connection on `sock` and resets it at once: what a client of
    a stopped server sees (a reset, where a closed port gives a refusal), while the test keeps
    the port."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, daemon=True, name="refuser")
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(10)
            self._thread = None

    def _run(self) -> None:
        # Readiness by select, not a timeout on the socket: that would change the blocking mode
        # the served process shares with it.
        while not self._stop.is_set():
            ready, _, _ = select.select([self.sock], [], [], 0.02)
            if not ready:
                continue
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return  # the test closed the socket
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()


@contextmanager
def dead_port() -> Iterator[int]:
    """A port where nothing listens for as long as the block runs."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield port_of(sock)


_HELD: list[socket.socket] = []


def unanswered_port() -> int:
    """A port where nothing listens for as long as the test process runs (its socket is bound,
    never listening, and kept)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    _HELD.append(sock)
    return port_of(sock)


def is_in_use(text: str) -> bool:
    lowered = text.lower()
    return any(mark in lowered for mark in IN_USE)


def retry_in_use(start: Callable[[int], T], tries: int = START_TRIES) -> T:
    """`start(port)` on a quiet port; again on another while it fails because the port was
    taken (a RuntimeError or OSError whose text says so)."""
    for attempt in range(tries):
        try:
            return start(quiet_port())
        except (RuntimeError, OSError) as exc:
            if attempt == tries - 1 or not is_in_use(str(exc)):
                raise
    raise AssertionError("unreachable")
