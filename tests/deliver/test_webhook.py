"""WebhookSink: retries with backoff, Retry-After, what is not retried, the idempotency key; on
httpx's MockTransport (the timing, without waiting) and on a real local server."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import httpx
import orjson
import pytest

from app.deliver import Fence, SinkFenced, SinkRejected, SinkUnavailable, WebhookSink
from app.deliver.webhook import idempotency_key, parse_retry_after
from kvprefetch_client.orders import Cancel
from tests.deliver.conftest import Receiver, order
from tests.ports import dead_port

URL = "http://receiver.test/orders"
# How errors name it: a webhook URL's path is often its secret (app/core/redact.py).
SHOWN = "http://receiver.test/****"


class Script:
    """A MockTransport handler answering from a script: a status (with headers) or an exception
    per call, then 200; it records each request."""

    def __init__(self, *answers: int | tuple[int, dict[str, str]] | Exception) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0) if self.answers else 200
        if isinstance(answer, Exception):
            raise answer
        status, headers = answer if isinstance(answer, tuple) else (answer, {})
        return httpx.Response(status, headers=headers, text="nope" if status >= 400 else "{}")


def sink_for(script: Script, sleeps: list[float], **kw: Any) -> WebhookSink:
    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    kw.setdefault("jitter", lambda: 1.0)
    return WebhookSink(URL, transport=httpx.MockTransport(script), sleep=sleep, **kw)


def run(body: Callable[[], Any]) -> Any:
    return asyncio.run(body())


def test_the_batch_body_and_its_idempotency_key() -> None:
    script, sleeps = Script(), []

    async def body() -> None:
        sink = sink_for(script, sleeps)
        await sink.submit([order("a"), order("b")])
        await sink.cancel([Cancel(order_id="a", reason="closed")])
        await sink.close()

    run(body)
    first, second = script.requests
    assert orjson.loads(first.content) == {
        "messages": [orjson.loads(order("a").to_json()), orjson.loads(order("b").to_json())]
    }
    assert first.headers["content-type"] == "application/json"
    assert first.headers["idempotency-key"] == idempotency_key([order("a"), order("b")])
    assert orjson.loads(second.content) == {
        "messages": [{"type": "cancel", "order_id": "a", "reason": "closed"}]
    }
    assert (
        second.headers["idempotency-key"] != first.headers["idempotency-key"]
    )  # a cancel is not its order


def test_5xx_and_connection_errors_are_retried_with_exponential_backoff_and_the_same_key() -> None:
    script, sleeps = Script(503, httpx.ConnectError("refused"), 500, 502), []

    async def body() -> list[str]:
        sink = sink_for(script, sleeps, backoff_seconds=0.2, max_backoff_seconds=1.0)
        try:
            return await sink.submit([order("a")])
        finally:
            await sink.close()

    assert run(body) == ["a"]
    assert sleeps == [0.2, 0.4, 0.8, 1.0]  # doubling, capped
    assert len({r.headers["idempotency-key"] for r in script.requests}) == 1
    assert len(script.requests) == 5


def test_jitter_waits_between_half_and_all_of_the_backoff() -> None:
    script, sleeps = Script(500, 500), []

    async def body() -> None:
        sink = sink_for(script, sleeps, backoff_seconds=1.0, jitter=lambda: 0.0)
        await sink.submit([order("a")])
        await sink.close()

    run(body)
    assert sleeps == [0.5, 1.0]


def test_retry_after_is_honoured_and_429_is_retried() -> None:
    script, sleeps = Script((429, {"Retry-After": "3"}), (503, {"Retry-After": "0"})), []

    async def body() -> None:
        sink = sink_for(script, sleeps, max_backoff_seconds=5.0)
        await sink.submit([order("a")])
        await sink.close()

    run(body)
    assert sleeps == [3.0, 0.0]


def test_a_retry_after_past_the_longest_wait_gives_up_at_once() -> None:
    script, sleeps = Script((503, {"Retry-After": "120"})), []

    async def body() -> None:
        sink = sink_for(script, sleeps, max_backoff_seconds=5.0)
        with pytest.raises(SinkUnavailable) as caught:
            await sink.submit([order("a")])
        assert sink.last_error == str(caught.value)
        await sink.close()
        assert str(caught.value) == (
            f"{SHOWN} answered HTTP 503 with Retry-After 120 s, longer than "
            "KVP_ORDER_WEBHOOK_MAX_BACKOFF_SECONDS (5 s): giving up after 1 attempt(s)"
        )

    run(body)
    assert sleeps == [] and len(script.requests) == 1


def test_it_gives_up_after_the_bound_and_a_resubmit_then_tries_again() -> None:
    script, sleeps = Script(500, 500, 500), []

    async def body() -> None:
        sink = sink_for(script, sleeps, max_attempts=3)
        gave_up = rf"^{re.escape(SHOWN)}: gave up after 3 attempt\(s\); last: HTTP 500$"
        with pytest.raises(SinkUnavailable, match=gave_up):
            await sink.submit([order("a")])
        assert len(script.requests) == 3 and len(sleeps) == 2
        assert sink.last_error is not None
        assert await sink.submit([order("a")]) == [
            "a"
        ]  # nothing was delivered, so it is not a repeat
        assert sink.last_error is None
        await sink.close()

    run(body)


@pytest.mark.parametrize("status", [400, 401, 404, 409, 413, 422])
def test_a_4xx_other_than_429_is_refused_without_retry(status: int) -> None:
    script, sleeps = Script(status), []

    async def body() -> None:
        sink = sink_for(script, sleeps)
        with pytest.raises(SinkRejected) as caught:
            await sink.submit([order("a"), order("b")])
        assert caught.value.status_code == status
        assert str(caught.value) == f"{SHOWN} refused 2 messages: HTTP {status}: nope"
        await sink.close()

    run(body)
    assert len(script.requests) == 1 and sleeps == []


def test_large_submits_go_in_batches_and_a_failed_batch_leaves_only_its_ids_unsent() -> None:
    script, sleeps = Script(200, 400), []

    async def body() -> None:
        sink = sink_for(script, sleeps, batch_messages=2)
        with pytest.raises(SinkRejected):
            await sink.submit([order(i) for i in "abcde"])
        assert await sink.submit([order(i) for i in "abcde"]) == ["c", "d", "e"]
        await sink.close()

    run(body)
    assert [len(orjson.loads(r.content)["messages"]) for r in script.requests] == [2, 2, 2, 1]


def test_concurrent_submits_of_one_id_post_it_once() -> None:
    script, sleeps = Script(), []

    async def body() -> None:
        sink = sink_for(script, sleeps)
        results = await asyncio.gather(sink.submit([order("a")]), sink.submit([order("a")]))
        assert sorted(results) == [[], ["a"]]
        await sink.close()

    run(body)
    assert len(script.requests) == 1


def test_parse_retry_after() -> None:
    assert parse_retry_after(None) is None
    assert parse_retry_after(" 7 ") == 7.0
    assert parse_retry_after("-3") == 0.0
    assert parse_retry_after("soon") is None
    in_a_minute = format_datetime(datetime.now(UTC) + timedelta(seconds=60), usegmt=True)
    assert 55 < parse_retry_after(in_a_minute) <= 60  # type: ignore[operator]


def test_a_real_server_failing_the_first_calls_gets_the_batch_once(
    receiver: tuple[Receiver, str],
) -> None:
    server, url = receiver
    server.fail_next = [(503, {"Retry-After": "0"}), (500, {})]

    async def body() -> list[str]:
        sink = WebhookSink(url, backoff_seconds=0.01, max_attempts=3)
        try:
            return await sink.submit([order("a"), order("b")])
        finally:
            await sink.close()

    assert run(body) == ["a", "b"]
    assert server.calls == 3
    ((key, messages),) = server.batches
    assert key == idempotency_key([order("a"), order("b")])
    assert messages == [order("a"), order("b")]


def test_a_real_server_that_keeps_failing_is_given_up_on(receiver: tuple[Receiver, str]) -> None:
    server, url = receiver
    server.fail_next = [(502, {})] * 3

    async def body() -> None:
        sink = WebhookSink(url, backoff_seconds=0.01, max_attempts=2)
        with pytest.raises(SinkUnavailable, match=r"gave up after 2 attempt\(s\); last: HTTP 502"):
            await sink.submit([order("a")])
        await sink.close()

    run(body)
    assert server.calls == 2 and server.batches == []


def test_nobody_listening_is_a_connection_error_retried_then_given_up_on() -> None:
    async def body(port: int) -> None:
        sink = WebhookSink(f"http://127.0.0.1:{port}/orders", backoff_seconds=0.01, max_attempts=2)
        with pytest.raises(
            SinkUnavailable, match=r"gave up after 2 attempt\(s\); last: ConnectError"
        ):
            await sink.submit([order("a")])
        await sink.close()

    with dead_port() as port:
        run(lambda: body(port))


def test_a_holder_fenced_out_mid_submit_posts_nothing_more(
    receiver: tuple[Receiver, str],
) -> None:
    """The planning lease lapses while the first try waits to be retried (the holder paused past
    it): the retry is not posted, nor is anything after, until the lease is held again."""
    server, url = receiver
    server.fail_next = [(503, {})]
    holding: list[str | None] = ["a|1"]

    async def paused(seconds: float) -> None:
        holding[0] = None  # woke past its lease: another replica plans

    async def body() -> None:
        sink = WebhookSink(url, max_attempts=3, sleep=paused)
        sink.fence = Fence("kvp:planner", lambda: holding[0])
        try:
            with pytest.raises(SinkFenced, match="FENCED"):
                await sink.submit([order("a")])
            with pytest.raises(SinkFenced):
                await sink.cancel([Cancel(order_id="a", reason="closed")])
            assert server.calls == 1 and server.batches == []
            holding[0] = "a|3"  # a term of its own again: what was fenced is not marked sent
            assert await sink.submit([order("a")]) == ["a"]
        finally:
            await sink.close()

    run(body)
    assert server.take() == [order("a")]
