"""The server's edge: how many connections it holds, from whom, and for how long they may idle.

uvicorn alone has no header-read timeout, and its `limit_concurrency` counts idle connections
too, answering 503 to every request once they reach the limit: a thousand connections that send
nothing starved every route, /healthz included. Here, per server (each worker process its own):

- a connection must send its request's headers within KVP_HEADER_TIMEOUT_SECONDS of connecting,
  or of its request's first byte; otherwise it is closed (with 408 if part of a request came);
- an idle keep-alive connection is closed after KVP_KEEPALIVE_TIMEOUT_SECONDS (uvicorn's own);
- at most KVP_MAX_CONNECTIONS connections are open, and KVP_MAX_CONNECTIONS_PER_CLIENT from one
  address. A connection past either limit closes the longest-idle connection that has no
  request in flight (of that address for its limit): an idle keep-alive connection, or one that
  has not sent its headers. Only when none is idle is the new connection refused, with 503;
- at most KVP_MAX_CONNECTIONS requests are in flight, and KVP_MAX_REQUESTS_PER_CLIENT from one
  address; another is answered 503 (counting requests rather than connections), so a few
  addresses whose bodies trickle cannot hold every request slot;
- GET /healthz is never refused for lack of slots: it is exempt from the request limits, and
  PROBE_CONNECTIONS connections past KVP_MAX_CONNECTIONS, when none is idle, serve it alone.

An address is an IPv4 address, or an IPv6 /64 (what one host is handed: an address per request
would be free), an IPv4-mapped IPv6 address counting as its IPv4 one.

So connections that send nothing, or half a request line, are the first to go, and never keep
a new request from being served (docs/decisions.md, 14).
"""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
import socket
import sys
from dataclasses import dataclass
from typing import Any

import httptools
import orjson
import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState
from uvicorn.supervisors import Multiprocess

from app.core.config import Settings

# What a liveness probe asks (GET or HEAD); answered whatever the request slots are doing.
PROBE_PATHS = frozenset({"/healthz"})
# Connections past KVP_MAX_CONNECTIONS that serve probes alone, when none is idle to close.
PROBE_CONNECTIONS = 8


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    header_timeout_seconds: float
    max_connections: int
    max_connections_per_client: int
    max_requests_per_client: int = Settings.model_fields["max_requests_per_client"].default

    @classmethod
    def from_settings(cls, settings: Settings) -> EdgeLimits:
        return cls(
            header_timeout_seconds=settings.header_timeout_seconds,
            max_connections=settings.max_connections,
            max_connections_per_client=settings.max_connections_per_client,
            max_requests_per_client=settings.max_requests_per_client,
        )


def client_key(host: str) -> str:
    """The address a client's limits count by: an IPv6 address's /64, an IPv4 address whole."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host  # a Unix socket's path, or nothing
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class EdgeConfig(uvicorn.Config):
    """uvicorn's Config with the edge's limits; it travels to worker processes as it is."""

    def __init__(self, app: Any, *, limits: EdgeLimits, **kwargs: Any) -> None:
        # No WebSocket upgrades: the service has no WebSocket route, and an upgraded connection
        # would leave the registry without its connection_lost.
        super().__init__(app, http=EdgeProtocol, ws="none", **kwargs)
        self.edge_limits = limits


class ConnectionRegistry:
    """A server's open connections, by client address, and which of them are idle (oldest first)."""

    def __init__(self, limits: EdgeLimits) -> None:
        self.limits = limits
        self.by_client: dict[str, set[EdgeProtocol]] = {}
        # Insertion order is idle order: a connection re-enters at the end each time it idles.
        self.idle: dict[EdgeProtocol, None] = {}
        self.idle_by_client: dict[str, dict[EdgeProtocol, None]] = {}
        self.requests_by_client: dict[str, int] = {}
        self.open = 0
        self.evicted = 0
        self.refused = 0

    @classmethod
    def of(cls, server_state: ServerState, limits: EdgeLimits) -> ConnectionRegistry:
        """The registry of the server whose state this is (each uvicorn Server has its own)."""
        registry: ConnectionRegistry | None = getattr(server_state, "kvp_connections", None)
        if registry is None:
            registry = cls(limits)
            server_state.kvp_connections = registry  # type: ignore[attr-defined]
        return registry

    def admit(self, conn: EdgeProtocol) -> bool:
        """Registers `conn`, first closing idle connections to make room; False: no room."""
        key = conn.client_key
        at_client_limit = len(self.by_client.get(key, ())) >= self.limits.max_connections_per_client
        if at_client_limit and not self._evict(self.idle_by_client.get(key, {})):
            self.refused += 1
            return False
        if self.open >= self.limits.max_connections and not self._evict(self.idle):
            if self.open >= self.limits.max_connections + PROBE_CONNECTIONS:
                self.refused += 1
                return False
            conn.probes_only = True
        self.by_client.setdefault(key, set()).add(conn)
        self.open += 1
        self.mark_idle(conn)
        return True

    def _evict(self, idle: dict[EdgeProtocol, None]) -> bool:
        victim = next(iter(idle), None)
        if victim is None:
            return False
        self.remove(victim)
        victim.evict()
        self.evicted += 1
        return True

    def mark_idle(self, conn: EdgeProtocol) -> None:
        if conn.client_key in self.by_client and conn in self.by_client[conn.client_key]:
            self.idle.pop(conn, None)
            self.idle[conn] = None
            per_client = self.idle_by_client.setdefault(conn.client_key, {})
            per_client.pop(conn, None)
            per_client[conn] = None

    def mark_busy(self, conn: EdgeProtocol) -> None:
        self.idle.pop(conn, None)
        per_client = self.idle_by_client.get(conn.client_key)
        if per_client is not None:
            per_client.pop(conn, None)
            if not per_client:
                del self.idle_by_client[conn.client_key]

    def request_started(self, conn: EdgeProtocol) -> int:
        """Counts a request of `conn` in flight; how many its address has now."""
        if not self._registered(conn):
            return 0
        n = self.requests_by_client.get(conn.client_key, 0) + 1
        self.requests_by_client[conn.client_key] = n
        return n

    def request_done(self, conn: EdgeProtocol, requests: int = 1) -> None:
        if not self._registered(conn):
            return
        n = self.requests_by_client.get(conn.client_key, 0) - requests
        if n > 0:
            self.requests_by_client[conn.client_key] = n
        else:
            self.requests_by_client.pop(conn.client_key, None)

    def _registered(self, conn: EdgeProtocol) -> bool:
        return conn in self.by_client.get(conn.client_key, ())

    def remove(self, conn: EdgeProtocol) -> None:
        conns = self.by_client.get(conn.client_key)
        if conns is None or conn not in conns:
            return
        self.request_done(conn, conn.requests_in_flight)  # a connection lost mid-request
        self.mark_busy(conn)
        conns.discard(conn)
        if not conns:
            del self.by_client[conn.client_key]
        self.open -= 1


def _error_response(status: str, field: str, message: str, extra: bytes = b"") -> bytes:
    body = orjson.dumps({"detail": message, "field": field})
    return (
        (
            f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n"
            f"connection: close\r\n"
        ).encode()
        + extra
        + b"\r\n"
        + body
    )


class _Refusal:
    """The answer to a request past a limit: 503, naming the limit, and the connection closed."""

    def __init__(self, field: str, message: str) -> None:
        self.body = orjson.dumps({"detail": message, "field": field})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(self.body)).encode()),
            (b"retry-after", b"1"),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header timeout and the server's connection limits."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        limits: EdgeLimits = getattr(config, "edge_limits")  # noqa: B009 - set by EdgeConfig
        self.registry = ConnectionRegistry.of(server_state, limits)
        self.header_timeout_seconds = limits.header_timeout_seconds
        self.header_timer: asyncio.TimerHandle | None = None
        self.client_key = ""
        self.requests_in_flight = 0
        self.request_begun = False  # bytes of a request whose headers are not complete yet
        self.probes_only = False  # admitted past KVP_MAX_CONNECTIONS: serves probes alone
        # uvicorn's own check counts idle connections too; ours (on_headers_complete) counts
        # requests in flight against the same limit, and per address.
        self.max_requests_in_flight = limits.max_connections
        self.max_requests_per_client = limits.max_requests_per_client
        self.limit_concurrency = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.client_key = client_key(self.client[0]) if self.client else ""
        if not self.registry.admit(self):
            self.connections.discard(self)
            transport.write(
                _error_response(
                    "503 Service Unavailable",
                    "connections",
                    "too many connections (KVP_MAX_CONNECTIONS, KVP_MAX_CONNECTIONS_PER_CLIENT); "
                    "retry later",
                    b"retry-after: 1\r\n",
                )
            )
            transport.close()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self.registry.remove(self)
        super().connection_lost(exc)

    def handle_websocket_upgrade(self) -> None:  # never with ws="none"; kept consistent anyway
        self._disarm_header_timer()
        self.registry.remove(self)
        super().handle_websocket_upgrade()

    def evict(self) -> None:
        """Closed to make room for a new connection: it had no request in flight."""
        self._disarm_header_timer()
        if not self.transport.is_closing():
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.request_begun = True
        if self.header_timer is None:
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        self.request_begun = False
        self.requests_in_flight += 1
        self.registry.mark_busy(self)
        from_client = self.registry.request_started(self)
        refusal = self._refusal(from_client)
        if refusal is None:
            super().on_headers_complete()
            return
        # uvicorn runs self.app for the request whose headers are complete: this one's answer.
        app, self.app = self.app, refusal
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def _refusal(self, from_client: int) -> _Refusal | None:
        try:
            path = httptools.parse_url(self.url).path
        except httptools.HttpParserInvalidURLError:
            path = None  # uvicorn answers it 400
        probe = path is not None and path.decode("latin-1") in PROBE_PATHS
        if probe and self.parser.get_method() in (b"GET", b"HEAD"):
            return None
        if self.probes_only:
            return _Refusal(
                "connections",
                "too many connections (KVP_MAX_CONNECTIONS): this one serves /healthz only; "
                "retry later",
            )
        if len(self.tasks) >= self.max_requests_in_flight:
            return _Refusal("requests", "too many requests in flight (KVP_MAX_CONNECTIONS)")
        if from_client > self.max_requests_per_client:
            return _Refusal(
                "requests",
                "too many requests in flight from your address (KVP_MAX_REQUESTS_PER_CLIENT)",
            )
        return None

    def on_response_complete(self) -> None:
        if self.requests_in_flight > 0:
            self.requests_in_flight -= 1
            self.registry.request_done(self)
        super().on_response_complete()
        if self.requests_in_flight == 0 and not self.transport.is_closing():
            self.registry.mark_idle(self)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self.header_timer = self.loop.call_later(self.header_timeout_seconds, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _header_timeout(self) -> None:
        self.header_timer = None
        if self.transport.is_closing():
            return
        if self.request_begun:  # part of a request came: say why it ends
            self.transport.write(
                _error_response(
                    "408 Request Timeout",
                    "headers",
                    "the request's headers did not arrive within "
                    f"{self.header_timeout_seconds:g} s (KVP_HEADER_TIMEOUT_SECONDS)",
                )
            )
        self.transport.close()


def serve(
    app: Any,
    settings: Settings,
    *,
    workers: int = 1,
    factory: bool = False,
    log_level: str = "info",
    listener: socket.socket | None = None,
) -> None:
    """Run `app` (an ASGI app, or an import string with `factory` or `workers`) behind the edge's
    limits: the one way `kvprefetch serve` runs a server, with one worker or several. `listener`,
    a bound socket, is served instead of binding the settings' host and port."""
    config = EdgeConfig(
        app,
        limits=EdgeLimits.from_settings(settings),
        host=settings.host,
        port=settings.port,
        workers=workers,
        factory=factory,
        log_level=log_level,
        access_log=False,
        timeout_keep_alive=settings.keepalive_timeout_seconds,
        limit_concurrency=None,
    )
    server = uvicorn.Server(config)
    if workers > 1:
        sock = listener or config.bind_socket()
        if "target" in inspect.signature(Multiprocess).parameters:  # uvicorn < 0.50
            Multiprocess(config, target=server.run, sockets=[sock]).run()  # type: ignore[call-arg]
        else:
            Multiprocess(config, sockets=[sock]).run()
        return
    server.run(sockets=[listener] if listener is not None else None)
    if not server.started:
        sys.exit(STARTUP_FAILURE)
