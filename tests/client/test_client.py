"""The event client: delivery against the real service, and failure handling against scripted ones.

Scripted services are httpx.MockTransport handlers, so failures are injected without patching.
Timeouts in these tests only guard against hangs; no test depends on how fast anything is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from itertools import pairwise
from typing import Any

import httpx
import pytest

from kvprefetch_client.client import Answer, AsyncKvpClient, ClientStats, KvpClient
from kvprefetch_client.client._pipeline import (
    _backoff_seconds,
    _Batch,
    _Item,
    _judge_response,
    _Outcome,
    _partition,
    _Pipeline,
    _retry_after_seconds,
)
from kvprefetch_client.events import RequestRouted
from tests.client.conftest import HANG_GUARD

FLAVOURS = ["sync", "async"]


def routed(i: int, session_id: str = "s1") -> RequestRouted:
    return RequestRouted(
        event_id=f"ev-{i:06d}",
        ts=1_000.0 + i,
        session_id=session_id,
        request_id=f"r-{i}",
        instance_id="gpu-0",
        prompt_tokens=100 + i,
    )


def conserved(stats: ClientStats, total: int) -> bool:
    """Every event sent is in exactly one of the five buckets."""
    return stats.queued + stats.sent + stats.duplicates + stats.rejected + stats.dropped == total


Failure = int | Exception


class FakeService:
    """A scripted POST /v1/events that applies each event id once, like the real one.

    `failures` are consumed one per attempt (a status code, or an exception the transport
    raises) before it starts accepting; `respond` can answer instead of accepting.
    """

    def __init__(
        self,
        failures: Sequence[Failure] = (),
        *,
        respond: Callable[[list[dict[str, Any]]], httpx.Response | None] | None = None,
        apply_failed: bool = False,
    ) -> None:
        self.failures: deque[Failure] = deque(failures)
        self.respond = respond
        self.apply_failed = apply_failed  # apply, then fail: the answer is lost on the way back
        self.attempts: list[tuple[list[str], bool]] = []  # (event ids, answered 200/422)
        self.applied: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        events = json.loads(request.content)["events"]
        ids = [e["event_id"] for e in events]
        with self.lock:
            failure = self.failures.popleft() if self.failures else None
            self.attempts.append((ids, failure is None))
            if failure is not None and self.apply_failed:
                self._apply(ids)
        if isinstance(failure, Exception):
            raise failure
        if failure is not None:
            return httpx.Response(
                failure,
                json={"detail": "unavailable", "field": "store"},
                headers={"Retry-After": "0"},
            )
        if self.respond is not None and (answer := self.respond(events)) is not None:
            return answer
        with self.lock:
            accepted, duplicates = self._apply(ids)
        return httpx.Response(
            200, json={"accepted": accepted, "duplicates": duplicates, "rejected": []}
        )

    def _apply(self, ids: list[str]) -> tuple[list[str], list[str]]:
        known = set(self.applied)
        accepted = [i for i in ids if i not in known]
        self.applied.extend(accepted)
        return accepted, [i for i in ids if i in known]


def deliver(
    flavour: str,
    handler: Callable[[httpx.Request], httpx.Response],
    events: Sequence[Any],
    **options: Any,
) -> ClientStats:
    """Send `events` through a client of `flavour`, flush, close; returns the final stats."""
    options = {"max_backoff_seconds": 0.001, **options}
    transport = httpx.MockTransport(handler)
    if flavour == "sync":
        with KvpClient("http://kvp.test", transport=transport, **options) as client:
            for event in events:
                client.send(event)
            assert client.flush(timeout=HANG_GUARD)
        return client.stats

    async def main() -> ClientStats:
        async with AsyncKvpClient("http://kvp.test", transport=transport, **options) as aclient:
            for event in events:
                aclient.send(event)
            assert await aclient.flush(timeout=HANG_GUARD)
        return aclient.stats

    return asyncio.run(main())


# --- against the real service ---------------------------------------------------------------


# service_url: the real app under uvicorn (tests/client/conftest.py).


def test_rejections_the_service_left_out_are_counted_rejected_not_sent(service_url: str) -> None:
    """The service lists at most 100 rejections per answer (app/api/batch.py): the client counts
    the events it neither accepted nor called duplicates as rejected."""
    good = [routed(i) for i in range(50)]
    bad = [
        {
            "type": "request_routed",
            "event_id": f"bad-{i}",
            "ts": 1.0,
            "session_id": "s",
            "request_id": "r",
            "instance_id": "gpu-0",
            "prompt_tokens": -1,
        }
        for i in range(150)
    ]
    answers: list[Answer] = []
    with KvpClient(
        service_url, batch_size=500, flush_interval_seconds=60, on_answer=answers.append
    ) as client:
        for event in [*good[:25], *bad, *good[25:]]:
            client.send(event)
        assert client.flush(timeout=HANG_GUARD)
        stats = client.stats
    assert (stats.sent, stats.rejected, stats.queued, stats.dropped) == (50, 150, 0, 0)
    assert [len(a.accepted) for a in answers] == [50] and len(answers[0].rejected) == 150
    assert set(answers[0].rejected) == {f"bad-{i}" for i in range(150)}


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_real_service_gets_every_turn(
    flavour: str, service_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    sessions, turns = 30, 100
    events: list[Any] = [
        routed(t * sessions + s, session_id=f"s-{s}") for t in range(turns) for s in range(sessions)
    ]
    bad = [
        {
            "type": "request_routed",
            "event_id": f"bad-{i}",
            "ts": 1.0,
            "session_id": "s-0",
            "request_id": "r",
            "instance_id": "gpu-0",
            "prompt_tokens": -1,
        }
        for i in range(2)
    ]
    events[1000:1000] = bad
    caplog.set_level(logging.WARNING, logger="kvprefetch.client")

    answers: list[Answer] = []
    transport_free: dict[str, Any] = {"max_backoff_seconds": 0.05, "on_answer": answers.append}
    if flavour == "sync":
        with KvpClient(service_url, **transport_free) as client:
            for event in events:
                client.send(event)
            assert client.flush(timeout=HANG_GUARD)
            stats = client.stats
            # A resend of known ids is acknowledged as duplicates and changes nothing.
            for event in events[:500]:
                client.send(event)
            assert client.flush(timeout=HANG_GUARD)
            again = client.stats
    else:

        async def main() -> tuple[ClientStats, ClientStats]:
            async with AsyncKvpClient(service_url, **transport_free) as aclient:
                for event in events:
                    aclient.send(event)
                assert await aclient.flush(timeout=HANG_GUARD)
                first = aclient.stats
                for event in events[:500]:
                    aclient.send(event)
                assert await aclient.flush(timeout=HANG_GUARD)
                return first, aclient.stats

        stats, again = asyncio.run(main())

    assert (stats.sent, stats.rejected, stats.queued, stats.dropped) == (sessions * turns, 2, 0, 0)
    assert (again.sent, again.duplicates, again.rejected) == (sessions * turns, 500, 2)
    ids = [e["event_id"] if isinstance(e, dict) else e.event_id for e in events]
    told = {
        kind: [i for a in answers for i in getattr(a, kind)]
        for kind in ("accepted", "duplicates", "rejected")
    }
    assert told == {
        "accepted": [i for i in ids if not i.startswith("bad")],
        "duplicates": ids[:500],
        "rejected": ["bad-0", "bad-1"],
    }
    assert "prompt_tokens" in caplog.text and "bad-0" in caplog.text
    with httpx.Client(base_url=service_url) as http:
        for s in range(sessions):
            view = http.get(f"/v1/sessions/s-{s}").raise_for_status().json()
            assert view["turns"] == turns


# --- failures, against scripted services ----------------------------------------------------


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_failed_attempts_are_retried_with_the_same_ids(flavour: str) -> None:
    failures: list[Failure] = [
        503,
        httpx.ConnectError("refused"),
        429,
        500,
        httpx.ReadTimeout("slow"),
    ]
    fake = FakeService(failures)
    events = [routed(i) for i in range(45)]

    stats = deliver(flavour, fake, events, batch_size=10)

    sent_ids = [e.event_id for e in events]
    assert sorted(fake.applied) == sorted(sent_ids)
    assert set(Counter(fake.applied).values()) == {1}
    assert stats.retries == len(failures)
    assert (stats.sent, stats.duplicates, stats.rejected, stats.queued) == (45, 0, 0, 0)
    assert "ReadTimeout" in (stats.last_error or "")
    for (ids, answered), (next_ids, _) in pairwise(fake.attempts):
        if not answered:
            assert next_ids == ids
    assert all(len(ids) <= 10 for ids, _ in fake.attempts)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_lost_answer_is_resent_and_acknowledged_as_duplicates(flavour: str) -> None:
    fake = FakeService([503], apply_failed=True)
    events = [routed(i) for i in range(5)]

    stats = deliver(flavour, fake, events, batch_size=100, flush_interval_seconds=60)

    assert fake.attempts[0][0] == fake.attempts[1][0] == [e.event_id for e in events]
    assert fake.applied == [e.event_id for e in events]
    assert (stats.sent, stats.duplicates, stats.retries) == (0, 5, 1)
    assert conserved(stats, 5)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_rejected_events_are_dropped_and_counted_the_rest_done(
    flavour: str, caplog: pytest.LogCaptureFixture
) -> None:
    def respond(events: list[dict[str, Any]]) -> httpx.Response | None:
        bad = [(i, e) for i, e in enumerate(events) if e["event_id"].startswith("bad")]
        if not bad:
            return None
        rejected = []
        for i, e in bad:  # two errors for each bad event: still one rejected event
            rejected += [
                {
                    "index": i,
                    "event_id": e["event_id"],
                    "field": f"events[{i}].ts",
                    "message": "Input should be greater than or equal to 0",
                },
                {
                    "index": i,
                    "event_id": e["event_id"],
                    "field": f"events[{i}].type",
                    "message": "wrong",
                },
            ]
        good = [e["event_id"] for e in events if not e["event_id"].startswith("bad")]
        fake.applied.extend(good)
        return httpx.Response(422, json={"accepted": good, "duplicates": [], "rejected": rejected})

    fake = FakeService(respond=respond)
    events: list[Any] = [routed(i) for i in range(20)]
    events[3:3] = [{**routed(100 + i).model_dump(), "event_id": f"bad-{i}"} for i in range(3)]
    caplog.set_level(logging.WARNING, logger="kvprefetch.client")

    stats = deliver(flavour, fake, events, batch_size=50, flush_interval_seconds=60)

    assert (stats.sent, stats.rejected, stats.retries, stats.queued) == (20, 3, 0, 0)
    assert len(fake.attempts) == 1  # a rejected event would fail again: never resent
    assert "events[3].ts" in caplog.text and "bad-0" in caplog.text


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_batch_too_large_is_split_until_it_fits(flavour: str) -> None:
    accepted_sizes: list[int] = []

    def respond(events: list[dict[str, Any]]) -> httpx.Response | None:
        if len(events) > 3:
            return httpx.Response(413, json={"detail": "too large", "field": "body"})
        accepted_sizes.append(len(events))
        return None

    fake = FakeService(respond=respond)
    events = [routed(i) for i in range(16)]

    stats = deliver(flavour, fake, events, batch_size=16, flush_interval_seconds=60)

    assert fake.applied == [e.event_id for e in events]  # in order, each once
    assert fake.attempts[0][0] == [e.event_id for e in events]
    assert accepted_sizes == [2] * 8  # 16 -> 8 + 8 -> 4 + 4 + 4 + 4 -> 2 * 8
    assert (stats.sent, stats.rejected, stats.retries) == (16, 0, 0)


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("status", [400, 413, 415])
def test_a_refused_batch_is_dropped_and_counted(
    flavour: str, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(events: list[dict[str, Any]]) -> httpx.Response:
        return httpx.Response(status, json={"detail": f"no thanks {status}", "field": "body"})

    fake = FakeService(respond=refuse)
    caplog.set_level(logging.ERROR, logger="kvprefetch.client")

    stats = deliver(flavour, fake, [routed(i) for i in range(3)], batch_size=1)

    assert (stats.rejected, stats.sent, stats.retries, stats.queued) == (3, 0, 0, 0)
    assert len(fake.attempts) == 3
    assert f"no thanks {status}" in caplog.text and f"no thanks {status}" in stats.last_error


class Hang:
    """A handler that blocks every attempt until released."""

    def __init__(self, then: FakeService) -> None:
        self.then = then
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.entered.set()
        assert self.release.wait(HANG_GUARD), "never released"
        return self.then(request)


def test_a_full_queue_drops_the_oldest_and_keeps_the_newest() -> None:
    hang = Hang(FakeService())
    client = KvpClient(
        "http://kvp.test",
        transport=httpx.MockTransport(hang),
        batch_size=50,
        max_queue_events=1000,
        max_backoff_seconds=0.001,
    )
    try:
        client.send(routed(0))
        assert hang.entered.wait(HANG_GUARD)  # event 0 is in flight, alone
        for i in range(1, 1501):
            client.send(routed(i))
        assert client.stats.dropped == 500
    finally:
        hang.release.set()
    assert client.close(timeout=HANG_GUARD)

    expected = ["ev-000000"] + [routed(i).event_id for i in range(501, 1501)]
    assert hang.then.applied == expected
    stats = client.stats
    assert (stats.sent, stats.dropped, stats.queued) == (1001, 500, 0)


def test_async_full_queue_drops_the_oldest_and_keeps_the_newest() -> None:
    fake = FakeService()

    async def main() -> ClientStats:
        async with AsyncKvpClient(
            "http://kvp.test",
            transport=httpx.MockTransport(fake),
            batch_size=64,
            max_queue_events=1000,
        ) as client:
            for i in range(1500):  # no await: the sender cannot run meanwhile
                client.send(routed(i))
            assert client.stats.dropped == 500
        return client.stats

    stats = asyncio.run(main())
    assert fake.applied == [routed(i).event_id for i in range(500, 1500)]
    assert (stats.sent, stats.dropped, stats.queued) == (1000, 500, 0)


def test_send_never_blocks_while_the_service_hangs() -> None:
    hang = Hang(FakeService())
    client = KvpClient(
        "http://kvp.test",
        transport=httpx.MockTransport(hang),
        batch_size=20,
        max_queue_events=100,
        timeout_seconds=HANG_GUARD,
    )
    try:

        def produce() -> None:
            for i in range(1000):
                client.request_routed(
                    session_id="s1",
                    request_id=f"r-{i}",
                    instance_id="gpu-0",
                    prompt_tokens=10,
                    event_id=f"ev-{i:06d}",
                )

        client.send(routed(-1))
        assert hang.entered.wait(HANG_GUARD)  # the sender is stuck in the service from now on
        producer = threading.Thread(target=produce)
        producer.start()
        producer.join(HANG_GUARD)
        assert not producer.is_alive(), "send() blocked on a hung service"
        stats = client.stats
        assert (stats.queued, stats.dropped, stats.sent) == (1 + 100, 900, 0)
        assert client.flush(timeout=0.05) is False  # the events stay queued
    finally:
        hang.release.set()
    assert client.close(timeout=HANG_GUARD)
    assert (client.stats.queued, client.stats.sent) == (0, 101)


def test_close_gives_up_on_a_hung_service_after_its_timeout() -> None:
    hang = Hang(FakeService())
    client = KvpClient(
        "http://kvp.test", transport=httpx.MockTransport(hang), timeout_seconds=HANG_GUARD
    )
    try:
        client.send(routed(0))
        assert hang.entered.wait(HANG_GUARD)
        assert client.close(timeout=0.05) is False
        assert client.stats.queued == 1
    finally:
        hang.release.set()


def test_async_close_gives_up_on_a_hung_service_after_its_timeout() -> None:
    async def main() -> None:
        release = asyncio.Event()
        entered = asyncio.Event()

        async def hang(request: httpx.Request) -> httpx.Response:
            entered.set()
            await release.wait()
            return httpx.Response(200, json={"accepted": [], "duplicates": [], "rejected": []})

        client = AsyncKvpClient(
            "http://kvp.test", transport=httpx.MockTransport(hang), timeout_seconds=HANG_GUARD
        )
        client.send(routed(0))
        await asyncio.wait_for(entered.wait(), HANG_GUARD)
        assert await client.flush(timeout=0.05) is False
        assert await client.aclose(timeout=0.05) is False
        assert client.stats.queued == 1

    asyncio.run(main())


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_close_flushes_what_is_queued(flavour: str) -> None:
    fake = FakeService()
    events = [routed(i) for i in range(10)]
    transport = httpx.MockTransport(fake)
    # A long linger and a large batch: nothing would leave on its own before close().
    options: dict[str, Any] = {"batch_size": 1000, "flush_interval_seconds": 60}
    if flavour == "sync":
        client = KvpClient("http://kvp.test", transport=transport, **options)
        for event in events:
            client.send(event)
        assert fake.attempts == []
        assert client.close(timeout=HANG_GUARD)
        stats = client.stats
    else:

        async def main() -> ClientStats:
            aclient = AsyncKvpClient("http://kvp.test", transport=transport, **options)
            for event in events:
                aclient.send(event)
            await asyncio.sleep(0)
            assert fake.attempts == []
            assert await aclient.aclose(timeout=HANG_GUARD)
            return aclient.stats

        stats = asyncio.run(main())

    assert fake.applied == [e.event_id for e in events]
    assert (stats.sent, stats.queued) == (10, 0)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_events_sent_after_close_are_dropped_and_counted(flavour: str) -> None:
    fake = FakeService()
    transport = httpx.MockTransport(fake)
    if flavour == "sync":
        client = KvpClient("http://kvp.test", transport=transport)
        client.close()
        client.send(routed(0))
        stats = client.stats
    else:

        async def main() -> ClientStats:
            aclient = AsyncKvpClient("http://kvp.test", transport=transport)
            await aclient.aclose()
            aclient.send(routed(0))
            return aclient.stats

        stats = asyncio.run(main())
    assert (stats.dropped, stats.queued) == (1, 0)
    assert fake.attempts == []


def test_helpers_build_the_events_and_send_accepts_dicts() -> None:
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url == "http://kvp.test/v1/events"
        assert request.headers["content-type"] == "application/json"
        assert request.headers["x-team"] == "routing"
        events = json.loads(request.content)["events"]
        bodies.extend(events)
        return httpx.Response(
            200,
            json={"accepted": [e["event_id"] for e in events], "duplicates": [], "rejected": []},
        )

    before = time.time()
    with KvpClient(
        "http://kvp.test/", transport=httpx.MockTransport(handler), headers={"x-team": "routing"}
    ) as client:
        routed_event = client.request_routed(
            session_id="s1", request_id="r1", instance_id="gpu-0", prompt_tokens=1200
        )
        client.request_started(session_id="s1", request_id="r1", instance_id="gpu-0", ts=5.0)
        client.request_finished(
            session_id="s1",
            request_id="r1",
            instance_id="gpu-0",
            output_tokens=30,
            event_id="fin-1",
            ts=6.0,
        )
        client.session_closed(session_id="s1", ts=7.0)
        client.send(
            {"type": "session_closed", "event_id": "as-dict", "ts": 8.0, "session_id": "s2"}
        )
        with pytest.raises(ValueError, match="event_id"):
            client.send({"type": "session_closed", "ts": 8.0, "session_id": "s2"})
        with pytest.raises(TypeError):
            client.send("not an event")  # type: ignore[arg-type]
    assert client.stats.sent == 5

    assert [b["type"] for b in bodies] == [
        "request_routed",
        "request_started",
        "request_finished",
        "session_closed",
        "session_closed",
    ]
    assert re.fullmatch(r"[0-9a-f]{32}", bodies[0]["event_id"]) and bodies[0]["ts"] >= before
    assert bodies[0]["event_id"] == routed_event.event_id and "block_hashes" not in bodies[0]
    assert bodies[2]["event_id"] == "fin-1" and bodies[4]["event_id"] == "as-dict"


def test_async_send_outside_a_loop_raises_and_queues_nothing() -> None:
    client = AsyncKvpClient("http://kvp.test", transport=httpx.MockTransport(FakeService()))
    with pytest.raises(RuntimeError, match="event loop"):
        client.send(routed(0))
    assert client.stats.queued == 0


# --- the shared decisions ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "action"),
    [
        (200, "done"),
        (422, "done"),
        (500, "retry"),
        (502, "retry"),
        (503, "retry"),
        (429, "retry"),
        (408, "retry"),
        (413, "split"),
        (400, "reject"),
        (415, "reject"),
        (404, "reject"),
    ],
)
def test_each_answer_maps_to_an_action(status: int, action: str) -> None:
    body = (
        b'{"accepted":["a"],"duplicates":["b"],"rejected":[{"index":2,"event_id":"c",'
        b'"field":"events[2].ts","message":"bad"}]}'
        if status == 422
        else b'{"detail":"x","field":"body"}'
    )
    outcome = _judge_response(status, {"retry-after": "2"}, body, batch_len=3)
    assert outcome.action == action
    if status == 422:
        assert (outcome.duplicate_ids, outcome.rejections) == (("b",), (2,))
    if action == "retry":
        assert outcome.retry_after == 2.0


def test_a_body_level_422_refuses_the_whole_batch() -> None:
    outcome = _judge_response(
        422, {}, b'{"detail":"a batch holds at least one event","field":"events"}', batch_len=1
    )
    assert outcome.action == "reject" and "at least one event" in (outcome.error or "")


def test_a_single_event_too_large_is_refused_not_split() -> None:
    assert _judge_response(413, {}, b"{}", batch_len=1).action == "reject"


def test_retry_after_is_read_as_seconds_or_a_date() -> None:
    assert _retry_after_seconds("3") == 3.0
    assert _retry_after_seconds("-1") == 0.0
    assert _retry_after_seconds(None) is None
    assert _retry_after_seconds("soon") is None
    later = format_datetime(datetime.now(UTC) + timedelta(seconds=120), usegmt=True)
    assert 100 < (_retry_after_seconds(later) or 0) <= 120


def test_backoff_grows_jitters_and_respects_cap_and_retry_after() -> None:
    rng = random.Random(7)
    delays = [_backoff_seconds(n, cap=5.0, retry_after=None, rng=rng) for n in range(1, 12)]
    assert all(0 < d <= 5.0 for d in delays)
    assert delays[0] <= 0.1 and min(delays[-3:]) >= 2.5
    assert len(set(delays[-3:])) == 3  # jittered even at the cap
    assert _backoff_seconds(1, cap=5.0, retry_after=3.0, rng=rng) >= 3.0
    assert _backoff_seconds(1, cap=5.0, retry_after=3600.0, rng=rng) == 5.0


def test_pipeline_waits_the_backoff_before_resending_the_same_batch() -> None:
    pipeline = _Pipeline(
        batch_size=2,
        flush_interval_seconds=1.0,
        max_queue_events=10,
        max_backoff_seconds=5.0,
        rng=random.Random(1),
    )
    for i in range(3):
        pipeline.push(f"e{i}", b"{}", now=0.0)
    assert pipeline.ready(0.0) == 0.0  # a full batch does not linger
    batch = pipeline.take()
    assert batch.event_ids == ["e0", "e1"]
    pipeline.settle(batch, _Outcome("retry", retry_after=3.0, error="HTTP 503"), now=10.0)
    assert (pipeline.ready(10.0) or 0) >= 3.0 and pipeline.ready(15.0) == 0.0
    assert pipeline.take() is batch
    pipeline.settle(batch, _Outcome("done"), now=15.0)
    assert pipeline.ready(15.0) == 0.0  # e2 lingered since 0.0
    target = pipeline.request_flush()
    assert not pipeline.done_through(target)
    pipeline.settle(pipeline.take(), _Outcome("done"), now=15.0)
    assert pipeline.done_through(target)
    assert pipeline.stats() == ClientStats(
        queued=0, sent=3, duplicates=0, rejected=0, dropped=0, retries=1, last_error="HTTP 503"
    )


# --- on_answer: which events the service acknowledged ----------------------------------------


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_on_answer_names_every_event_once_across_retries_lost_answers_and_rejections(
    flavour: str,
) -> None:
    def respond(events: list[dict[str, Any]]) -> httpx.Response | None:
        bad = [i for i, e in enumerate(events) if e["event_id"].startswith("bad")]
        if not bad:
            return None
        good = [e["event_id"] for i, e in enumerate(events) if i not in bad]
        accepted, duplicates = fake._apply(good)
        return httpx.Response(
            422,
            json={
                "accepted": accepted,
                "duplicates": duplicates,
                "rejected": [
                    {"index": i, "event_id": events[i]["event_id"], "field": "ts", "message": "bad"}
                    for i in bad
                ],
            },
        )

    # The first batch is applied but its answer lost (then resent: duplicates); the second fails.
    fake = FakeService([503, httpx.ConnectError("refused")], respond=respond, apply_failed=True)
    fake.applied.append("ev-000012")  # known from an earlier life of the client
    events: list[Any] = [routed(i) for i in range(30)]
    events[14:14] = [{**routed(100).model_dump(), "event_id": "bad-0"}]
    answers: list[Answer] = []

    stats = deliver(
        flavour, fake, events, batch_size=10, flush_interval_seconds=60, on_answer=answers.append
    )

    ids = [e["event_id"] if isinstance(e, dict) else e.event_id for e in events]
    assert [len(a.accepted) + len(a.duplicates) + len(a.rejected) for a in answers] == [
        10,
        10,
        10,
        1,
    ]
    told = [i for a in answers for i in (*a.accepted, *a.duplicates, *a.rejected)]
    assert sorted(told) == sorted(ids)  # each event answered for once, retries or not
    assert answers[0] == Answer((), tuple(ids[:10]), ())
    assert answers[1] == Answer(
        tuple(i for i in ids[10:20] if i not in ("ev-000012", "bad-0")), ("ev-000012",), ("bad-0",)
    )
    assert answers[2:] == [Answer(tuple(ids[20:30]), (), ()), Answer((ids[30],), (), ())]
    assert (stats.sent, stats.duplicates, stats.rejected, stats.retries) == (
        sum(len(a.accepted) for a in answers),
        11,
        1,
        2,
    )


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_on_answer_names_a_refused_batch_rejected(flavour: str) -> None:
    fake = FakeService(
        respond=lambda events: httpx.Response(400, json={"detail": "no", "field": "body"})
    )
    answers: list[Answer] = []

    deliver(flavour, fake, [routed(i) for i in range(3)], batch_size=10, on_answer=answers.append)

    assert answers == [Answer((), (), ("ev-000000", "ev-000001", "ev-000002"))]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_failing_on_answer_is_logged_and_delivery_goes_on(
    flavour: str, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[Answer] = []

    def broken(answer: Answer) -> None:
        calls.append(answer)
        raise RuntimeError("caller bug")

    fake = FakeService()
    stats = deliver(flavour, fake, [routed(i) for i in range(30)], batch_size=10, on_answer=broken)

    assert len(calls) == 3 and fake.applied == [routed(i).event_id for i in range(30)]
    assert stats.sent == 30
    assert "on_answer callback failed" in caplog.text and "caller bug" in caplog.text


def test_flush_returns_only_once_a_slow_on_answer_was_told() -> None:
    told: list[str] = []

    def slow(answer: Answer) -> None:
        time.sleep(0.2)  # the batch is settled long before this returns
        told.extend(answer.accepted)

    with KvpClient(
        "http://kvp.test",
        transport=httpx.MockTransport(FakeService()),
        batch_size=5,
        on_answer=slow,
    ) as client:
        for i in range(5):
            client.send(routed(i))
        assert client.flush(timeout=HANG_GUARD)
        assert told == [routed(i).event_id for i in range(5)]


def test_partition_places_repeats_and_rejections_as_the_service_counts_them() -> None:
    batch = _Batch(
        [
            _Item(n, event_id, b"{}", 0.0)
            for n, event_id in enumerate(["a", "b", "a", "c", "d", "c"])
        ]
    )
    # "a" is new (its repeat is the duplicate), "c" was known (both are), "b" by index, "d" by id.
    outcome = _Outcome("done", duplicate_ids=("a", "c", "c"), rejections=(1, "d", 99))
    assert _partition(batch, outcome) == Answer(("a",), ("a", "c", "c"), ("b", "d"))
    assert _partition(batch, _Outcome("done")) == Answer(("a", "b", "a", "c", "d", "c"), (), ())


def test_the_token_is_sent_as_a_bearer_header() -> None:
    seen: list[httpx.Request] = []

    def service(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        ids = [e["event_id"] for e in json.loads(request.content)["events"]]
        return httpx.Response(200, json={"accepted": ids, "duplicates": [], "rejected": []})

    with KvpClient(
        "http://kvp.test", transport=httpx.MockTransport(service), token="ingest-token-0123456789"
    ) as kvp:
        kvp.session_closed(session_id="s1")
        assert kvp.flush(5)
    assert seen[0].headers["authorization"] == "Bearer ingest-token-0123456789"


# --- signals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_signal_reaches_the_real_service(flavour: str, service_url: str) -> None:
    fields: dict[str, Any] = {"tool": "web.search", "expected_in_seconds": 4.0, "ts": 100.0}
    if flavour == "sync":
        with KvpClient(service_url) as client:
            event = client.signal("agent-1", "tool_started", **fields)
            client.signal("agent-1", "tool_finished", ts=104.0, event_id="fin")
            client.signal("agent-1", "tool_finished", ts=104.0, event_id="fin")  # a resend
            assert client.flush(timeout=HANG_GUARD)
            stats = client.stats
    else:

        async def main() -> tuple[Any, ClientStats]:
            async with AsyncKvpClient(service_url) as aclient:
                sent = aclient.signal("agent-1", "tool_started", **fields)
                aclient.signal("agent-1", "tool_finished", ts=104.0, event_id="fin")
                aclient.signal("agent-1", "tool_finished", ts=104.0, event_id="fin")
                assert await aclient.flush(timeout=HANG_GUARD)
                return sent, aclient.stats

        event, stats = asyncio.run(main())
    assert (event.type, event.kind, event.tool, event.expected_in_seconds) == (
        "session_signal",
        "tool_started",
        "web.search",
        4.0,
    )
    assert re.fullmatch(r"[0-9a-f]{32}", event.event_id)
    assert (stats.sent, stats.duplicates, stats.rejected) == (2, 1, 0)
    with httpx.Client(base_url=service_url) as http:
        view = http.get("/v1/sessions/agent-1").raise_for_status().json()
    assert view["signals_total"] == 2
    assert [(s["ts"], s["kind"], s["tool"]) for s in view["signals"]] == [
        (100.0, "tool_started", "web.search"),
        (104.0, "tool_finished", None),
    ]


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"expected_in_seconds": -1.0}, "expected_in_seconds"),
        ({"expected_in_seconds": float("inf")}, "expected_in_seconds"),
        ({"expected_in_seconds": float("nan")}, "expected_in_seconds"),
        ({"kind": "Has Spaces"}, "kind"),
        ({"expected_prompt_tokens": -3}, "expected_prompt_tokens"),
    ],
)
def test_a_bad_signal_raises_before_anything_is_queued(fields: dict[str, Any], field: str) -> None:
    from pydantic import ValidationError

    client = KvpClient("http://kvp.test", transport=httpx.MockTransport(FakeService()))
    try:
        with pytest.raises(ValidationError) as raised:
            client.signal("s1", fields.pop("kind", "typing"), **fields)
        assert [e["loc"] for e in raised.value.errors()] == [(field,)]
        assert client.stats.queued == 0
    finally:
        client.close()
