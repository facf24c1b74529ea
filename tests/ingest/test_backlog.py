from __future__ import annotations

import asyncio
from collections.abc import Sequence

from app.ingest.backlog import CHUNK_EVENTS, Backlog
from kvprefetch_client.events import Event, event_adapter


def closed(i: int) -> Event:
    return event_adapter.validate_python(
        {"type": "session_closed", "event_id": f"e{i}", "ts": float(i), "session_id": f"s{i}"}
    )


class Recorder:
    def __init__(self, fail_first: bool = False) -> None:
        self.calls: list[list[str]] = []
        self.fail_first = fail_first

    def __call__(self, events: Sequence[Event]) -> None:
        self.calls.append([e.event_id for e in events])
        if self.fail_first and len(self.calls) == 1:
            raise RuntimeError("boom")


def test_room_is_counted_in_events_and_an_empty_backlog_takes_any_batch() -> None:
    backlog = Backlog(Recorder(), max_events=3)
    assert backlog.has_room(5)  # empty: the batch limit bounds it
    backlog.put([closed(0), closed(1)])
    assert backlog.events == 2
    assert backlog.has_room(1) and not backlog.has_room(2)
    backlog.drain()
    assert backlog.events == 0 and backlog.has_room(3)


def test_events_still_coming_count_against_the_room() -> None:
    backlog = Backlog(Recorder(), max_events=3)
    # Two events accepted and being logged: room for one more, not for two.
    assert backlog.has_room(1, coming=2) and not backlog.has_room(2, coming=2)


def test_drain_hands_every_event_once_in_order() -> None:
    recorder = Recorder()
    backlog = Backlog(recorder, max_events=100)
    backlog.put([closed(0), closed(1)])
    backlog.put([closed(2)])
    assert backlog.drain() == 3
    assert recorder.calls == [["e0", "e1", "e2"]]
    assert backlog.drain() == 0 and recorder.calls == [["e0", "e1", "e2"]]


def test_a_bounded_drain_stops_after_a_chunk() -> None:
    recorder = Recorder()
    backlog = Backlog(recorder, max_events=10 * CHUNK_EVENTS)
    for i in range(3):
        backlog.put([closed(i * CHUNK_EVENTS + j) for j in range(CHUNK_EVENTS)])
    assert backlog.drain(CHUNK_EVENTS) == CHUNK_EVENTS
    assert backlog.events == 2 * CHUNK_EVENTS
    assert backlog.drain() == 2 * CHUNK_EVENTS
    assert [c[0] for c in recorder.calls] == ["e0", f"e{CHUNK_EVENTS}", f"e{2 * CHUNK_EVENTS}"]


def test_a_failing_observer_does_not_lose_what_follows() -> None:
    recorder = Recorder(fail_first=True)
    backlog = Backlog(recorder, max_events=10 * CHUNK_EVENTS)
    backlog.put([closed(j) for j in range(CHUNK_EVENTS)])
    backlog.put([closed(CHUNK_EVENTS)])
    assert backlog.drain() == CHUNK_EVENTS + 1
    assert recorder.calls[1] == [f"e{CHUNK_EVENTS}"]
    assert backlog.events == 0


def test_the_loop_drains_what_is_put() -> None:
    recorder = Recorder()

    async def scenario() -> None:
        backlog = Backlog(recorder, max_events=100)
        task = asyncio.create_task(backlog.run())
        backlog.put([closed(0)])
        for _ in range(10):
            await asyncio.sleep(0)
        backlog.put([closed(1)])
        for _ in range(10):
            await asyncio.sleep(0)
        task.cancel()
        assert backlog.events == 0

    asyncio.run(scenario())
    assert recorder.calls == [["e0"], ["e1"]]
