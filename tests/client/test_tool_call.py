"""tool_call(): an agent loop's tool run told as two signals, and never an error in the loop."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvprefetch_client.client import Answer, AsyncKvpClient, ClientStats, KvpClient, ToolCall
from kvprefetch_client.client._pipeline import _Pipeline
from tests.client.conftest import HANG_GUARD
from tests.client.test_client import FakeService
from tests.ports import dead_port

FLAVOURS = ["sync", "async"]


class ToolFailed(Exception):
    """What a tool body raises in these tests."""


def wait_until(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while not done():
        assert time.monotonic() < deadline, "hung"
        time.sleep(0.01)


async def await_until(done: Callable[[], bool]) -> None:
    async with asyncio.timeout(HANG_GUARD):
        while not done():
            await asyncio.sleep(0.01)


def agent_loop(kvp: KvpClient, error: ToolFailed) -> list[ToolCall]:
    """Two tool runs, the second raising `error`; run where `kvp` can send."""
    with kvp.tool_call("agent-1", tool="bash") as ok:
        pass
    with pytest.raises(ToolFailed) as raised, kvp.tool_call("agent-1", tool="web.search") as bad:
        raise error
    assert raised.value is error
    return [ok, bad]


async def async_agent_loop(kvp: AsyncKvpClient, error: ToolFailed) -> list[ToolCall]:
    async with kvp.tool_call("agent-1", tool="bash") as ok:
        await asyncio.sleep(0)
    with pytest.raises(ToolFailed) as raised:
        async with kvp.tool_call("agent-1", tool="web.search") as bad:
            raise error
    assert raised.value is error
    return [ok, bad]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_both_signals_reach_the_real_service_in_order_even_when_the_body_raises(
    flavour: str, service_url: str
) -> None:
    answers: list[Answer] = []
    error = ToolFailed("exit status 2")
    before = time.time()
    if flavour == "sync":
        with KvpClient(service_url, on_answer=answers.append) as kvp:
            calls = agent_loop(kvp, error)
            assert kvp.flush(timeout=HANG_GUARD)
            stats = kvp.stats
    else:

        async def main() -> tuple[list[ToolCall], ClientStats]:
            async with AsyncKvpClient(service_url, on_answer=answers.append) as kvp:
                calls = await async_agent_loop(kvp, error)
                assert await kvp.flush(timeout=HANG_GUARD)
                return calls, kvp.stats

        calls, stats = asyncio.run(main())
    after = time.time()

    events = [e for c in calls for e in (c.started, c.finished)]
    assert all(e is not None for e in events)
    sent = [e for e in events if e is not None]
    assert [(e.session_id, e.kind, e.tool) for e in sent] == [
        ("agent-1", "tool_started", "bash"),
        ("agent-1", "tool_finished", "bash"),
        ("agent-1", "tool_started", "web.search"),
        ("agent-1", "tool_finished", "web.search"),
    ]
    assert [e.ts for e in sent] == sorted(e.ts for e in sent)  # the client's clock
    assert before <= sent[0].ts and sent[-1].ts <= after
    # The service accepted them in the order they were posted.
    assert [i for a in answers for i in a.accepted] == [e.event_id for e in sent]
    assert (stats.sent, stats.rejected, stats.signal_errors) == (4, 0, 0)
    with httpx.Client(base_url=service_url) as http:
        view = http.get("/v1/sessions/agent-1").raise_for_status().json()
    assert view["signals_total"] == 4
    # Sorted: the service orders equal timestamps by kind.
    assert sorted((s["ts"], s["kind"], s["tool"]) for s in view["signals"]) == sorted(
        (e.ts, e.kind, e.tool) for e in sent
    )


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_with_the_service_down_the_body_runs_and_the_failure_is_counted_not_raised(
    flavour: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvprefetch.client")
    results: list[int] = []
    with dead_port() as port:
        url = f"http://127.0.0.1:{port}"
        options: dict[str, Any] = {"max_backoff_seconds": 0.01}
        if flavour == "sync":
            kvp = KvpClient(url, **options)
            for i in range(3):
                with kvp.tool_call("agent-1", tool="bash"):
                    results.append(i)
            wait_until(lambda: kvp.stats.retries >= 2)
            stats = kvp.stats
            kvp.close(timeout=0)
        else:

            async def main() -> ClientStats:
                aclient = AsyncKvpClient(url, **options)
                for i in range(3):
                    async with aclient.tool_call("agent-1", tool="bash"):
                        results.append(i)
                await await_until(lambda: aclient.stats.retries >= 2)
                stats = aclient.stats
                await aclient.aclose(timeout=0)
                return stats

            stats = asyncio.run(main())
    assert results == [0, 1, 2]
    assert (stats.sent, stats.queued, stats.signal_errors) == (0, 6, 0)
    assert stats.last_error is not None and "ConnectError" in stats.last_error
    # One warning for the outage, not one per attempt or per call.
    outage = [r for r in caplog.records if "cannot deliver" in r.getMessage()]
    assert len(outage) == 1 and outage[0].levelno == logging.WARNING


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_signal_that_cannot_be_queued_is_counted_and_logged_once_not_raised(
    flavour: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvprefetch.client")
    fake = FakeService()
    too_long = "t" * 129  # a tool name is at most 128 characters
    results: list[int] = []
    if flavour == "sync":
        with KvpClient("http://kvp.test", transport=httpx.MockTransport(fake)) as kvp:
            for i in range(3):
                with kvp.tool_call("agent-1", tool=too_long) as call:
                    results.append(i)
            assert kvp.flush(timeout=HANG_GUARD)
            stats = kvp.stats
    else:

        async def main() -> tuple[ToolCall, ClientStats]:
            transport = httpx.MockTransport(fake)
            async with AsyncKvpClient("http://kvp.test", transport=transport) as aclient:
                for i in range(3):
                    async with aclient.tool_call("agent-1", tool=too_long) as call:
                        results.append(i)
                assert await aclient.flush(timeout=HANG_GUARD)
                return call, aclient.stats

        call, stats = asyncio.run(main())
    assert results == [0, 1, 2]
    assert (call.started, call.finished) == (None, None)
    assert (stats.signal_errors, stats.queued, stats.sent) == (6, 0, 0)
    assert fake.attempts == []
    logged = [r.getMessage() for r in caplog.records if "tool_call()" in r.getMessage()]
    assert len(logged) == 1
    assert all(w in logged[0] for w in ("tool_started", "'agent-1'", "ValidationError: tool:"))


def test_an_async_client_used_off_its_loop_counts_the_signals_and_runs_the_body() -> None:
    """A sync `with` on a thread without a loop: send() raises there, tool_call() must not."""
    kvp = AsyncKvpClient("http://kvp.test", transport=httpx.MockTransport(FakeService()))
    with kvp.tool_call("agent-1", tool="bash") as call:
        ran = True
    assert ran and call.started is None
    assert (kvp.stats.signal_errors, kvp.stats.queued) == (2, 0)


def test_signal_errors_are_logged_at_most_once_a_minute() -> None:
    pipeline = _Pipeline(
        batch_size=10, flush_interval_seconds=0.0, max_queue_events=10, max_backoff_seconds=1.0
    )
    assert [pipeline.signal_failed(now) for now in (100.0, 101.0, 159.9, 160.0, 161.0)] == [
        1,
        None,
        None,
        4,
        None,
    ]
    assert pipeline.stats().signal_errors == 5
