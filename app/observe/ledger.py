"""What each model advised for each idle session, scored when the session's next request comes.

The scoring loop (app.decide.scorer) records the planner's advice per model ("live", "shadow");
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

Counts are kept per model version too (`by_version`): a model swapped out keeps what it counted,
and a promoted shadow takes its slot's counts and advice with it to serving. While a shadow is
set, each tick's advice of the two models on the same session is compared: the pairs that differ
are counted, and the latest DISAGREEMENTS_KEPT of them kept for the dashboard.
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
# Advice records kept per session and model: the last two runs of the same advice, each as its
# first record and its latest, so the advice in force is found when a `request_routed` arrives
# many scoring ticks late (a replay at 60x: a tenth of a second is six ticks of the service's).
ADVICE_HISTORY = 4
# Sessions tracked per model; past this, those least recently advised or arrived are forgotten
# (their next arrival counts as unscored). About 200 bytes each.
MAX_SESSIONS = 200_000
# Sessions whose two models' latest advice differed, kept (the most recent) for the dashboard.
DISAGREEMENTS_KEPT = 100
# Model versions whose counts are kept after they left their slot (the most recent).
VERSIONS_KEPT = 64
# The version name the heuristic counts under (no model loaded).
HEURISTIC = "heuristic"


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
    # Of the records, those that said prefetch; and the sessions' context bytes summed over the
    # records that said keep and over those that said prefetch: the cost of the advice, summed
    # as the records are counted (the two models advise the same sessions at the same ticks, so
    # their sums compare).
    prefetch_predictions: int = 0
    keep_advice_bytes: int = 0
    prefetch_advice_bytes: int = 0

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


@dataclass(frozen=True, slots=True)
class Disagreement:
    """A session the serving model and the shadow advised differently at the same tick."""

    session_id: str
    made_ts: float
    context_bytes: int
    live: AdviceRecord
    shadow: AdviceRecord


@dataclass(frozen=True, slots=True)
class Comparison:
    """The shadow beside the serving model since the shadow came in: advice records paired
    (same session, same tick), how many of them differ, and the latest that did, newest first."""

    paired: int
    disagreed: int
    latest: list[Disagreement]


class _Slot:
    __slots__ = (
        "base",
        "hits",
        "keep_bytes",
        "keep_predictions",
        "misses",
        "predictions",
        "prefetch_bytes",
        "prefetch_predictions",
        "sessions",
        "unscored",
        "version",
    )

    def __init__(self, version: str = HEURISTIC) -> None:
        # Recency order (the least recently advised or arrived first): an OrderedDict, as taking
        # from the front of a dict scans every slot freed there (docs/decisions.md, 25).
        self.sessions: OrderedDict[str, _Entry] = OrderedDict()
        self.predictions = self.keep_predictions = self.hits = self.misses = self.unscored = 0
        self.prefetch_predictions = self.keep_bytes = self.prefetch_bytes = 0
        self.version = version
        # Its counts when it came into the slot it is in: zero, or a promoted shadow's.
        self.base = LedgerStats(0, 0, 0, 0, 0)

    def stats(self) -> LedgerStats:
        return LedgerStats(
            self.predictions,
            self.keep_predictions,
            self.hits,
            self.misses,
            self.unscored,
            self.prefetch_predictions,
            self.keep_bytes,
            self.prefetch_bytes,
        )


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
        bytes_per_block: int = 0,
    ) -> None:
        """`bytes_per_block`: what a context block holds, for the cost of the advice."""
        if retention_seconds <= 0:
            raise ValueError("retention_seconds must be positive")
        self.judge = PairedJudge(judge_horizon_seconds)
        self.max_sessions = max_sessions
        self.retention_seconds = retention_seconds
        self._slots: dict[str, _Slot] = {"live": _Slot()}
        self._newest = -math.inf  # the newest event ts observed
        self._cutoff = -math.inf
        self.bytes_per_block = bytes_per_block
        # The counts of the versions that left their slot; a version back in a slot adds on.
        self._retired: OrderedDict[str, LedgerStats] = OrderedDict()
        self._paired = self._disagreed = 0
        self._disagreements: OrderedDict[str, Disagreement] = OrderedDict()

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
            [len(a.block_hashes) for a in scored],
        )

    def record_columns(
        self,
        slot: str,
        session_ids: Sequence[str],
        retention: Sequence[Retention],
        prefetch: Sequence[bool],
        p_keep: Sequence[float],
        made_ts: float,
        blocks: Sequence[int] | None = None,
    ) -> None:
        """`record` for advice given as columns (no queued ones): what the scoring loop's pass
        over every live session hands over, without an object per session. `blocks`: each
        session's context blocks, for the advice's cost (none: no cost counted)."""
        s = self._slots[slot]
        if slot == "shadow":
            self._pair(session_ids, retention, prefetch, p_keep, made_ts, blocks)
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
            if (
                len(history) > 1
                and rec[1] == history[-1][1] == history[-2][1]
                and rec[2] == history[-1][2] == history[-2][2]
            ):
                # The same advice again: a run is its first record (in force since) and its
                # latest (this tick's, which the shadow pairs with), however long it lasts.
                history[-1] = rec
            else:
                history.append(rec)
                if len(history) > ADVICE_HISTORY:
                    del history[0]
            sessions[session_id] = entry
        keeps = sum(1 for r, pf in zip(retention, prefetch) if pf or r == "keep")
        s.predictions += len(session_ids)
        s.keep_predictions += keeps
        s.prefetch_predictions += sum(1 for pf in prefetch if pf)
        if blocks is not None and self.bytes_per_block:
            per = self.bytes_per_block
            s.keep_bytes += per * sum(b for r, b in zip(retention, blocks) if r == "keep")
            s.prefetch_bytes += per * sum(b for pf, b in zip(prefetch, blocks) if pf)
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

    def _pair(
        self,
        session_ids: Sequence[str],
        retention: Sequence[Retention],
        prefetch: Sequence[bool],
        p_keep: Sequence[float],
        made_ts: float,
        blocks: Sequence[int] | None,
    ) -> None:
        """The shadow's advice beside the serving model's of the same tick: for the judge, and
        the sessions where the two differ."""
        live = self._slots["live"].sessions
        judge = self.judge
        kept = self._disagreements
        sizes = blocks if blocks is not None else repeat(0)
        for session_id, r, pf, p, n in zip(session_ids, retention, prefetch, p_keep, sizes):
            entry = live.get(session_id)
            if entry is None or not entry.history or entry.history[-1].made_ts != made_ts:
                continue
            theirs = entry.history[-1]
            judge.pair(session_id, made_ts, theirs.p_keep, p)
            self._paired += 1
            if theirs.retention == r and theirs.prefetch == pf:
                kept.pop(session_id, None)  # they agree now
                continue
            self._disagreed += 1
            kept.pop(session_id, None)
            kept[session_id] = Disagreement(
                session_id,
                made_ts,
                n * self.bytes_per_block,
                theirs,
                AdviceRecord(made_ts, r, pf, p),
            )
            if len(kept) > DISAGREEMENTS_KEPT:
                kept.popitem(last=False)

    def comparison(self) -> Comparison | None:
        """The shadow against the serving model since the shadow came in; None without one."""
        if "shadow" not in self._slots:
            return None
        newest_first = list(reversed(self._disagreements.values()))
        return Comparison(self._paired, self._disagreed, newest_first)

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
        """A slot's counts since its model came in (a promoted one's since it began to shadow);
        all zero for a slot not started."""
        s = self._slots.get(slot)
        return s.stats() if s is not None else LedgerStats(0, 0, 0, 0, 0)

    def base(self, slot: str) -> LedgerStats:
        """A slot's counts when its model came into it: zero, or a promoted shadow's (counted
        under the shadow slot already)."""
        s = self._slots.get(slot)
        return s.base if s is not None else LedgerStats(0, 0, 0, 0, 0)

    def by_version(self) -> dict[str, LedgerStats]:
        """Every model version's counts while it sat in a slot, since the service started (the
        most recent VERSIONS_KEPT versions); the heuristic's under "heuristic"."""
        out = dict(self._retired)
        for s in self._slots.values():
            out[s.version] = _add(out.get(s.version), s.stats())
        return out

    def start(self, slot: str, version: str | None = None) -> None:
        """A new model (`version`; None: the heuristic) sits in `slot`: the slot counts afresh;
        what the model before it counted is kept under its version."""
        if slot not in SLOTS:
            raise ValueError(f"unknown model slot {slot!r}; slots are {SLOTS}")
        self._retire(slot)
        self._slots[slot] = _Slot(version or HEURISTIC)
        self._reset_pairs()

    def stop(self, slot: str) -> None:
        """No model sits in `slot` any more: forget it, and stop counting its arrivals (its
        version keeps its counts)."""
        self._retire(slot)
        self._slots.pop(slot, None)
        self._reset_pairs()

    def promote(self) -> None:
        """The shadow's model serves now: its counts and advice go with it to the live slot, and
        the shadow slot is empty."""
        shadow = self._slots.pop("shadow", None)
        if shadow is None:
            raise ValueError("no shadow to promote")
        self._retire("live")
        shadow.base = shadow.stats()
        self._slots["live"] = shadow
        self._reset_pairs()

    def _retire(self, slot: str) -> None:
        s = self._slots.get(slot)
        if s is None or not (s.predictions or s.hits or s.misses or s.unscored):
            return  # a model that counted nothing leaves nothing to keep
        retired = self._retired
        retired[s.version] = _add(retired.pop(s.version, None), s.stats())
        while len(retired) > VERSIONS_KEPT:
            retired.popitem(last=False)

    def _reset_pairs(self) -> None:
        self.judge.reset()
        self._paired = self._disagreed = 0
        self._disagreements.clear()

    def _trim(self, s: _Slot) -> None:
        overflow = len(s.sessions) - self.max_sessions
        if overflow > 0:
            for session_id in [k for k, _ in zip(s.sessions, range(overflow))]:
                del s.sessions[session_id]


def _add(a: LedgerStats | None, b: LedgerStats) -> LedgerStats:
    if a is None:
        return b
    return LedgerStats(*(x + y for x, y in zip(_fields(a), _fields(b))))


def _fields(s: LedgerStats) -> tuple[int, ...]:
    return (
        s.predictions,
        s.keep_predictions,
        s.hits,
        s.misses,
        s.unscored,
        s.prefetch_predictions,
        s.keep_advice_bytes,
        s.prefetch_advice_bytes,
    )
