"""Event time against the service clock (docs/decisions.md, 15), on both stores: an event from
the future is refused and cannot move the windows; a session event older than the retention is
refused rather than silently ignored; a restart's replay keeps to the same rules."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.core.clock import ManualClock
from app.ingest.eventlog import FileEventLog, encode_events
from app.ingest.ingestor import CLOCK_SKEW, PAST_RETENTION, Ingestor
from app.state import MemoryStore, StateStore
from kvprefetch_client.events import Event, event_adapter

NOW = 1_796_000_000.0  # the service clock: late 2026
SKEW = 300.0
RETENTION = 3600.0  # the service's defaults
YEAR_3000 = 32_503_680_000.0
HOUR = 3600.0

_ids = itertools.count()


def ev(type_: str, ts: float, **fields: Any) -> Event:
    fields.setdefault("event_id", f"t{next(_ids)}")
    return event_adapter.validate_python({"type": type_, "ts": ts, **fields})


def routed(session: str, ts: float, **kw: Any) -> Event:
    return ev(
        "request_routed",
        ts,
        session_id=session,
        request_id=f"r-{session}-{ts}",
        instance_id="gpu-0",
        prompt_tokens=100,
        **kw,
    )


def status(instance: str, ts: float, free: int) -> Event:
    return ev("instance_status", ts, instance_id=instance, free_kv_bytes=free)


@pytest.fixture
def new_store(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Builds stores with the service's windows: MemoryStore, or RedisStore on one clean prefix (a
    second one built is the same Redis state, as after a restart)."""
    built: list[StateStore] = []
    kind = request.param

    def build() -> StateStore:
        windows: dict[str, Any] = {
            "reorder_window_seconds": 60.0,
            "session_retention_seconds": RETENTION,
        }
        if kind == "memory":
            s: StateStore = MemoryStore(bytes_per_token=1, block_tokens=16, **windows)
        else:
            from app.state.redis import RedisStore

            s = RedisStore.from_url(
                request.getfixturevalue("redis_url"),
                prefix=request.getfixturevalue("clean_redis"),
                bytes_per_token=1,
                block_tokens=16,
                **windows,
            )
        built.append(s)
        return s

    yield build
    for s in built:
        s.close()


BOTH = pytest.mark.parametrize("new_store", ["memory", "redis"], indirect=True)


def ingestor(
    store: StateStore,
    log_dir: Path,
    clock: ManualClock,
    refused: list[tuple[str, int]] | None = None,
) -> Ingestor:
    return Ingestor(
        store,
        FileEventLog(log_dir, fsync=False),
        replica_id="r1",
        clock=clock,
        max_clock_skew_seconds=SKEW,
        refused=(lambda reason, n: refused.append((reason, n))) if refused is not None else None,
    )


@BOTH
def test_events_from_the_future_are_refused_and_sessions_stay_readable(
    new_store: Any, tmp_path: Path
) -> None:
    clock = ManualClock(NOW)
    refused: list[tuple[str, int]] = []
    ing = ingestor(new_store(), tmp_path, clock, refused)
    assert ing.ingest([routed("before", NOW - 10), status("gpu-1", NOW - 10, free=100)]).accepted
    # What an agent-scope token may post, stamped in the year 3000 and an hour ahead, beside a
    # valid event; and a status of an unrelated instance an hour ahead.
    batch = [
        ev("order_progress", YEAR_3000, order_id="o1", status="accepted"),
        routed("same-batch", NOW - 5),
        ev("kv_blocks_cleared", NOW + HOUR, instance_id="gpu-0"),
        status("gpu-9", NOW + HOUR, free=1),
    ]
    result = ing.ingest(batch)
    assert result.accepted == [batch[1].event_id]
    assert [(r.index, r.event_id, r.reason) for r in result.rejected] == [
        (0, batch[0].event_id, CLOCK_SKEW),
        (2, batch[2].event_id, CLOCK_SKEW),
        (3, batch[3].event_id, CLOCK_SKEW),
    ]
    assert "ahead of the service clock" in result.rejected[0].message
    assert refused == [(CLOCK_SKEW, 3)]
    # Nothing moved the windows: every session is there, and one posted afterwards reads back.
    assert ing.ingest([routed("after", NOW)]).accepted
    for session in ("before", "same-batch", "after"):
        assert ing.store.session(session) is not None, session
    # No status from the future pins an instance: a later one still lands.
    assert ing.ingest([status("gpu-9", NOW + 1, free=7)]).accepted
    assert {i.instance_id: i.free_kv_bytes for i in ing.store.instances()}["gpu-9"] == 7
    assert ing.store.order("o1") is None
    # Within the skew is accepted, and the skew follows the clock.
    assert ing.ingest([routed("soon", NOW + SKEW)]).accepted
    clock.advance(HOUR)
    assert ing.ingest([routed("later", NOW + HOUR + 10)]).accepted


@BOTH
def test_a_restart_replays_the_same_state(new_store: Any, tmp_path: Path) -> None:
    clock = ManualClock(NOW)
    ing = ingestor(new_store(), tmp_path, clock)
    ing.ingest([routed("a", NOW - 1), status("gpu-9", YEAR_3000, free=1)])
    ing.ingest([routed("b", NOW)])
    ing.event_log.close()
    # A memory store is rebuilt from the whole log; Redis keeps its state and replays the tail.
    again = ingestor(new_store(), tmp_path, clock)
    again.recover()
    assert again.store.session("a") is not None and again.store.session("b") is not None
    assert again.newest_ahead_of_clock() is None


@BOTH
def test_a_log_written_before_the_check_is_replayed_without_its_events_from_the_future(
    new_store: Any, tmp_path: Path
) -> None:
    # What an older version logged and applied: a session, then one status from the year 3000.
    old_log = FileEventLog(tmp_path, fsync=False)
    old_log.append(
        encode_events(
            [
                routed("a", NOW - 60),
                status("gpu-9", YEAR_3000, free=1),
                ev("kv_blocks_cleared", NOW + HOUR, instance_id="gpu-0"),
                routed("b", NOW - 30),
            ]
        )
    )
    old_log.close()
    clock = ManualClock(NOW)
    refused: list[tuple[str, int]] = []
    ing = ingestor(new_store(), tmp_path, clock, refused)
    assert ing.recover() == 2
    assert refused == [(CLOCK_SKEW, 2)]
    assert ing.store.session("a") is not None and ing.store.session("b") is not None
    assert "gpu-9" not in {i.instance_id for i in ing.store.instances()}
    assert ing.ingest([routed("c", NOW)]).accepted and ing.store.session("c") is not None
    # The log keeps them (training and audit read it); a replay once their time has come takes
    # the one an hour ahead.
    ing.event_log.close()
    clock.advance(HOUR)
    later = ingestor(
        MemoryStore(bytes_per_token=1, block_tokens=16, session_retention_seconds=RETENTION),
        tmp_path,
        clock,
    )
    assert later.recover() == 4


@BOTH
def test_a_session_event_older_than_the_retention_is_refused_not_ignored(
    new_store: Any, tmp_path: Path
) -> None:
    clock = ManualClock(NOW)
    refused: list[tuple[str, int]] = []
    ing = ingestor(new_store(), tmp_path, clock, refused)
    first = routed("live", NOW)
    assert ing.ingest([first]).accepted
    stale = [
        routed("gone", NOW - RETENTION - 1),
        ev("session_closed", NOW - RETENTION - 5, session_id="live"),
        ev("session_signal", NOW - RETENTION - 2, session_id="gone", kind="opened"),
        # Not session events: block residency and instances are not bounded by the retention.
        status("gpu-1", NOW - RETENTION - 1, free=5),
        routed("kept", NOW - RETENTION + 1),
    ]
    result = ing.ingest(stale)
    assert result.accepted == [stale[3].event_id, stale[4].event_id]
    assert [(r.index, r.reason) for r in result.rejected] == [
        (0, PAST_RETENTION),
        (1, PAST_RETENTION),
        (2, PAST_RETENTION),
    ]
    assert "older than the session retention" in result.rejected[0].message
    assert refused == [(PAST_RETENTION, 3)]
    assert ing.store.session("gone") is None and ing.store.session("live").state == "queued"
    # Nothing refused is logged, so a replay agrees.
    assert stale[0].event_id not in (tmp_path / "events-00000001.jsonl").read_text()
    # A retry of an accepted event stays a duplicate, even once older than the retention.
    clock.advance(2 * RETENTION)
    assert ing.ingest([routed("new", NOW + 2 * RETENTION)]).accepted
    again = ing.ingest([first])
    assert (again.duplicates, again.rejected) == ([first.event_id], [])


@BOTH
def test_the_cutoff_moves_inside_a_batch_as_the_store_applies_it(
    new_store: Any, tmp_path: Path
) -> None:
    ing = ingestor(new_store(), tmp_path, ManualClock(NOW))
    # The first event moves the cutoff to NOW - RETENTION; the second is older than that.
    batch = [routed("new", NOW), routed("old", NOW - RETENTION - 1), routed("older-first", NOW - 2)]
    result = ing.ingest(batch)
    assert [r.index for r in result.rejected] == [1]
    assert result.accepted == [batch[0].event_id, batch[2].event_id]
    # In the other order, the old one comes before the cutoff moves: the store takes it (and then
    # forgets its session), as it always did.
    ing2 = ingestor(new_store(), tmp_path / "2", ManualClock(NOW))
    ing2.store.clear()
    assert not ing2.ingest([routed("old2", NOW - RETENTION - 1), routed("new2", NOW)]).rejected


def test_a_shared_store_already_ahead_of_the_clock_is_reported(tmp_path: Path) -> None:
    store = MemoryStore(bytes_per_token=1, block_tokens=16, session_retention_seconds=RETENTION)
    store.apply([status("gpu-9", YEAR_3000, free=1)])  # taken before the check existed
    ing = ingestor(store, tmp_path, ManualClock(NOW))
    assert ing.newest_ahead_of_clock() == YEAR_3000
