"""The body size limit for every route, as plain ASGI middleware.

POST /v1/events reads its body by hand and checks the limit itself; routes whose body FastAPI
parses (route hints, model reloads) would otherwise read any size into memory first. A declared
Content-Length over the limit is refused before a byte is read; a body streamed past it is cut
off, and the route sees the client as gone.

A body sent with a Content-Encoding (gzip, say) is refused with 415 before a byte is read: no
route decodes one, and its bytes would only fail later as "not JSON" or "not UTF-8".
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit
        headers = dict(scope["headers"])
        encoding = headers.get(b"content-encoding", b"").strip().lower()
        if encoding not in (b"", b"identity"):
            await _refuse(
                send,
                "send the body uncompressed: no Content-Encoding (or identity)",
                status=415,
                field="content-encoding",
            )
            return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _refuse(send, f"the body is {int(declared)} bytes; the limit is {limit}")
            return
        state: dict[str, Any] = {"read": 0, "refused": False}

        async def counted_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                state["read"] += len(message.get("body", b""))
                if state["read"] > limit:
                    state["refused"] = True
                    await _refuse(send, f"the body is over the limit of {limit} bytes")
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not state["refused"]:
                await send(message)

        await self.app(scope, counted_receive, guarded_send)


async def _refuse(send: Send, message: str, *, status: int = 413, field: str = "body") -> None:
    body = orjson.dumps({"detail": message, "field": field})
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
