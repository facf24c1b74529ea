"""Ingestion: deduplicate, log durably, apply to state. The one path every accepted event takes.

Order matters for the promise "nothing acknowledged is ever lost, nothing applied twice":
1. reject events stamped more than the allowed clock skew ahead of the service clock; drop
   events whose id was already applied (and repeats inside the batch); reject session events
   the store would ignore, being older than its session retention (docs/decisions.md, 15);
2. append the rest to the event log and make them durable;
3. apply them to the store, which dedupes again atomically (another replica may have raced us);
4. record how far into the log the store has applied (the checkpoint);
5. only then does the caller acknowledge.
A crash after 2 replays the log tail from the checkpoint on restart; a crash before 2 leaves the
client unacknowledged, and its retry carries the same event ids.

The service writes step 2 on a thread of its own (`prepare`, then `commit`): an fsync can take
tens of milliseconds, and on the event loop it held every request for as long (decisions.md, 26).
A batch prepared while another is being written does not see the other's events as applied: the
engine holds a batch back until the batches in flight that share an event id with it have settled,
so a client's retry overlapping its first try is answered as duplicates, not logged twice (the
store, recovery and training dedupe by id all the same).
"""

from __future__ import annotations

import logging
import math
import operator
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from app.core.clock import Clock
from app.core.errors import StoreError
from app.ingest.base import EventLog
from app.ingest.eventlog import encode_batch, encode_events, iter_log
from app.state.base import LogPosition, StateStore
from kvprefetch_client.events import RECORD_EVENT_TYPES, Event, VllmKvEvents

log = logging.getLogger(__name__)

_RECOVERY_CHUNK = 5_000
_TS = operator.attrgetter("ts")
# The events a store ignores once they are older than its session retention.
# What the stores forget past the retention (sessions and order records): an event of these older
# than the cutoff would be ignored, so it is rejected instead.
RETAINED_EVENT_TYPES = frozenset(
    {
        "request_routed",
        "request_started",
        "request_finished",
        "session_closed",
        "session_signal",
        "order_progress",
    }
)
# The events that start an instance the store does not hold (a signal's instance is a hint only).
INSTANCE_EVENT_TYPES = frozenset(
    {
        "request_routed",
        "request_started",
        "request_finished",
        "kv_blocks_stored",
        "kv_blocks_removed",
        "kv_blocks_cleared",
        "vllm_kv_events",
        "instance_status",
    }
)
# Why an event was refused (the label of kvprefetch_events_refused_total): for its time, or for
# naming one instance more than the store holds (KVP_MAX_INSTANCES).
CLOCK_SKEW, PAST_RETENTION, INSTANCE_CAP = "clock_skew", "past_retention", "instance_cap"
REFUSAL_REASONS = (CLOCK_SKEW, PAST_RETENTION, INSTANCE_CAP)


@dataclass(frozen=True, slots=True)
class TimeRejection:
    """An event refused for its `field` (`ts`, or `instance_id` past the cap); `index` is its
    place in the sequence given to ingest()."""

    index: int
    event_id: str
    reason: str
    message: str
    field: str = "ts"


@dataclass(slots=True)
class IngestResult:
    accepted: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    rejected: list[TimeRejection] = field(default_factory=list)


@dataclass(slots=True)
class Prepared:
    """A batch checked (`result` so far) and encoded (`data`), its `fresh` events to be logged
    and applied; `sequence` is its turn (0: nothing to log)."""

    result: IngestResult
    fresh: list[Event]
    data: bytes
    sequence: int


# Told of the events a call to ingest() accepted, in the order they were applied.
Observer = Callable[[Sequence[Event]], None]
# Told how many events were refused for their time, and why (CLOCK_SKEW, PAST_RETENTION).
RefusedHook = Callable[[str, int], None]


class Ingestor:
    def __init__(
        self,
        store: StateStore,
        event_log: EventLog,
        *,
        replica_id: str,
        clock: Clock,
        max_clock_skew_seconds: float,
        observer: Observer | None = None,
        refused: RefusedHook | None = None,
    ) -> None:
        if not max_clock_skew_seconds > 0:
            raise ValueError("max_clock_skew_seconds must be positive")
        self.store = store
        self.event_log = event_log
        self._encodes = event_log.keeps_events
        self.replica_id = replica_id
        # The store's windows count from the newest event ts applied: an event is taken only
        # when it is at most this far ahead of the clock, so the windows never run ahead of it.
        self.clock = clock
        self.max_clock_skew_seconds = max_clock_skew_seconds
        self.refused = refused
        # Sees newly accepted events only: never a duplicate, and not the log replayed at startup,
        # whose events happened before anything now observing them existed.
        self.observer = observer
        self._lock = threading.RLock()
        # Set when events reached the log but the store failed to apply them: the log tail
        # is replayed before anything new is taken, so a retry is not logged twice.
        self._behind_log = False
        # Batches prepared and settled (committed or abandoned), counted: they settle in turn.
        self._prepared = self._settled = 0
        # The newest ts of the batches in flight: the store's once they are applied.
        self._newest_prepared = -math.inf
        # The instances the batches in flight start: the store holds them once they are applied.
        self._instances_prepared: set[str] = set()

    def ingest(self, events: Sequence[Event], body: bytes | None = None) -> IngestResult:
        """`body`, when given, is the posted batch these events were parsed from, whole."""
        with self._lock:  # the three steps as one, to a thread calling them
            if self._prepared != self._settled:
                raise RuntimeError("ingest() called while a prepared batch is being logged")
            prepared = self.prepare(events, body)
            if not prepared.fresh:
                return prepared.result
            try:
                position = self.event_log.append(prepared.data)
            except BaseException:
                self.abandon(prepared)
                raise
            return self.commit(prepared, position)

    def prepare(self, events: Sequence[Event], body: bytes | None = None) -> Prepared:
        """Steps 1 and the encoding of 2: the batch checked, and the bytes that log its fresh
        events. When there are some, the caller appends `data` to the event log and then calls
        `commit` (or `abandon` when the append failed), batch by batch in the order prepared:
        the service appends on a thread of its own (Engine.ingest_async), so that the event loop
        serves other requests while the disk syncs, and prepares the next batch meanwhile."""
        with self._lock:
            result, fresh, data = self._admit(events, body)
            if not fresh:
                self._finish(result)
                return Prepared(result, fresh, data, 0)
            self._prepared += 1
            traffic = [e.ts for e in fresh if e.type not in RECORD_EVENT_TYPES]
            if traffic:
                self._newest_prepared = max(self._newest_prepared, max(traffic))
            return Prepared(result, fresh, data, self._prepared)

    def commit(self, prepared: Prepared, position: LogPosition) -> IngestResult:
        """Steps 3 to 5 for a prepared batch whose bytes the log holds up to `position`."""
        with self._lock:
            self._next_in_turn(prepared)
            if self._behind_log:
                # An earlier batch reached the log but not the store; the replay applies it and
                # this one, but cannot say which of this one's events were new: the client's
                # retry finds them applied.
                self._replay_tail()
                raise StoreError("an earlier batch was caught up from the event log; retry")
            self._apply(prepared.fresh, position, prepared.result)
            self._finish(prepared.result)
            return prepared.result

    def abandon(self, prepared: Prepared) -> None:
        """A prepared batch the log did not take (its append failed): nothing of it is kept."""
        with self._lock:
            self._next_in_turn(prepared)

    def _next_in_turn(self, prepared: Prepared) -> None:
        if prepared.sequence != self._settled + 1:
            raise RuntimeError(
                f"batch {prepared.sequence} settled out of turn (batch {self._settled + 1} is next)"
            )
        self._settled = prepared.sequence
        if self._settled == self._prepared:  # nothing in flight: the store's newest says it all
            self._newest_prepared = -math.inf
            self._instances_prepared = set()

    def _admit(
        self, events: Sequence[Event], body: bytes | None
    ) -> tuple[IngestResult, list[Event], bytes]:
        """The events to log and apply (refused ones and duplicates in the result), and the bytes
        that log them."""
        result = IngestResult()
        latest_ts = self.clock.now() + self.max_clock_skew_seconds
        if self._behind_log and self._prepared == self._settled:
            self._replay_tail()
        given = events
        # One pass over the events' ts, reused below: passes over a batch add up on this path.
        stamps = list(map(_TS, events))
        if stamps and max(stamps) > latest_ts:
            events = self._reject_from_the_future(events, latest_ts, result)
            stamps = list(map(_TS, events))
        ids = [e.event_id for e in events]
        if len(set(ids)) == len(ids):
            unique = list(events)
        else:
            unique, in_batch = [], set()
            for e in events:
                if e.event_id in in_batch:
                    result.duplicates.append(e.event_id)
                else:
                    in_batch.add(e.event_id)
                    unique.append(e)
            ids = [e.event_id for e in unique]
        seen, newest = self.store.seen_and_newest(ids)
        newest = max(newest, self._newest_prepared)
        if any(seen):
            fresh = [e for e, was_seen in zip(unique, seen) if not was_seen]
            result.duplicates.extend(e.event_id for e, was_seen in zip(unique, seen) if was_seen)
        else:
            fresh = unique
        retention = self.store.session_retention_seconds
        if fresh and retention < math.inf:
            if len(fresh) != len(events):
                stamps = list(map(_TS, fresh))
            # No event is older than the cutoff the newest of them all would make: none is
            # refused (the common case, checked without a walk in order).
            if min(stamps) < max(newest, max(stamps)) - retention:
                fresh = self._reject_past_retention(fresh, newest, retention, given, result)
        cap = self.store.max_instances
        if fresh and cap is not None:
            fresh = self._reject_past_the_cap(fresh, cap, newest, given, result)
        if not fresh or not self._encodes:  # a log that keeps nothing (a replay's): no bytes
            return result, fresh, b""
        # A batch is logged as posted only when that is exactly what was validated: every event
        # of it taken, none in vLLM's encoding (arrays, fields we drop).
        if body is not None and len(fresh) == len(given) and VllmKvEvents not in map(type, fresh):
            return result, fresh, encode_batch(body)
        return result, fresh, encode_events(fresh)

    def _apply(self, fresh: list[Event], position: LogPosition, result: IngestResult) -> None:
        """Apply what is in the log up to `position` (the events `fresh`) and tell the observer."""
        try:
            applied = self.store.apply(fresh)
            self.store.set_checkpoint(self.replica_id, position)
        except Exception:
            self._behind_log = True
            raise
        for e, ok in zip(fresh, applied):
            if ok:
                result.accepted.append(e.event_id)
            else:
                result.duplicates.append(e.event_id)
        if self.observer is not None:
            accepted = fresh if all(applied) else [e for e, ok in zip(fresh, applied) if ok]
            if accepted and accepted[0].type in RECORD_EVENT_TYPES:
                # The service's own records come alone (Engine._ingest_record); the observers
                # follow traffic, whose windows a record's ts must not move.
                accepted = [e for e in accepted if e.type not in RECORD_EVENT_TYPES]
            if accepted:
                self._notify(accepted)

    def _finish(self, result: IngestResult) -> None:
        if result.rejected and self.refused is not None:
            self._count_refused(result.rejected)

    def _reject_from_the_future(
        self, events: Sequence[Event], latest_ts: float, result: IngestResult
    ) -> list[Event]:
        kept = []
        for i, e in enumerate(events):
            if e.ts > latest_ts:
                ahead = e.ts - (latest_ts - self.max_clock_skew_seconds)
                result.rejected.append(
                    TimeRejection(
                        i,
                        e.event_id,
                        CLOCK_SKEW,
                        f"ts {e.ts!r} is {ahead:.0f} s ahead of the service clock; at most "
                        f"{self.max_clock_skew_seconds:g} s is accepted "
                        "(KVP_MAX_CLOCK_SKEW_SECONDS)",
                    )
                )
            else:
                kept.append(e)
        return kept

    def _reject_past_retention(
        self,
        fresh: list[Event],
        newest: float,
        retention: float,
        given: Sequence[Event],
        result: IngestResult,
    ) -> list[Event]:
        """The store's cutoff moves as it applies the batch in order: walk it the same way."""
        kept, refused = [], []
        for e in fresh:
            if e.type in RETAINED_EVENT_TYPES and e.ts < newest - retention:
                refused.append((e, newest))
                continue
            kept.append(e)
            newest = max(newest, e.ts)
        index = _positions(given, result)
        for e, newest_then in refused:
            result.rejected.append(
                TimeRejection(
                    index[e.event_id],
                    e.event_id,
                    PAST_RETENTION,
                    f"ts {e.ts!r} is older than the session retention: the store has taken "
                    f"events up to ts {newest_then!r} and forgets sessions and order records "
                    f"idle for {retention:g} s (KVP_SESSION_RETENTION_SECONDS), so this event "
                    "would be ignored",
                )
            )
        result.rejected.sort(key=lambda r: r.index)
        return kept

    def _reject_past_the_cap(
        self,
        fresh: list[Event],
        cap: int,
        newest: float,
        given: Sequence[Event],
        result: IngestResult,
    ) -> list[Event]:
        """Events naming an instance the store does not hold, once it holds `cap` (with those
        this batch, and the batches in flight, start first): the store would ignore them. The
        batch's own events move the instances' cutoff as the store applies them; where the room
        runs out, the store is asked again at the cutoff the batch has reached by then."""
        named = [
            e.instance_id if e.type in INSTANCE_EVENT_TYPES else None  # type: ignore[union-attr]
            for e in fresh
        ]
        pending = self._instances_prepared
        asked = list({i for i in named if i is not None and i not in pending})
        if not asked:
            return fresh
        known, held = self.store.known_instances(asked)
        live = {i for i, k in zip(asked, known) if k}
        room = cap - held - len(pending)
        if sum(1 for i in asked if i not in live) <= room:  # room for all: the common case
            pending.update(i for i in asked if i not in live)
            return fresh
        live |= pending
        kept, refused = [], []
        reached = asked_at = newest
        for e, instance_id in zip(fresh, named):
            if instance_id is not None and instance_id not in live:
                if room <= 0 and max(reached, e.ts) > asked_at:
                    asked_at = max(reached, e.ts)
                    known, held = self.store.known_instances(asked, asked_at)
                    live = {i for i, k in zip(asked, known) if k} | pending
                    room = cap - held - len(pending)
                if instance_id not in live:
                    if room <= 0:
                        refused.append(e)
                        continue
                    live.add(instance_id)
                    pending.add(instance_id)
                    room -= 1
            kept.append(e)
            reached = max(reached, e.ts)
        index = _positions(given, result)
        for e in refused:
            result.rejected.append(
                TimeRejection(
                    index[e.event_id],
                    e.event_id,
                    INSTANCE_CAP,
                    f"instance {e.instance_id!r} would be one more than the {cap} instances the "  # type: ignore[union-attr]
                    "store holds (KVP_MAX_INSTANCES); an instance is forgotten once nothing has "
                    "named it for KVP_INSTANCE_RETENTION_SECONDS",
                    "instance_id",
                )
            )
        result.rejected.sort(key=lambda r: r.index)
        return kept

    def _count_refused(self, rejected: Sequence[TimeRejection]) -> None:
        for reason in REFUSAL_REASONS:
            n = sum(1 for r in rejected if r.reason == reason)
            if n:
                self.refused(reason, n)  # type: ignore[misc]

    def _notify(self, accepted: Sequence[Event]) -> None:
        # The events are durable and applied by now: an observer's failure must not turn their
        # acknowledgement into an error (the client's retry would only find duplicates).
        try:
            self.observer(accepted)  # type: ignore[misc]
        except Exception:
            log.exception("the ingest observer failed on %d events", len(accepted))

    def recover(self) -> int:
        """Apply the log past the store's checkpoint; returns how many events were replayed (0 for
        a log that keeps nothing)."""
        if self.event_log.directory is None:
            return 0
        with self._lock:
            replayed = self._replay_tail()
        if replayed:
            log.info(
                "replayed %d events from the event log in %s", replayed, self.event_log.directory
            )
        return replayed

    def _log_directory(self) -> Path:
        directory = self.event_log.directory
        assert directory is not None  # recover() returns first for a log that keeps nothing
        return directory

    def _replay_tail(self) -> int:
        self._behind_log = True
        start = self.store.checkpoint(self.replica_id)
        latest_ts = self.clock.now() + self.max_clock_skew_seconds
        replayed = skipped = 0
        chunk: list[Event] = []
        position = start
        for position, event in iter_log(self._log_directory(), start):
            if event.ts > latest_ts:
                # Logged before the skew was checked (docs/decisions.md, 15): applying it would
                # move the windows past the clock. It stays in the log, for training and audit.
                skipped += 1
                continue
            chunk.append(event)
            if len(chunk) >= _RECOVERY_CHUNK:
                replayed += sum(self.store.apply(chunk))
                chunk.clear()
                self.store.set_checkpoint(self.replica_id, position)
        if chunk:
            replayed += sum(self.store.apply(chunk))
        if position is not None:
            self.store.set_checkpoint(self.replica_id, position)
        self._behind_log = False
        if skipped:
            log.warning(
                "skipped %d events of the event log in %s stamped more than %g s ahead of "
                "the clock (KVP_MAX_CLOCK_SKEW_SECONDS)",
                skipped,
                self.event_log.directory,
                self.max_clock_skew_seconds,
            )
            if self.refused is not None:
                self.refused(CLOCK_SKEW, skipped)
        return replayed

    def newest_ahead_of_clock(self) -> float | None:
        """The newest event ts the store holds when it is past the allowed skew (a shared store
        that took events from the future before they were checked), else None."""
        _, newest = self.store.seen_and_newest([])
        return newest if newest > self.clock.now() + self.max_clock_skew_seconds else None


def _positions(given: Sequence[Event], result: IngestResult) -> dict[str, int]:
    """Where each event id is in the batch, for its refusal (rare: a scan is fine); an id's
    copies that were rejected already or came later are not it."""
    taken = {r.index for r in result.rejected}
    index: dict[str, int] = {}
    for i, e in enumerate(given):
        if i not in taken and e.event_id not in index:
            index[e.event_id] = i
    return index
