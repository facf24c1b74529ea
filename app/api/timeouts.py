"""Request timeouts, as plain ASGI middleware (no per-request task, unlike BaseHTTPMiddleware).

A body that stops arriving (a slow or stuck client) is answered 408 once it has been silent for
`body_seconds`, or once it is later than `body_seconds` after the headers plus one second per
`min_body_bytes_per_second` bytes received (a body trickled a byte at a time is never silent for
long), and the route sees the client as gone, so nothing of it is accepted. A request still
unanswered after `request_seconds` is answered 503. Neither can pre-empt work running on the
event loop; the batch and body limits bound that.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def _error(status: int, field: str, message: str) -> tuple[Message, Message]:
    body = orjson.dumps({"detail": message, "field": field})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 503:
        headers.append((b"retry-after", b"1"))
    # What is left of the request (its body's rest) is never read: the connection ends with it.
    headers.append((b"connection", b"close"))
    return (
        {"type": "http.response.start", "status": status, "headers": headers},
        {"type": "http.response.body", "body": body},
    )


class TimeoutMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        body_seconds: float,
        request_seconds: float,
        min_body_bytes_per_second: float = 0.0,
    ) -> None:
        self.app = app
        self.body_seconds = body_seconds
        self.request_seconds = request_seconds
        self.min_body_rate = min_body_bytes_per_second

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state: dict[str, Any] = {"started": False, "answered": False, "body_done": False}
        loop = asyncio.get_running_loop()
        # The latest the body may be done by: pushed on by each byte at the minimum rate.
        body_credit = 1.0 / self.min_body_rate if self.min_body_rate > 0 else 0.0
        body_deadline = loop.time() + self.body_seconds if body_credit else float("inf")
        received = 0

        async def guarded_send(message: Message) -> None:
            if state["answered"]:
                return  # we already answered for the route (408 or 503)
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        async def timed_receive() -> Message:
            nonlocal body_deadline, received
            if state["body_done"]:
                return await receive()  # past the body: a streaming response waits for disconnect
            now = loop.time()
            slow = received > 0 and body_deadline < now + self.body_seconds
            silence = asyncio.timeout_at(min(now + self.body_seconds, body_deadline))
            try:
                async with silence:
                    message = await receive()
            except TimeoutError:
                if not silence.expired():
                    raise
                await answer(
                    408,
                    "body",
                    f"the body arrived slower than {self.min_body_rate:g} bytes/s "
                    "(KVP_MIN_BODY_BYTES_PER_SECOND)"
                    if slow
                    else f"the body stopped arriving for {self.body_seconds:g} s "
                    "(KVP_BODY_TIMEOUT_SECONDS)",
                )
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body", False):
                state["body_done"] = True
            else:
                chunk = len(message.get("body", b""))
                received += chunk
                body_deadline += chunk * body_credit
            return message

        async def answer(status: int, field: str, message: str) -> None:
            if state["started"] or state["answered"]:
                return
            state["answered"] = True
            for part in _error(status, field, message):
                await send(part)

        deadline = asyncio.timeout(self.request_seconds)
        try:
            async with deadline:
                await self.app(scope, timed_receive, guarded_send)
        except TimeoutError:
            if not deadline.expired():
                raise  # the route's own timeout, not ours
            await answer(
                503,
                "request",
                f"the request took over {self.request_seconds:g} s (KVP_REQUEST_TIMEOUT_SECONDS)",
            )
