"""Ingestion: dedupe, log, apply, checkpoint; recovery replays exactly what the store lacks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from app.core.clock import SystemClock
from app.core.errors import EventLogError
from app.ingest.eventlog import EventLog, iter_log
from app.ingest.ingestor import Ingestor
from app.state import MemoryStore
from kvprefetch_client.events import event_adapter

# The service clock and skew, as the service has them (events here are stamped in the past).
CLOCKED = {"clock": SystemClock(), "max_clock_skew_seconds": 300.0}


def routed(i: int, session: str = "s"):  # type: ignore[no-untyped-def]
    return event_adapter.validate_python(
        {
            "type": "request_routed",
            "event_id": f"e{i}",
            "ts": float(i),
            "session_id": session,
            "request_id": f"r{i}",
            "instance_id": "gpu-0",
            "prompt_tokens": 100,
        }
    )


def make(tmp_path: Path) -> Ingestor:
    return Ingestor(
        MemoryStore(bytes_per_token=1, block_tokens=512),
        EventLog(tmp_path, fsync=False),
        replica_id="r1",
        **CLOCKED,
    )


def test_ingest_splits_accepted_and_duplicates(tmp_path: Path) -> None:
    ing = make(tmp_path)
    first = ing.ingest([routed(1), routed(2), routed(1)])
    assert (first.accepted, first.duplicates) == (["e1", "e2"], ["e1"])
    second = ing.ingest([routed(2), routed(3)])
    assert (second.accepted, second.duplicates) == (["e3"], ["e2"])
    assert [e.event_id for _, e in iter_log(tmp_path)] == ["e1", "e2", "e3"]
    assert ing.store.checkpoint("r1") == ing.event_log.position


def test_recover_rebuilds_a_fresh_store_from_the_log(tmp_path: Path) -> None:
    ing = make(tmp_path)
    ing.ingest([routed(i) for i in range(10)])
    ing.event_log.close()
    again = make(tmp_path)
    assert again.recover() == 10
    assert again.store.session("s").turns == 10
    # Replayed ids are remembered: a client's retry is a duplicate.
    assert again.ingest([routed(3)]).duplicates == ["e3"]


def test_recover_replays_only_past_the_checkpoint(tmp_path: Path) -> None:
    store = MemoryStore(bytes_per_token=1, block_tokens=512)
    log = EventLog(tmp_path, fsync=False)
    ing = Ingestor(store, log, replica_id="r1", **CLOCKED)
    ing.ingest([routed(i) for i in range(5)])
    # The process dies after logging a batch but before applying it.
    log.append(b"".join(event_adapter.dump_json(routed(i)) + b"\n" for i in range(5, 8)))
    log.close()
    again = Ingestor(store, EventLog(tmp_path, fsync=False), replica_id="r1", **CLOCKED)
    assert again.recover() == 3
    assert store.session("s").turns == 8
    assert again.recover() == 0


class FailingOnce(MemoryStore):
    """A store whose next apply fails, as Redis does when it blips."""

    fail_next = False

    def apply(self, events):  # type: ignore[no-untyped-def]
        if self.fail_next:
            self.fail_next = False
            from app.core.errors import StoreUnavailable

            raise StoreUnavailable("blip")
        return super().apply(events)


def test_a_failed_apply_is_caught_up_from_the_log_and_not_logged_twice(tmp_path: Path) -> None:
    import pytest

    from app.core.errors import StoreUnavailable

    store = FailingOnce(bytes_per_token=1, block_tokens=512)
    ing = Ingestor(store, EventLog(tmp_path, fsync=False), replica_id="r1", **CLOCKED)
    ing.ingest([routed(1)])
    store.fail_next = True
    with pytest.raises(StoreUnavailable):
        ing.ingest([routed(2), routed(3)])
    # The client was not acknowledged and retries the same batch.
    retry = ing.ingest([routed(2), routed(3)])
    assert retry.duplicates == ["e2", "e3"]
    assert [e.event_id for _, e in iter_log(tmp_path)] == ["e1", "e2", "e3"]
    assert store.session("s").turns == 3


def test_a_batch_of_new_events_is_logged_as_posted_and_read_back_canonical(tmp_path: Path) -> None:
    import orjson

    ing = make(tmp_path)
    body = (
        b'{"events": [\n  {"type": "session_closed", "event_id": "a", "ts": 1, "session_id": "s"}'
        b"\n]}"
    )
    events = [event_adapter.validate_python(e) for e in orjson.loads(body)["events"]]
    ing.ingest(events, body)
    lines = (tmp_path / "events-00000001.jsonl").read_bytes().splitlines()
    assert lines == [body.replace(b"\n", b" ")]
    assert [e for _, e in iter_log(tmp_path)] == events
    # A batch holding a duplicate is logged event by event, so no event is in the log twice.
    again = [events[0], routed(7)]
    ing.ingest(again, b'{"events": "whatever"}')
    assert [e.event_id for _, e in iter_log(tmp_path)] == ["a", "e7"]


def test_the_observer_sees_accepted_events_only_and_never_the_replayed_log(tmp_path: Path) -> None:
    seen: list[list[str]] = []
    ing = Ingestor(
        MemoryStore(bytes_per_token=1, block_tokens=512),
        EventLog(tmp_path, fsync=False),
        replica_id="r1",
        observer=lambda events: seen.append([e.event_id for e in events]),
        **CLOCKED,
    )
    ing.ingest([routed(1), routed(2), routed(1)])
    ing.ingest([routed(2), routed(3)])
    ing.ingest([routed(3)])  # all duplicates: not called at all
    assert seen == [["e1", "e2"], ["e3"]]
    ing.event_log.close()
    seen.clear()
    again = Ingestor(
        MemoryStore(bytes_per_token=1, block_tokens=512),
        EventLog(tmp_path, fsync=False),
        replica_id="r1",
        observer=lambda events: seen.append([e.event_id for e in events]),
        **CLOCKED,
    )
    assert again.recover() == 3
    assert seen == []


def test_a_failing_observer_does_not_fail_the_ingest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(events):  # type: ignore[no-untyped-def]
        raise RuntimeError("observer bug")

    ing = Ingestor(
        MemoryStore(bytes_per_token=1, block_tokens=512),
        EventLog(tmp_path, fsync=False),
        replica_id="r1",
        observer=broken,
        **CLOCKED,
    )
    assert ing.ingest([routed(1)]).accepted == ["e1"]
    assert ing.store.session("s").turns == 1
    assert "the ingest observer failed on 1 events" in caplog.text


def test_signals_are_logged_replayed_and_deduplicated(tmp_path: Path) -> None:
    sig = event_adapter.validate_python(
        {
            "type": "session_signal",
            "event_id": "g1",
            "ts": 3.5,
            "session_id": "s",
            "kind": "tool_started",
            "tool": "grep",
            "expected_in_seconds": 1.5,
        }
    )
    ing = make(tmp_path)
    assert ing.ingest([routed(1), sig, sig]).duplicates == ["g1"]
    assert ing.ingest([sig]).duplicates == ["g1"]
    assert [e for _, e in iter_log(tmp_path)][1] == sig
    ing.event_log.close()
    again = make(tmp_path)
    assert again.recover() == 2
    v = again.store.session("s")
    assert (v.signals_total, v.signals[0].tool, v.signals[0].expected_in_seconds) == (
        1,
        "grep",
        1.5,
    )
    assert again.ingest([sig]).duplicates == ["g1"]
    assert again.store.session("s").signals_total == 1


# -- the log written by another thread (ingest_writing_with, as the service does it) ---------------


def test_a_batch_written_by_another_thread_is_applied_after_its_write(tmp_path: Path) -> None:
    ing = make(tmp_path)
    store_at_write: list[int] = []

    async def write(data: bytes):  # type: ignore[no-untyped-def]
        # The checks ran, nothing is applied yet: what the log gets is what the store will get.
        store_at_write.append(ing.store.stats()["remembered_event_ids"])
        return await asyncio.to_thread(ing.event_log.append, data)

    result = asyncio.run(ing.ingest_writing_with([routed(1), routed(2), routed(1)], None, write))
    assert (result.accepted, result.duplicates) == (["e1", "e2"], ["e1"])
    assert store_at_write == [0]
    assert [e.event_id for _, e in iter_log(tmp_path)] == ["e1", "e2"]
    assert ing.store.checkpoint("r1") == ing.event_log.position
    # A batch of duplicates only writes nothing.
    again = asyncio.run(ing.ingest_writing_with([routed(2)], None, write))
    assert (again.accepted, again.duplicates, len(store_at_write)) == ([], ["e2"], 1)


def test_a_failed_write_applies_nothing_and_the_retry_is_taken(tmp_path: Path) -> None:
    ing = make(tmp_path)

    async def failing(data: bytes):  # type: ignore[no-untyped-def]
        raise EventLogError("the disk is full")

    with pytest.raises(EventLogError):
        asyncio.run(ing.ingest_writing_with([routed(1)], None, failing))
    assert ing.store.stats()["remembered_event_ids"] == 0
    assert ing.ingest([routed(1)]).accepted == ["e1"]


def test_no_ingest_may_start_while_a_batch_waits_on_its_write(tmp_path: Path) -> None:
    ing = make(tmp_path)

    async def main() -> list[str]:
        release = asyncio.Event()

        async def write(data: bytes):  # type: ignore[no-untyped-def]
            await release.wait()
            return ing.event_log.append(data)

        first = asyncio.create_task(ing.ingest_writing_with([routed(1)], None, write))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="waits on its log write"):
            ing.ingest([routed(2)])
        release.set()
        return (await first).accepted

    assert asyncio.run(main()) == ["e1"]
    assert ing.ingest([routed(2)]).accepted == ["e2"]
