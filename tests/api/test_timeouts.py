"""The timeout middleware at the ASGI level, with a client that stalls mid-body."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Message

from app.api.timeouts import TimeoutMiddleware

seen: list[str] = []


async def echo(scope: Any, receive: Any, send: Any) -> None:
    request = Request(scope, receive)
    if scope["path"] == "/slow":
        await asyncio.sleep(10)
    try:
        body = await request.body()
    except Exception as exc:
        seen.append(type(exc).__name__)
        await JSONResponse({"late": True}, status_code=400)(scope, receive, send)
        return
    await JSONResponse({"bytes": len(body)})(scope, receive, send)


def call(path: str, chunks: list[bytes], stall: bool) -> list[Message]:
    app = TimeoutMiddleware(echo, body_seconds=0.05, request_seconds=0.3)
    sent: list[Message] = []

    async def scenario() -> None:
        queue = list(chunks)

        async def receive() -> Message:
            if queue:
                chunk = queue.pop(0)
                return {"type": "http.request", "body": chunk, "more_body": bool(queue) or stall}
            await asyncio.sleep(3600)  # the client stalls
            raise AssertionError("unreachable")

        async def send(message: Message) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}
        await app(scope, receive, send)

    asyncio.run(scenario())
    return sent


def status_and_body(sent: list[Message]) -> tuple[int, dict[str, Any], dict[bytes, bytes]]:
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], orjson.loads(body), dict(start["headers"])


def test_a_whole_body_passes() -> None:
    status, body, _ = status_and_body(call("/", [b"ab", b"cd"], stall=False))
    assert (status, body) == (200, {"bytes": 4})


def test_a_body_that_stops_arriving_is_answered_408_and_the_route_sees_a_disconnect() -> None:
    seen.clear()
    sent = call("/", [b"ab"], stall=True)
    status, body, headers = status_and_body(sent)
    assert status == 408
    assert body == {
        "detail": "the body stopped arriving for 0.05 s (KVP_BODY_TIMEOUT_SECONDS)",
        "field": "body",
    }
    assert headers[b"connection"] == b"close"
    assert seen == ["ClientDisconnect"]
    # The route's own late answer never reaches the client.
    assert sum(m["type"] == "http.response.start" for m in sent) == 1


def test_a_request_over_its_time_is_answered_503_with_retry_after() -> None:
    status, body, headers = status_and_body(call("/slow", [b"ab"], stall=False))
    assert status == 503
    assert body == {
        "detail": "the request took over 0.3 s (KVP_REQUEST_TIMEOUT_SECONDS)",
        "field": "request",
    }
    assert headers[b"retry-after"] == b"1"
    assert headers[b"connection"] == b"close"  # the rest of the request is never read


def trickled(chunk: bytes, every_seconds: float, min_rate: float) -> list[Message]:
    """A body sent `chunk` by `chunk`, each after `every_seconds`, without end; never silent
    for as long as the body timeout (0.05 s)."""
    app = TimeoutMiddleware(
        echo, body_seconds=0.05, request_seconds=5.0, min_body_bytes_per_second=min_rate
    )
    sent: list[Message] = []

    async def scenario() -> None:
        chunks = 0

        async def receive() -> Message:
            nonlocal chunks
            await asyncio.sleep(every_seconds)
            chunks += 1
            # Ends, if nothing ended it before, after 2 s at the least: past the grace plenty.
            return {"type": "http.request", "body": chunk, "more_body": chunks < 2 / every_seconds}

        async def send(message: Message) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
        await app(scope, receive, send)

    asyncio.run(scenario())
    return sent


def test_a_body_trickled_below_the_minimum_rate_is_answered_408() -> None:
    seen.clear()
    # 1 byte each 10 ms (at most 100 bytes/s) against a floor of 1000 bytes/s.
    status, body, headers = status_and_body(trickled(b"x", 0.01, min_rate=1000))
    assert status == 408
    assert body == {
        "detail": "the body arrived slower than 1000 bytes/s (KVP_MIN_BODY_BYTES_PER_SECOND)",
        "field": "body",
    }
    assert headers[b"connection"] == b"close"
    assert seen == ["ClientDisconnect"]


def test_a_body_above_the_minimum_rate_arrives_whole() -> None:
    # Each chunk buys 10 s more at 1000 bytes/s, however late the loop runs it.
    status, body, _ = status_and_body(trickled(b"x" * 10_000, 0.01, min_rate=1000))
    assert (status, body) == (200, {"bytes": 10_000 * 200})
