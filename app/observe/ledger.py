"""What each model advised for each idle session, scored when the session's next request comes.

The scoring loop (app.decide.score_loop) records the planner's advice per model ("live", "shadow");
the ingestor tells the ledger about every accepted event, and a `request_routed` is the outcome:

- a *hit* when the latest advice made at or before the arrival's `ts` said keep or prefetch (the
  context would have been there because of the model);
- a *miss* when it said demote or lru (the model left it to chance, or pushed it out);
- *unscored* when no advice was made for the session before the arrival.

An arrival consumes the session's advice: the next turn is judged only on advice made after the
session went idle again. docs/decisions.md (8, "A model's hit rate") has why.

A session is forgotten when the store forgets it: by event time, once the newest event seen is
more than `retention_seconds` past the session's last activity (its newest event seen here, or,
for one advised before any, the newest event, or the scoring clock, when it was first advised:
only live sessions are advised); its next arrival is then unscored, like the store's fresh
start of it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple, cast

from app.decide.advisor import Retention, SessionAdvice
from app.observe.judge import PairedJudge
from kvprefetch_client.events import (
    Event,
    RequestFinished,
    RequestRouted,
    RequestStarted,
    SessionClosed,
)

SLOTS = ("live", "shadow")
# Advice records kept per session and model: enough to find the advice in force when a
# `request_routed` arrives a few scoring ticks late.
ADVICE_HISTORY = 4
# Sessions tracked per model; past this, those least recently advised or arrived are forgotten
# (their next arrival counts as unscored). About 200 bytes each.
MAX_SESSIONS = 200_000


class AdviceRecord(NamedTuple):
    # A tuple, not a dataclass: one is made per session per pass (100,000 a second), and a
    # tuple is made in half the time.
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
    __slots__ = ("history", "last_request_id", "last_ts")

    def __init__(self, last_ts: float) -> None:
        self.last_request_id: str | None = None
        self.history: list[AdviceRecord] = []  # oldest first
        self.last_ts = last_ts  # the session's last activity, in event time


class _Slot:
    __slots__ = ("hits", "keep_predictions", "misses", "predictions", "sessions", "unscored")

    def __init__(self) -> None:
        # Recency order (the least recently advised or arrived first): an OrderedDict, as taking
        # from the front of a dict scans every slot freed there (docs/decisions.md, 25).
        self.sessions: OrderedDict[str, _Entry] = OrderedDict()
        self.predictions = self.keep_predictions = self.hits = self.misses = self.unscored = 0


class AdviceLedger:
    """Counts per model slot; a slot exists from start() to stop(), so with no shadow set the
    ingest path pays for one model only. `judge`, while a shadow is set, pairs both models'
    p_keep per session and tick and scores them (app/observe/judge.py); it starts afresh
    whenever either slot does."""

    def __init__(
        self,
        *,
        max_sessions: int = MAX_SESSIONS,
        retention_seconds: float = math.inf,
        judge_horizon_seconds: float = 300.0,
    ) -> None:
        if retention_seconds <= 0:
            raise ValueError("retention_seconds must be positive")
        self.judge = PairedJudge(judge_horizon_seconds)
        self.max_sessions = max_sessions
        self.retention_seconds = retention_seconds
        self._slots: dict[str, _Slot] = {"live": _Slot()}
        self._newest = -math.inf  # the newest event ts observed
        self._cutoff = -math.inf

    def record(self, slot: str, advice: Iterable[SessionAdvice], made_ts: float) -> None:
        """The advice a model gave at `made_ts` (the scoring loop's clock); the slot must be
        started."""
        # A queued request's advice predicts nothing: left out.
        scored = [a for a in advice if not a.queued]
        self.record_columns(
            slot,
            [a.session_id for a in scored],
            [a.retention for a in scored],
            [a.prefetch for a in scored],
            [a.p_keep for a in scored],
            made_ts,
        )

    def record_columns(
        self,
        slot: str,
        session_ids: Sequence[str],
        retention: Sequence[Retention],
        prefetch: Sequence[bool],
        p_keep: Sequence[float],
        made_ts: float,
    ) -> None:
        """`record` for advice given as columns (no queued ones): what the scoring loop's pass
        over every live session hands over, without an object per session."""
        s = self._slots[slot]
        if slot == "shadow":
            self._pair(session_ids, p_keep, made_ts)
        sessions, cutoff = s.sessions, self._cutoff
        fresh_ts = max(self._newest, made_ts)
        pop = sessions.pop
        # The records in bulk: AdviceRecord's own __new__ is a Python call per record.
        records = map(
            tuple.__new__, repeat(AdviceRecord), zip(repeat(made_ts), retention, prefetch, p_keep)
        )
        for session_id, rec in zip(session_ids, records):
            entry = pop(session_id, None)  # re-inserted last: dict order is recency
            if entry is None or entry.last_ts < cutoff:
                # Live in the store now (only live sessions are advised): active until at least
                # the newest event, or the scoring clock before any event was seen.
                entry = _Entry(fresh_ts)
            history = entry.history
            history.append(rec)
            if len(history) > ADVICE_HISTORY:
                del history[0]
            sessions[session_id] = entry
        keeps = sum(1 for r, pf in zip(retention, prefetch) if pf or r == "keep")
        s.predictions += len(session_ids)
        s.keep_predictions += keeps
        self._trim(s)

    def observe(self, events: Sequence[Event]) -> None:
        """Accepted events, as the ingestor applied them (duplicates never come here).

        On the ingest path: an arrival of a session no model advised costs a dict lookup.
        """
        slots = list(self._slots.values())
        judge = self.judge if "shadow" in self._slots else None
        for e in events:
            kind = e.type
            ts = e.ts
            if ts > self._newest:
                self._newest = ts
                if judge is not None:
                    judge.advance(ts)
                if ts - self.retention_seconds > self._cutoff:
                    self._cutoff = ts - self.retention_seconds
                    for s in slots:
                        self._prune(s)
            if kind == "request_routed":
                if ts < self._cutoff:
                    continue  # the store ignores it too
                routed = cast(RequestRouted, e)  # the kind says so; isinstance costs more
                entry_id = routed.session_id
                if judge is not None:
                    judge.arrived(entry_id, ts)
                for s in slots:
                    entry = s.sessions.get(entry_id)
                    if entry is not None and entry.last_ts < self._cutoff:
                        del s.sessions[entry_id]  # forgotten, as the store has
                        entry = None
                    if entry is None:
                        # Not tracked, so a re-route of this request would count twice; rare,
                        # and cheaper than tracking every session the ledger never advised.
                        s.unscored += 1
                    else:
                        if ts > entry.last_ts:
                            entry.last_ts = ts
                            s.sessions.move_to_end(entry_id)
                        if entry.last_request_id != routed.request_id:
                            self._arrival(s, entry, routed.request_id, ts)
                        # else: the same request routed again (a retry elsewhere): one outcome
            elif kind == "session_closed":
                closed = cast(SessionClosed, e).session_id
                if judge is not None:
                    judge.closed(closed)
                for s in slots:
                    s.sessions.pop(closed, None)
            elif kind == "request_started" or kind == "request_finished":
                sid = cast(RequestStarted | RequestFinished, e).session_id
                for s in slots:
                    entry = s.sessions.get(sid)
                    if entry is not None and ts > entry.last_ts:
                        entry.last_ts = ts
                        # Last in the dict, so forgotten sessions reach its front.
                        s.sessions.move_to_end(sid)

    def _pair(self, session_ids: Sequence[str], p_keep: Sequence[float], made_ts: float) -> None:
        """The shadow's advice beside the serving model's of the same tick, for the judge."""
        live = self._slots["live"].sessions
        judge = self.judge
        for session_id, p in zip(session_ids, p_keep):
            entry = live.get(session_id)
            if entry is not None and entry.history and entry.history[-1].made_ts == made_ts:
                judge.pair(session_id, made_ts, entry.history[-1].p_keep, p)

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
        if entry is None or entry.last_ts < self._cutoff:
            return None
        return entry.history[-1] if entry.history else None

    def tracked(self, slot: str) -> int:
        """Sessions the slot holds advice for (forgotten ones not let go yet included)."""
        s = self._slots.get(slot)
        return len(s.sessions) if s is not None else 0

    def _prune(self, s: _Slot) -> None:
        """Let go of the forgotten sessions at the front (the least recently advised or arrived);
        one touched since it was put back waits its turn, and lookups check the cutoff meanwhile."""
        sessions, cutoff = s.sessions, self._cutoff
        while sessions:
            first = next(iter(sessions))  # O(1) on an OrderedDict, its own linked list
            if sessions[first].last_ts >= cutoff:
                return
            del sessions[first]

    def stats(self, slot: str) -> LedgerStats:
        """A slot's counts since its start(); all zero for a slot not started."""
        s = self._slots.get(slot) or _Slot()
        return LedgerStats(s.predictions, s.keep_predictions, s.hits, s.misses, s.unscored)

    def start(self, slot: str) -> None:
        """A new model sits in `slot`: forget what the slot held and count afresh."""
        if slot not in SLOTS:
            raise ValueError(f"unknown model slot {slot!r}; slots are {SLOTS}")
        self._slots[slot] = _Slot()
        self.judge.reset()

    def stop(self, slot: str) -> None:
        """No model sits in `slot` any more: forget it, and stop counting its arrivals."""
        self._slots.pop(slot, None)
        self.judge.reset()

    def _trim(self, s: _Slot) -> None:
        overflow = len(s.sessions) - self.max_sessions
        if overflow > 0:
            for session_id in [k for k, _ in zip(s.sessions, range(overflow))]:
                del s.sessions[session_id]
