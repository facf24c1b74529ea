"""Shared by the sink tests: order factories and a real HTTP receiver for the webhook sink."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvprefetch_client.orders import Cancel, Order, message_adapter
from tests.conftest import live_server


def order(order_id: str, instance_id: str = "gpu-0", **kw: Any) -> Order:
    fields: dict[str, Any] = dict(
        order_id=order_id,
        kind="prefetch",
        instance_id=instance_id,
        source_tier="pool",
        block_hashes=[1, 2],
        size_bytes=2048,
        created_ts=10.0,
        start_by_ts=11.0,
        needed_by_ts=12.0,
        session_ids=["s1"],
    )
    fields.update(kw)
    return Order(**fields)


class Receiver:
    """A webhook receiver: records each batch with its Idempotency-Key; answers the statuses
    queued in `fail_next` (with their headers) before it answers 200."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()
        self.app = Starlette(routes=[Route("/orders", self._post, methods=["POST"])])

    def reset(self) -> None:
        with self._lock:
            self.calls = 0
            self.batches: list[tuple[str | None, list[Order | Cancel]]] = []
            self.fail_next: list[tuple[int, dict[str, str]]] = []
            self._taken = 0

    async def _post(self, request: Request) -> Response:
        body = await request.body()
        with self._lock:
            self.calls += 1
            if self.fail_next:
                status, headers = self.fail_next.pop(0)
                return Response(b"not now", status_code=status, headers=headers)
            messages = [message_adapter.validate_python(m) for m in orjson.loads(body)["messages"]]
            self.batches.append((request.headers.get("idempotency-key"), messages))
        return Response(b"{}", media_type="application/json")

    def take(self) -> list[Order | Cancel]:
        """Messages received since the last take."""
        with self._lock:
            fresh, self._taken = self.batches[self._taken :], len(self.batches)
        return [m for _, batch in fresh for m in batch]


@pytest.fixture(scope="session")
def _receiver_server() -> Iterator[tuple[Receiver, str]]:
    receiver = Receiver()
    with live_server(receiver.app) as url:
        yield receiver, f"{url}/orders"


@pytest.fixture
def receiver(_receiver_server: tuple[Receiver, str]) -> tuple[Receiver, str]:
    """The session's one receiver server, emptied for this test: (receiver, its URL)."""
    _receiver_server[0].reset()
    return _receiver_server
