"""What each model advised for each idle session, scored when the session's next request comes.

The scoring loop (app.engine.scoring) records the planner's advice per model ("live", "shadow");
the ingestor tells the ledger about every accepted event, and a `request_routed` is the outcome:

- a *hit* when the latest advice made at or before the arrival's `ts` said keep or prefetch (the
  context would have been there because of the model);
- a *miss* when it said demote or lru (the model left it to chance, or pushed it out);
- *unscored* when no advice was made for the session before the arrival.

An arrival consumes the session's advice: the next turn is judged only on advice made after the
session went idle again. docs/decisions.md (8, "A model's hit rate") has why.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from app.engine.events import Event
from app.engine.planner import Retention, SessionAdvice

SLOTS = ("live", "shadow")
# Advice records kept per session and model: enough to find the advice in force when a
# `request_routed` arrives a few scoring ticks late.
ADVICE_HISTORY = 4
# Sessions tracked per model; past this, those least recently advised or arrived are forgotten
# (their next arrival counts as unscored). About 200 bytes each.
MAX_SESSIONS = 200_000


@dataclass(frozen=True, slots=True)
class AdviceRecord:
    made_ts: float
    retention: Retention
    prefetch: bool
    p_keep: float

    @property
    def kept(self) -> bool:
        """The advice would have the context ready: kept resident or prefetched."""
        return self.retention == "keep" or self.prefetch


@dataclass(frozen=True, slots=True)
class LedgerStats:
    # Advice records made (each session is advised again at every pass of the scoring loop).
    predictions: int
    # Of those, how many said keep or prefetch: what the hits cost, in advice that holds bytes.
    keep_predictions: int
    hits: int
    misses: int
    unscored: int

    @property
    def hit_rate(self) -> float | None:
        scored = self.hits + self.misses
        return self.hits / scored if scored else None


class _Entry:
    __slots__ = ("last_request_id", "history")

    def __init__(self) -> None:
        self.last_request_id: str | None = None
        self.history: list[AdviceRecord] = []  # oldest first


class _Slot:
    __slots__ = ("sessions", "predictions", "keep_predictions", "hits", "misses", "unscored")

    def __init__(self) -> None:
        self.sessions: dict[str, _Entry] = {}
        self.predictions = self.keep_predictions = self.hits = self.misses = self.unscored = 0


class AdviceLedger:
    """Counts per model slot; a slot exists from start() to stop(), so with no shadow set the
    ingest path pays for one model only."""

    def __init__(self, *, max_sessions: int = MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self._slots: dict[str, _Slot] = {"live": _Slot()}

    def record(self, slot: str, advice: Iterable[SessionAdvice], made_ts: float) -> None:
        """The advice a model gave at `made_ts` (the scoring loop's clock); the slot must be started."""
        s = self._slots[slot]
        for a in advice:
            rec = AdviceRecord(made_ts, a.retention, a.prefetch, a.p_keep)
            entry = s.sessions.pop(a.session_id, None) or _Entry()  # re-inserted last: dict order is recency
            history = entry.history
            history.append(rec)
            if len(history) > ADVICE_HISTORY:
                del history[0]
            s.sessions[a.session_id] = entry
            s.predictions += 1
            s.keep_predictions += rec.kept
        self._trim(s)

    def observe(self, events: Sequence[Event]) -> None:
        """Accepted events, as the ingestor applied them (duplicates never come here).

        On the ingest path: an arrival of a session no model advised costs a dict lookup.
        """
        slots = list(self._slots.values())
        for e in events:
            kind = e.type
            if kind == "request_routed":
                for s in slots:
                    entry = s.sessions.get(e.session_id)
                    if entry is None:
                        # Not tracked, so a re-route of this request would count twice; rare,
                        # and cheaper than tracking every session the ledger never advised.
                        s.unscored += 1
                    elif entry.last_request_id != e.request_id:
                        self._arrival(s, entry, e.request_id, e.ts)
                    # else: the same request routed again (a retry elsewhere): one outcome
            elif kind == "session_closed":
                for s in slots:
                    s.sessions.pop(e.session_id, None)

    @staticmethod
    def _arrival(s: _Slot, entry: _Entry, request_id: str, ts: float) -> None:
        entry.last_request_id = request_id
        history = entry.history
        in_force = next((r for r in reversed(history) if r.made_ts <= ts), None)
        # Every record is consumed, those made after `ts` too: they were made before this arrival
        # was known, on a session that looked idle but was not.
        history.clear()
        if in_force is None:
            s.unscored += 1
        elif in_force.kept:
            s.hits += 1
        else:
            s.misses += 1

    def latest(self, slot: str, session_id: str) -> AdviceRecord | None:
        """The newest advice not yet consumed by an arrival."""
        s = self._slots.get(slot)
        entry = s.sessions.get(session_id) if s is not None else None
        return entry.history[-1] if entry is not None and entry.history else None

    def stats(self, slot: str) -> LedgerStats:
        """A slot's counts since its start(); all zero for a slot not started."""
        s = self._slots.get(slot) or _Slot()
        return LedgerStats(s.predictions, s.keep_predictions, s.hits, s.misses, s.unscored)

    def start(self, slot: str) -> None:
        """A new model sits in `slot`: forget what the slot held and count afresh."""
        if slot not in SLOTS:
            raise ValueError(f"unknown model slot {slot!r}; slots are {SLOTS}")
        self._slots[slot] = _Slot()

    def stop(self, slot: str) -> None:
        """No model sits in `slot` any more: forget it, and stop counting its arrivals."""
        self._slots.pop(slot, None)

    def _trim(self, s: _Slot) -> None:
        overflow = len(s.sessions) - self.max_sessions
        if overflow > 0:
            for session_id in [k for k, _ in zip(s.sessions, range(overflow))]:
                del s.sessions[session_id]
