"""The advice ledger: each model's latest advice per session, scored when the next request comes."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any

from app.core.clock import SystemClock
from app.decide.advisor import SessionAdvice
from app.ingest.eventlog import FileEventLog
from app.ingest.ingestor import Ingestor
from app.observe.ledger import ADVICE_HISTORY, AdviceLedger, AdviceRecord, LedgerStats
from app.state import MemoryStore
from kvprefetch_client.events import Event, event_adapter

# The service clock and skew, as the service has them (events here are stamped in the past).
CLOCKED = {"clock": SystemClock(), "max_clock_skew_seconds": 300.0}

_ids = itertools.count()


def advice(
    session_id: str, retention: str = "keep", prefetch: bool = False, p_keep: float = 0.5
) -> SessionAdvice:
    keep_seconds = 300.0 if retention == "keep" else 0.0
    return SessionAdvice(
        session_id,
        "gpu-0",
        (1, 2),
        retention,
        keep_seconds,  # type: ignore[arg-type]
        p_keep,
        0.1,
        0.9,
        prefetch,
    )


def routed(session_id: str, ts: float, request_id: str | None = None, **kw: Any) -> Event:
    n = next(_ids)
    return event_adapter.validate_python(
        {
            "type": "request_routed",
            "event_id": kw.pop("event_id", f"e{n}"),
            "ts": ts,
            "session_id": session_id,
            "request_id": request_id or f"r{n}",
            "instance_id": "gpu-0",
            "prompt_tokens": 100,
            **kw,
        }
    )


def closed(session_id: str, ts: float) -> Event:
    return event_adapter.validate_python(
        {"type": "session_closed", "event_id": f"e{next(_ids)}", "ts": ts, "session_id": session_id}
    )


def test_keep_then_a_request_is_a_hit_and_prefetch_counts_as_keep() -> None:
    ledger = AdviceLedger()
    ledger.record("live", [advice("a", "keep"), advice("b", "lru", prefetch=True)], 10.0)
    assert ledger.latest("live", "a") == AdviceRecord(10.0, "keep", False, 0.5)
    ledger.observe([routed("a", 20.0), routed("b", 20.0)])
    assert ledger.stats("live") == LedgerStats(
        predictions=2, keep_predictions=2, hits=2, misses=0, unscored=0, prefetch_predictions=1
    )
    assert ledger.stats("live").hit_rate == 1.0


def test_demote_or_lru_then_a_request_is_a_miss() -> None:
    ledger = AdviceLedger()
    ledger.record("live", [advice("a", "demote"), advice("b", "lru"), advice("c", "keep")], 10.0)
    ledger.observe([routed("a", 11.0), routed("b", 12.0), routed("c", 13.0)])
    s = ledger.stats("live")
    assert (s.hits, s.misses, s.unscored, s.predictions, s.keep_predictions) == (1, 2, 0, 3, 1)
    assert s.hit_rate == 1 / 3


def test_a_session_never_advised_is_unscored() -> None:
    ledger = AdviceLedger()
    assert ledger.stats("live").hit_rate is None
    ledger.observe([routed("new", 5.0)])
    assert ledger.stats("live") == LedgerStats(
        predictions=0, keep_predictions=0, hits=0, misses=0, unscored=1
    )
    assert ledger.stats("live").hit_rate is None


def test_advice_made_after_the_arrival_does_not_count() -> None:
    ledger = AdviceLedger()
    # Made at 30 on a session that looked idle, but the request (ts 20) was only posted late.
    ledger.record("live", [advice("a", "keep")], 30.0)
    ledger.observe([routed("a", 20.0)])
    assert (ledger.stats("live").hits, ledger.stats("live").unscored) == (0, 1)
    # With an older advice in force at 20, that one is judged, not the newer one.
    ledger.record("live", [advice("b", "demote")], 10.0)
    ledger.record("live", [advice("b", "keep")], 30.0)
    ledger.observe([routed("b", 20.0)])
    assert (ledger.stats("live").hits, ledger.stats("live").misses) == (0, 1)


def test_advice_at_the_arrival_time_counts() -> None:
    ledger = AdviceLedger()
    ledger.record("live", [advice("a", "keep")], 20.0)
    ledger.observe([routed("a", 20.0)])
    assert ledger.stats("live").hits == 1


def test_an_arrival_consumes_the_advice_the_next_turn_needs_new_advice() -> None:
    ledger = AdviceLedger()
    ledger.record("live", [advice("a", "keep")], 10.0)
    ledger.observe([routed("a", 20.0)])
    ledger.observe([routed("a", 60.0)])
    assert ledger.latest("live", "a") is None
    assert (ledger.stats("live").hits, ledger.stats("live").unscored) == (1, 1)
    ledger.record("live", [advice("a", "demote")], 70.0)
    ledger.observe([routed("a", 80.0)])
    assert ledger.stats("live").misses == 1


def test_the_same_request_routed_again_is_one_outcome() -> None:
    ledger = AdviceLedger()
    ledger.record("live", [advice("a", "keep")], 10.0)
    ledger.observe([routed("a", 20.0, request_id="r1"), routed("a", 21.0, request_id="r1")])
    s = ledger.stats("live")
    assert (s.hits, s.misses, s.unscored) == (1, 0, 0)
    ledger.observe([routed("a", 40.0, request_id="r2")])  # the next turn is an outcome of its own
    assert ledger.stats("live").unscored == 1


def test_shadow_is_scored_apart_from_live() -> None:
    ledger = AdviceLedger()
    ledger.start("shadow")
    ledger.record("live", [advice("a", "keep")], 10.0)
    ledger.record("shadow", [advice("a", "demote"), advice("b", "keep")], 10.0)
    ledger.observe([routed("a", 20.0), routed("b", 20.0)])
    assert ledger.stats("live") == LedgerStats(
        predictions=1, keep_predictions=1, hits=1, misses=0, unscored=1
    )
    assert ledger.stats("shadow") == LedgerStats(
        predictions=2, keep_predictions=1, hits=1, misses=1, unscored=0
    )
    ledger.start("shadow")  # a new shadow: counted afresh
    assert ledger.stats("shadow") == LedgerStats(0, 0, 0, 0, 0)
    assert ledger.stats("live").hits == 1
    ledger.stop("shadow")  # no shadow: its arrivals are not counted at all
    ledger.observe([routed("a", 30.0)])
    assert ledger.stats("shadow") == LedgerStats(0, 0, 0, 0, 0)
    assert ledger.stats("live").unscored == 2


def test_duplicates_reach_the_ledger_once(tmp_path: Path) -> None:
    ledger = AdviceLedger()
    seen: list[list[str]] = []

    def observer(events: Any) -> None:
        seen.append([e.event_id for e in events])
        ledger.observe(events)

    ing = Ingestor(
        MemoryStore(bytes_per_token=1, block_tokens=512),
        FileEventLog(tmp_path, fsync=False),
        replica_id="r1",
        observer=observer,
        **CLOCKED,
    )
    ledger.record("live", [advice("a", "keep")], 10.0)
    first = routed("a", 20.0, event_id="arrive")
    ing.ingest([first, first])
    ing.ingest([first])
    assert seen == [["arrive"]]
    assert ledger.stats("live") == LedgerStats(
        predictions=1, keep_predictions=1, hits=1, misses=0, unscored=0
    )


def test_a_closed_session_forgets_its_advice() -> None:
    ledger = AdviceLedger()
    ledger.record("live", [advice("a", "keep")], 10.0)
    ledger.observe([closed("a", 15.0)])
    assert ledger.latest("live", "a") is None
    ledger.observe([routed("a", 20.0)])
    assert ledger.stats("live").unscored == 1


def test_history_and_sessions_are_bounded() -> None:
    ledger = AdviceLedger(max_sessions=2)
    for t in range(ADVICE_HISTORY + 1):
        # Advice that changes at every tick: each record is a run of its own.
        ledger.record("live", [advice("a", "demote" if t % 2 == 0 else "keep")], float(t))
    # The first record (t=0) is gone: an arrival at 0.5 finds nothing in force.
    ledger.observe([routed("a", 0.5)])
    assert ledger.stats("live").unscored == 1
    ledger.record("live", [advice("b"), advice("c"), advice("d")], 10.0)
    assert [ledger.latest("live", s) is not None for s in "bcd"] == [False, True, True]


def test_a_long_run_of_the_same_advice_keeps_its_start() -> None:
    """A request stamped many ticks before it reaches the ledger (a replay at 60x: a tenth of a
    second late is six ticks of the service's) is scored by the advice in force at its stamp."""
    ledger = AdviceLedger()
    ledger.record("live", [advice("a", "demote")], 0.0)
    for t in range(1, 10 * ADVICE_HISTORY):
        ledger.record("live", [advice("a", "keep", p_keep=t / 100)], float(t))
    # The latest record is this tick's (what the shadow pairs with), the run's start still there.
    assert ledger.latest("live", "a") == AdviceRecord(float(t), "keep", False, t / 100)
    ledger.observe([routed("a", 1.5)])
    assert (ledger.stats("live").hits, ledger.stats("live").unscored) == (1, 0)
    ledger.record("live", [advice("b", "demote")], 0.0)
    ledger.record("live", [advice("b", "keep")], 1.0)
    for t in range(2, 10 * ADVICE_HISTORY):
        ledger.record("live", [advice("b", "keep")], float(t))
    ledger.observe([routed("b", 0.5)])  # before the keep run began: the demote was in force
    assert ledger.stats("live").misses == 1


def _finished(session_id: str, ts: float) -> Event:
    return event_adapter.validate_python(
        {
            "type": "request_finished",
            "event_id": f"e{next(_ids)}",
            "ts": ts,
            "session_id": session_id,
            "request_id": "r",
            "instance_id": "gpu-0",
            "output_tokens": 1,
        }
    )


def _status(ts: float) -> Event:
    return event_adapter.validate_python(
        {
            "type": "instance_status",
            "event_id": f"e{next(_ids)}",
            "ts": ts,
            "instance_id": "gpu-9",
            "free_kv_bytes": 1,
        }
    )


def test_a_session_the_store_forgot_is_forgotten_here_by_event_time() -> None:
    ledger = AdviceLedger(retention_seconds=100.0)
    ledger.observe([_finished("a", 10.0)])
    ledger.record("live", [advice("a")], 11.0)
    ledger.record("live", [advice(f"s{i}") for i in range(1000)], 11.0)
    ledger.observe([_finished("a", 50.0)])  # a is active at 50
    ledger.observe([_status(150.0)])  # cutoff 50: a stays, every s* (advised at 11) goes
    assert ledger.latest("live", "a") is not None and ledger.tracked("live") == 1
    ledger.observe([_status(151.0)])  # cutoff 51: a is forgotten, as in the store
    assert ledger.latest("live", "a") is None
    ledger.observe([routed("a", 152.0)])
    assert ledger.stats("live") == LedgerStats(
        1001, 1001, 0, 0, 1
    )  # unscored: its advice went with it


def test_a_queued_request_s_advice_is_not_a_prediction() -> None:
    ledger = AdviceLedger()
    ledger.record("live", [replace(advice("q", "lru", prefetch=True), queued=True)], 10.0)
    assert ledger.latest("live", "q") is None
    ledger.observe([routed("q", 20.0)])
    assert ledger.stats("live") == LedgerStats(
        predictions=0, keep_predictions=0, hits=0, misses=0, unscored=1
    )


def test_columns_record_what_the_same_advice_records() -> None:
    made = [
        [advice("a", "keep"), advice("b", "demote", p_keep=0.05), advice("c", "lru", True)],
        [advice("a", "lru", p_keep=0.1), advice("c", "keep"), advice("d", "demote")],
    ]
    by_advice, by_columns = AdviceLedger(), AdviceLedger()
    for ledger in (by_advice, by_columns):
        ledger.start("shadow")
    for tick, batch in enumerate(made):
        ts = 10.0 * (tick + 1)
        for slot in ("live", "shadow"):
            by_advice.record(slot, batch, ts)
            by_columns.record_columns(
                slot,
                [a.session_id for a in batch],
                [a.retention for a in batch],
                [a.prefetch for a in batch],
                [a.p_keep for a in batch],
                ts,
            )
    arrivals = [routed("a", 25.0), routed("b", 26.0), routed("c", 27.0), closed("d", 28.0)]
    for ledger in (by_advice, by_columns):
        ledger.observe(arrivals)
    for slot in ("live", "shadow"):
        assert by_columns.stats(slot) == by_advice.stats(slot)
        assert by_columns.stats(slot).predictions == 6
        for s in "abcd":
            assert by_columns.latest(slot, s) == by_advice.latest(slot, s)
    assert by_columns.judge.pending == by_advice.judge.pending > 0
