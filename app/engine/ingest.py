"""Ingestion: deduplicate, log durably, apply to state. The one path every accepted event takes.

Order matters for the promise "nothing acknowledged is ever lost, nothing applied twice":
1. drop events whose id was already applied (and repeats inside the batch);
2. append the rest to the event log and make them durable;
3. apply them to the store, which dedupes again atomically (another replica may have raced us);
4. record how far into the log the store has applied (the checkpoint);
5. only then does the caller acknowledge.
A crash after 2 replays the log tail from the checkpoint on restart; a crash before 2 leaves the
client unacknowledged, and its retry carries the same event ids.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from app.engine.eventlog import EventLog, encode_batch, encode_events, iter_log
from app.engine.events import Event
from app.engine.state.base import StateStore

log = logging.getLogger(__name__)

_RECOVERY_CHUNK = 5_000


@dataclass(slots=True)
class IngestResult:
    accepted: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)


# Told of the events a call to ingest() accepted, in the order they were applied.
Observer = Callable[[Sequence[Event]], None]


class Ingestor:
    def __init__(self, store: StateStore, event_log: EventLog, *, replica_id: str,
                 observer: Observer | None = None) -> None:
        self.store = store
        self.event_log = event_log
        self.replica_id = replica_id
        # Sees newly accepted events only: never a duplicate, and not the log replayed at startup,
        # whose events happened before anything now observing them existed.
        self.observer = observer
        self._lock = threading.Lock()
        # Set when events reached the log but the store failed to apply them: the log tail
        # is replayed before anything new is taken, so a retry is not logged twice.
        self._behind_log = False

    def ingest(self, events: Sequence[Event], body: bytes | None = None) -> IngestResult:
        """`body`, when given, is the posted batch these events were parsed from, whole."""
        result = IngestResult()
        with self._lock:
            if self._behind_log:
                self._replay_tail()
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
            seen = self.store.seen(ids)
            if any(seen):
                fresh = [e for e, was_seen in zip(unique, seen) if not was_seen]
                result.duplicates.extend(e.event_id for e, was_seen in zip(unique, seen) if was_seen)
            else:
                fresh = unique
            if fresh:
                whole = body is not None and len(fresh) == len(events)
                position = self.event_log.append(encode_batch(body) if whole else encode_events(fresh))  # type: ignore[arg-type]
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
                    if accepted:
                        self._notify(accepted)
        return result

    def _notify(self, accepted: Sequence[Event]) -> None:
        # The events are durable and applied by now: an observer's failure must not turn their
        # acknowledgement into an error (the client's retry would only find duplicates).
        try:
            self.observer(accepted)  # type: ignore[misc]
        except Exception:
            log.exception("the ingest observer failed on %d events", len(accepted))

    def recover(self) -> int:
        """Apply the log past the store's checkpoint; returns how many events were replayed."""
        with self._lock:
            replayed = self._replay_tail()
        if replayed:
            log.info("replayed %d events from the event log in %s", replayed, self.event_log.directory)
        return replayed

    def _replay_tail(self) -> int:
        self._behind_log = True
        start = self.store.checkpoint(self.replica_id)
        replayed = 0
        chunk: list[Event] = []
        position = start
        for position, event in iter_log(Path(self.event_log.directory), start):
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
        return replayed
