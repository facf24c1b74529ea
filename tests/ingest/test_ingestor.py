"""Ingestion: dedupe, log, apply, checkpoint; recovery replays exactly what the store lacks."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.core.clock import SystemClock
from app.ingest.eventlog import FileEventLog, iter_log
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
        FileEventLog(tmp_path, fsync=False),
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
    log = FileEventLog(tmp_path, fsync=False)
    ing = Ingestor(store, log, replica_id="r1", **CLOCKED)
    ing.ingest([routed(i) for i in range(5)])
    # The process dies after logging a batch but before applying it.
    log.append(b"".join(event_adapter.dump_json(routed(i)) + b"\n" for i in range(5, 8)))
    log.close()
    again = Ingestor(store, FileEventLog(tmp_path, fsync=False), replica_id="r1", **CLOCKED)
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
    ing = Ingestor(store, FileEventLog(tmp_path, fsync=False), replica_id="r1", **CLOCKED)
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
        FileEventLog(tmp_path, fsync=False),
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
        FileEventLog(tmp_path, fsync=False),
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
        FileEventLog(tmp_path, fsync=False),
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


# -- prepare, log, commit: the service's path, with the log written on a thread of its own ------


def test_a_prepared_batch_is_applied_only_when_committed(tmp_path: Path) -> None:
    ing = make(tmp_path)
    prepared = ing.prepare([routed(1), routed(2), routed(1)])
    assert [e.event_id for e in prepared.fresh] == ["e1", "e2"]
    assert prepared.result.duplicates == ["e1"]  # the repeat in the batch
    assert ing.store.stats()["remembered_event_ids"] == 0  # checked, not applied
    result = ing.commit(prepared, ing.event_log.append(prepared.data))
    assert (result.accepted, result.duplicates) == (["e1", "e2"], ["e1"])
    assert [e.event_id for _, e in iter_log(tmp_path)] == ["e1", "e2"]
    assert ing.store.checkpoint("r1") == ing.event_log.position
    # A batch of duplicates only has nothing to log.
    again = ing.prepare([routed(2)])
    assert (again.fresh, again.data, again.result.duplicates) == ([], b"", ["e2"])


def test_batches_settle_in_the_order_prepared(tmp_path: Path) -> None:
    ing = make(tmp_path)
    first, second = ing.prepare([routed(1)]), ing.prepare([routed(2)])
    first_at = ing.event_log.append(first.data)
    with pytest.raises(RuntimeError, match="out of turn"):
        ing.commit(second, first_at)
    with pytest.raises(RuntimeError, match="being logged"):
        ing.ingest([routed(3)])  # the blocking path waits for nothing: it is refused
    assert ing.commit(first, first_at).accepted == ["e1"]


def test_an_abandoned_batch_applies_nothing_and_its_retry_is_taken(tmp_path: Path) -> None:
    ing = make(tmp_path)
    failed, after = ing.prepare([routed(1)]), ing.prepare([routed(2)])
    ing.abandon(failed)  # its append failed: the log has none of it
    assert ing.commit(after, ing.event_log.append(after.data)).accepted == ["e2"]
    assert ing.store.stats()["remembered_event_ids"] == 1
    assert ing.ingest([routed(1)]).accepted == ["e1"]


def test_an_event_in_two_batches_in_flight_is_logged_twice_and_applied_once(
    tmp_path: Path,
) -> None:
    ing = make(tmp_path)
    first, second = ing.prepare([routed(1)]), ing.prepare([routed(1), routed(2)])
    one = ing.commit(first, ing.event_log.append(first.data))
    two = ing.commit(second, ing.event_log.append(second.data))
    assert (one.accepted, two.accepted, two.duplicates) == (["e1"], ["e2"], ["e1"])
    assert [e.event_id for _, e in iter_log(tmp_path)] == ["e1", "e1", "e2"]
    again = make(tmp_path / "copy")
    again.event_log = ing.event_log
    assert again.recover() == 2  # recovery applies it once


def test_the_retention_cutoff_counts_the_batches_in_flight(tmp_path: Path) -> None:
    store = MemoryStore(bytes_per_token=1, block_tokens=512, session_retention_seconds=100.0)
    ing = Ingestor(store, FileEventLog(tmp_path, fsync=False), replica_id="r1", **CLOCKED)
    ing.prepare([routed(1000)])  # in flight: once applied, the store forgets what is idle 100 s
    late = ing.prepare([routed(800)])
    assert late.fresh == [] and [r.reason for r in late.result.rejected] == ["past_retention"]


def test_an_abandoned_batch_leaves_the_cutoff_where_the_store_has_it(tmp_path: Path) -> None:
    store = MemoryStore(bytes_per_token=1, block_tokens=512, session_retention_seconds=100.0)
    ing = Ingestor(store, FileEventLog(tmp_path, fsync=False), replica_id="r1", **CLOCKED)
    ing.abandon(ing.prepare([routed(1000)]))  # never logged: the store's cutoff did not move
    assert ing.ingest([routed(800)]).accepted == ["e800"]


def test_a_batch_committed_after_a_failed_apply_catches_both_up_and_asks_for_a_retry(
    tmp_path: Path,
) -> None:
    from app.core.errors import StoreError, StoreUnavailable

    store = FailingOnce(bytes_per_token=1, block_tokens=512)
    ing = Ingestor(store, FileEventLog(tmp_path, fsync=False), replica_id="r1", **CLOCKED)
    first, second = ing.prepare([routed(1)]), ing.prepare([routed(2)])
    first_at = ing.event_log.append(first.data)
    second_at = ing.event_log.append(second.data)
    store.fail_next = True
    with pytest.raises(StoreUnavailable):
        ing.commit(first, first_at)
    # The log holds both; the replay applies both, but cannot say which of the second were new.
    with pytest.raises(StoreError, match="retry"):
        ing.commit(second, second_at)
    assert store.session("s").turns == 2
    assert ing.ingest([routed(1), routed(2)]).duplicates == ["e1", "e2"]
