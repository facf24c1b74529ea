"""The scoring loop: advises on live sessions with the serving model and the shadow, so the
advice ledger can tell, when each session's next request comes, whether the model had it right,
and hands the serving model's advice to the scheduler.

Two ways to pick the sessions, one Advisor (app/decide/advisor.py) and one ledger behind both:

- **Every live session, every tick** (`every_live`, what the service runs: KVP_SCORE_ALL_LIVE).
  The scorer keeps a FeatureTable (app/predict/feature_table.py) of the live sessions current as
  the store applies events: its ingest observer marks each touched session dirty, and each pass
  first re-reads the dirty rows from the store in one bulk read (`StateStore.sessions`),
  dropping the closed and the forgotten, plus one page of the store's listing (a sweep that
  catches what no observer saw: a backlog that overflowed, events from before the start); the
  first pass builds the table from the store's listing. A pass then scores every row: the model
  reads the table's columns (`p_within_table`), the advice is computed as columns
  (app/decide/table_advice.py: `advise_rows`, equal to `Advisor.advise` on the same sessions at
  the same time: tests/decide/test_score_table.py), the ledger records columns
  (`record_columns`), and the scheduler is handed only the advice that changed (retention,
  prefetch, a chance moved by HANDOFF_P_STEP, a changed session) or that it has held for
  HANDOFF_REFRESH_SECONDS, so its advice never goes stale and its intake costs the changes, not
  the sessions. A pass goes in chunks of `chunk_sessions` (fewer when a chunk held the loop past
  `chunk_target_seconds`: next_chunk_sessions); `run` yields the event loop between
  them (the memory store's pass runs on it), and each chunk first re-reads the rows that changed
  meanwhile, so no advice is made on a row an observed arrival made stale. docs/decisions.md
  (24) has the figures.
- **A page per tick** (the default of the class, what the replay drives): one tick reads a page
  of live sessions (at most `sessions_per_tick`, newest activity first, each tick continuing
  where the last one stopped), plus the sessions with news, and advises on their views; or
  exactly the sessions a driver names (`tick(session_ids, views=...)`: the replay). A tick does
  not yield: its store read and its records happen with no ingestion in between.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import islice
from typing import Any, TypeVar

import numpy as np

from app.core.clock import Clock
from app.core.errors import StoreError
from app.decide.advisor import MAX_IDLE_SECONDS, Advisor, Thresholds
from app.decide.guard import LruGuard
from app.decide.order_book import RetentionKind
from app.decide.popularity import PrefixPopularity
from app.decide.routing import SameInstanceEstimate
from app.decide.scheduler import Scheduler
from app.decide.table_advice import (
    RETENTION_NAMES,
    Held,
    TableAdvice,
    advise_rows,
    held_of,
    session_advice,
)
from app.observe.ledger import AdviceLedger
from app.predict.feature_table import FeatureTable
from app.predict.features import DeploymentSignals
from app.predict.predictors import Predictor
from app.predict.slots import ModelSlots
from app.predict.tool_durations import ToolDurations
from app.state.base import SessionCursor, SessionView, StateStore, cursor_of
from app.state.rules import retention_cutoff
from app.state.storethread import Offload
from kvprefetch_client.events import (
    Event,
    RequestFinished,
    RequestRouted,
    SessionSignal,
)

log = logging.getLogger(__name__)

_DEMOTES: tuple[RetentionKind, ...] = ("demote",)

T = TypeVar("T")

MAX_NEWS_QUEUE = 100_000
# Sessions per chunk of a pass over every live session: a chunk is what holds the event loop in
# one piece. At 4096 the chunks held it 101-115 ms under `bench load` at 6,000 events/s with 45
# hints/s (the bench's client on the same 2 cores); at 2048 none held it over 100 ms after the
# start-up, the service at 68.5% of a core against 67.1 (one run each; docs/decisions.md, 26).
CHUNK_SESSIONS = 2048
# ... the most a chunk holds: with a target (KVP_SCORE_CHUNK_TARGET_SECONDS), the chunk after one
# that held the loop longer is cut in proportion, down to MIN_CHUNK_SESSIONS, and grows back by
# doubling once chunks take under half of it. The model's time per session is what varies: a
# loaded machine (stop 40's stallwatch runs found chunks of 2048 holding it 111-283 ms beside a
# training job, decisions 26), a bigger model, a shadow scoring too.
MIN_CHUNK_SESSIONS = 64
# The first pass builds the table from the store's listing, this many sessions a read.
REBUILD_PAGE_SESSIONS = 1024
# Dirty rows re-read a step: a re-read costs about 57 us a session (memory store), so 1024 held
# the loop about 60 ms a step, the scorer's longest hold under `bench load`.
REFRESH_SESSIONS = 256
# The share of its time a pass may hold the loop (or the store thread): after each step it waits
# as long again. A bare yield gave ingestion's requests one turn of the loop per chunk while a
# pass ran back to back, and a request needs several (body, parse, apply, answer): under `bench
# load` that halved the events ingested.
LOOP_SHARE = 0.5
# ... while events came in this recently (the scorer observes every accepted batch); on a loop
# with no ingest a pass runs its steps back to back, yielding once between them, so it takes its
# working time rather than twice that.
BUSY_SECONDS = 1.0
# The scheduler is told again when a chance moved this much since it was last told ...
HANDOFF_P_STEP = 0.02
# ... and at least this often whatever moved (a quarter of its advice TTL when that is shorter),
# so advice it holds never expires under a session that is still advised.
HANDOFF_REFRESH_SECONDS = 30.0
# The table's marks: what the scheduler was last told of the session (retention code * 2 +
# prefetch, p_soon, p_keep) and when; NaN: never, or the session changed since.
_M_CODE, _M_SOON, _M_KEEP, _M_AT = range(4)


async def _inline(fn: Callable[..., T], *args: Any) -> T:
    return fn(*args)


def next_chunk_sessions(
    sessions: int, held_seconds: float, target_seconds: float, most: int
) -> int:
    """The next chunk's size after a chunk of `sessions` held the loop `held_seconds`: cut in
    proportion when over the target (not below MIN_CHUNK_SESSIONS, or `most` when smaller),
    doubled up to `most` when under half of it, else the same."""
    if held_seconds > target_seconds:
        floor = min(MIN_CHUNK_SESSIONS, most)
        return max(floor, min(sessions, int(sessions * target_seconds / held_seconds)))
    if held_seconds < target_seconds / 2:
        return min(most, sessions * 2)
    return min(most, sessions)


@dataclass(frozen=True, slots=True)
class PassStats:
    """What the last pass over every live session did: `sessions` (table rows it covered),
    `advised` (idle and queued sessions advised by the serving model), `handed` (advice handed to
    the scheduler), `chunks`, `seconds` (the pass, wall) and `longest_chunk_seconds`."""

    sessions: int
    advised: int
    handed: int
    chunks: int
    seconds: float
    longest_chunk_seconds: float


class Scorer:
    """`scheduler`, when given, takes the serving model's advice too (the shadow's never);
        `routes` weighs the advice by where returns land (app/decide/routing.py); `guard`, where the
    advice lost to LRU, hands the scheduler LRU's instead (app/decide/guard.py); `popularity`, which
    context heads other sessions share (never demoted: app/decide/popularity.py); `deployment`,
    what each kind of signal has been worth here (a fresh one's floor); `tools`, the tools' run
    times (a session's call in flight says when it is back); `observe_seconds`,
    when given, is told each model's time to score the page, or the pass (slot, seconds), after its
    advice is recorded (the metrics' latency histogram); `thresholds`, the advisor's (the
    settings'). `every_live`: each tick is a pass over every live session (the module doc), in
    chunks of `chunk_sessions` at most (`chunk_target_seconds`: cut to what holds the loop
    about that long, next_chunk_sessions), with a sweep page of `sessions_per_tick`."""

    def __init__(
        self,
        store: StateStore,
        models: ModelSlots,
        ledger: AdviceLedger,
        clock: Clock,
        *,
        sessions_per_tick: int = 256,
        scheduler: Scheduler | None = None,
        routes: SameInstanceEstimate | None = None,
        popularity: PrefixPopularity | None = None,
        deployment: DeploymentSignals | None = None,
        tools: ToolDurations | None = None,
        observe_seconds: Callable[[str, float], None] | None = None,
        thresholds: Thresholds | None = None,
        guard: LruGuard | None = None,
        every_live: bool = False,
        chunk_sessions: int = CHUNK_SESSIONS,
        chunk_target_seconds: float | None = None,
        session_retention_seconds: float = math.inf,
    ) -> None:
        if chunk_sessions < 1:
            raise ValueError("chunk_sessions must be positive")
        if chunk_target_seconds is not None and chunk_target_seconds <= 0:
            raise ValueError("chunk_target_seconds must be positive (or None: fixed chunks)")
        self.store = store
        # Where the advice lost to plain LRU, the scheduler gets LRU's (the ledger, the model's).
        self.guard = guard
        self.thresholds = thresholds or Thresholds()
        self.models = models
        self.ledger = ledger
        self.clock = clock
        self.sessions_per_tick = sessions_per_tick
        self.scheduler = scheduler
        self.routes = routes
        self.popularity = popularity
        self.deployment = deployment
        self.tools = tools
        self.observe_seconds = observe_seconds
        self._cursor: SessionCursor | None = None
        # Sessions with news (a request just finished, or a signal came): advised at the next
        # tick, ahead of the page, so a fresh context's keep or demote, or a signal's prefetch,
        # does not wait for the page to come round.
        self._news: dict[str, None] = {}
        self.every_live = every_live
        self.chunk_sessions = chunk_sessions
        self.chunk_target_seconds = chunk_target_seconds
        self._chunk = chunk_sessions  # the next chunk's sessions, as the last ones took
        # The store forgets a session idle past its retention without an event (by the newest
        # event ts, app/state/rules.py): the table lets its row go by the same rule.
        self.session_retention_seconds = session_retention_seconds
        self._newest_ts = -math.inf
        # The pass over every live session: its table, what it holds beside each row (what the
        # advice carries: the instance, the blocks; the latest signal's kind), the sessions
        # touched since their rows were read, whether the observer marks them (from the moment
        # the first pass starts reading the store) and whether the table was built yet.
        self.table = FeatureTable(marks=4)
        self._held: dict[str, Held] = {}
        self._dirty: dict[str, None] = {}
        self._tracking = False
        self._built = False
        # Per instance, whether the guard let its advice (and its demotes) act when it was last
        # handed on: a verdict that flips hands everything on again.
        self._allowed: dict[str | None, tuple[bool, bool]] = {}
        # Per instance, the guard's fallbacks (and demote suspensions) the scheduler has
        # withdrawn the advice for.
        self._fallbacks: dict[str, int] = {}
        self._suspensions: dict[str, int] = {}
        self.last_pass: PassStats | None = None
        self._observed_at = -math.inf  # time.monotonic() of the last observed batch

    def observe(self, events: Sequence[Event]) -> None:
        """The ingest observer: notes finishes and signals for the page path (bounded; past the
        bound the page covers them), and, for the pass over every live session, the sessions
        whose rows the events may change."""
        self._observed_at = time.monotonic()
        if self._tracking:
            self._mark_dirty(events)
            return
        if self.every_live:
            return  # nothing read yet: the first pass reads everything
        for e in events:
            # A finish changes what to keep; a signal says the session may be back soon; a
            # routed request may wait for a slot (its context is then fetched): all are advised
            # at the next tick rather than when the page comes round.
            if (
                isinstance(e, (RequestFinished, SessionSignal, RequestRouted))
                and len(self._news) < MAX_NEWS_QUEUE
            ):
                self._news[e.session_id] = None

    def _mark_dirty(self, events: Sequence[Event]) -> None:
        dirty = self._dirty
        newest = self._newest_ts
        for e in events:
            if e.ts > newest:
                newest = e.ts
            # Every event naming a session may change its row; vLLM's block events may name one
            # inside (its context grows).
            session_id = getattr(e, "session_id", None)
            if session_id is not None:
                dirty[session_id] = None
            elif e.type == "vllm_kv_events":
                for inner in e.events:
                    inner_id = getattr(inner, "session_id", None)
                    if inner_id is not None:
                        dirty[inner_id] = None
        self._newest_ts = newest

    def _advisor(self, predictor: Predictor) -> Advisor:
        return Advisor(
            predictor,
            routes=self.routes,
            popularity=self.popularity,
            deployment=self.deployment,
            tools=self.tools,
            **self.thresholds.advisor_options(),
        )

    def tick(
        self,
        session_ids: Sequence[str] | None = None,
        *,
        views: Sequence[SessionView] | None = None,
    ) -> int:
        """Score one page of live sessions now (by the injected clock), or with `every_live` every
        live session (a whole pass); returns how many were read (the pass: its table's rows).
        `session_ids`: score exactly these, in this order, instead (the page and the finished
        queue are left as they are): for a driver that decides which, like the replay; `views`:
        those sessions as the driver just read them (not read again)."""
        if self.every_live and session_ids is None and views is None:
            for _ in self.passes():
                pass
            return self.last_pass.sessions if self.last_pass is not None else 0
        now = self.clock.now()
        self._check_guard(now)
        if views is not None:
            page = list(views)
        elif session_ids is not None:
            page = [v for v in (self.store.session(s) for s in session_ids) if v is not None]
        else:
            page = self._page(now)
        if not page:
            return 0
        live = self.models.serving
        started = time.perf_counter()
        advice = self._advisor(live.predictor).advise(page, now)
        seconds = time.perf_counter() - started
        self.ledger.record("live", advice, now)
        if self.scheduler is not None:
            self.scheduler.advise(
                advice if self.guard is None else self.guard.filter(advice, now), now
            )
        if self.observe_seconds is not None:
            self.observe_seconds("live", seconds)
        shadow = self.models.shadow
        if shadow is not None:
            started = time.perf_counter()
            try:
                advice = self._advisor(shadow.predictor).advise(page, now)
            except Exception:  # a broken shadow must never cost the serving model its scoring
                log.exception(
                    "the shadow model %s failed to score %d sessions", shadow.version, len(page)
                )
            else:
                seconds = time.perf_counter() - started
                self.ledger.record("shadow", advice, now)
                if self.observe_seconds is not None:
                    self.observe_seconds("shadow", seconds)
        return len(page)

    def _page(self, now: float) -> list[SessionView]:
        # Sessions idle longer than the planner looks at are not read at all.
        page = self.store.live_sessions(
            self.sessions_per_tick, before=self._cursor, active_since_ts=now - MAX_IDLE_SECONDS
        )
        self._cursor = cursor_of(page[-1]) if len(page) == self.sessions_per_tick else None
        news = list(self._news)[: self.sessions_per_tick]
        for session_id in news:
            del self._news[session_id]
        in_page = {v.session_id for v in page}
        fresh = [
            v for v in (self.store.session(s) for s in news if s not in in_page) if v is not None
        ]
        return fresh + page

    async def run(self, interval_seconds: float, offload: Offload | None = None) -> None:
        """Tick every `interval_seconds` until cancelled; `offload`, when given, runs each tick
        (on the store thread, app/state/storethread.py; inline with the memory store). A pass
        over every live session starts every `interval_seconds` (at once when the last one took
        longer) and runs a chunk per job, yielding the event loop between chunks, so ingestion's
        jobs and the loop's other tasks wait at most a chunk."""
        started = time.monotonic()
        while True:
            if self.every_live:
                await asyncio.sleep(max(interval_seconds - (time.monotonic() - started), 0.0))
                started = time.monotonic()
            else:
                await asyncio.sleep(interval_seconds)
            # Nothing a tick raises ends scoring for the life of the process; a store blip is
            # expected (and says so once a tick), anything else is a bug worth its traceback.
            try:
                if self.every_live:
                    steps = self.passes()
                    step = offload if offload is not None else _inline
                    while True:
                        step_started = time.perf_counter()
                        if not await step(next, steps, False):
                            break
                        held = time.perf_counter() - step_started
                        await asyncio.sleep(self.pause_after(held, time.monotonic()))
                elif offload is None:
                    self.tick()
                else:
                    await offload(self.tick)
            except StoreError as exc:
                log.warning("scoring tick skipped: %s", exc)
            except Exception:
                log.exception("scoring tick failed")

    def pause_after(self, held_seconds: float, now_monotonic: float) -> float:
        """How long `run` waits after a step that held the loop `held_seconds`: as long again
        (LOOP_SHARE) while events come in, so ingest gets the loop's other half; no more than a
        yield on a loop that has had none for BUSY_SECONDS."""
        if now_monotonic - self._observed_at > BUSY_SECONDS:
            return 0.0
        return held_seconds * (1.0 - LOOP_SHARE) / LOOP_SHARE

    # -- the pass over every live session ------------------------------------------------------

    def passes(self) -> Iterator[bool]:
        """One pass over every live session, a chunk per step (each yields True): a driver that
        must not hold its loop (`run`) does other work between the steps; `tick` runs them all at
        once. Sets `last_pass` when done."""
        started = time.perf_counter()
        now = self.clock.now()
        if not self._built:
            yield from self._rebuild(now)
        else:
            self._sweep(now)
        yield from self._refreshing()
        self._refresh()
        self._drop_idle(now)
        ids = self.table.session_ids
        removals = self.table.removals
        chunks, longest, advised, handed = 0, 0.0, 0, 0
        model_seconds = {"live": 0.0, "shadow": 0.0}
        self._check_guard(now)
        start = 0
        while start < len(ids):
            yield True
            yield from self._refreshing()
            chunk_started = time.perf_counter()
            self._refresh()  # what the observers saw since the last step
            now = self.clock.now()
            end = start + self._chunk
            if self.table.removals == removals:  # no row has moved since the pass began
                rows = np.arange(start, min(end, len(ids)))
            else:
                found = (self.table.row(s) for s in ids[start:end])
                rows = np.array([r for r in found if r is not None], dtype=np.intp)
            n_advised, n_handed = self._score_chunk(rows, now, model_seconds)
            advised += n_advised
            handed += n_handed
            chunks += 1
            held = time.perf_counter() - chunk_started
            longest = max(longest, held)
            if self.chunk_target_seconds is not None:
                self._chunk = next_chunk_sessions(
                    self._chunk, held, self.chunk_target_seconds, self.chunk_sessions
                )
            start = end
        if self.observe_seconds is not None and chunks:
            self.observe_seconds("live", model_seconds["live"])
            if self.models.shadow is not None:
                self.observe_seconds("shadow", model_seconds["shadow"])
        self.last_pass = PassStats(
            len(ids), advised, handed, chunks, time.perf_counter() - started, longest
        )

    def _rebuild(self, now: float) -> Iterator[bool]:
        """The table from the store's listing (the sessions the page path would read); what
        changes from the first read on is marked dirty, and re-read after."""
        self._tracking = True
        cursor: SessionCursor | None = None
        while True:
            page = self.store.live_sessions(
                REBUILD_PAGE_SESSIONS, before=cursor, active_since_ts=now - MAX_IDLE_SECONDS
            )
            self._upsert(page)
            if len(page) < REBUILD_PAGE_SESSIONS:
                break
            cursor = cursor_of(page[-1])
            yield True
        self._built = True

    def _sweep(self, now: float) -> None:
        """One page of the store's listing re-read, continuing where the last one stopped: what
        no observer saw comes into the table within a round of pages."""
        page = self.store.live_sessions(
            self.sessions_per_tick, before=self._cursor, active_since_ts=now - MAX_IDLE_SECONDS
        )
        self._cursor = cursor_of(page[-1]) if len(page) == self.sessions_per_tick else None
        self._upsert(page, changed_only=True)

    def _upsert(self, views: Sequence[SessionView], *, changed_only: bool = False) -> None:
        """Rows for these views; `changed_only`: only those whose session changed in what the
        table or the advice reads (a sweep's re-read of an unchanged session is no news to the
        scheduler)."""
        if changed_only:
            kept = [(v, held_of(v)) for v in views]
            now_held = self._held
            fresh = [
                (v, h)
                for v, h in kept
                if (old := now_held.get(v.session_id)) is None or old.fingerprint != h.fingerprint
            ]
        else:
            fresh = [(v, held_of(v)) for v in views]
        if fresh:
            self.table.upsert_many([v for v, _ in fresh])
            self._held.update((v.session_id, h) for v, h in fresh)

    def _refreshing(self) -> Iterator[bool]:
        """The rows dirty now re-read REFRESH_SESSIONS a step (under heavy ingest most live
        sessions are): the step that scores a chunk reads only what came since. As many steps
        as there were slices at the start, so ingest that dirties rows faster than they are read
        cannot hold the pass here."""
        for _ in range(len(self._dirty) // REFRESH_SESSIONS):
            self._refresh(REFRESH_SESSIONS)
            yield True

    def _refresh(self, limit: int | None = None) -> None:
        """The dirty rows (the first `limit` of them) re-read from the store in one bulk read;
        the closed and the forgotten dropped. A failed read leaves them dirty."""
        if not self._dirty:
            return
        ids = list(islice(self._dirty, limit))
        views = self.store.sessions(ids, resident=False)
        if limit is None:
            self._dirty.clear()
        else:
            for session_id in ids:
                del self._dirty[session_id]
        fresh = []
        for session_id, view in zip(ids, views):
            if view is None or view.state == "closed":
                self._remove(session_id)
            else:
                fresh.append(view)
        self._upsert(fresh)

    def _remove(self, session_id: str) -> None:
        self.table.remove(session_id)
        self._held.pop(session_id, None)

    def _drop_idle(self, now: float) -> None:
        """Rows idle past the planner's horizon with no fresh signal (the page path does not
        read them, no advice covers them), and rows the store has forgotten (idle since before
        its retention cutoff): neither is announced by an event; an event brings one back."""
        n = len(self.table)
        if not n:
            return
        rows = np.arange(n)
        _, _, last = self.table.advisor_columns(rows)
        signal_ts = self.table.signal_ts(rows)
        with np.errstate(invalid="ignore"):
            gone = (now - last > MAX_IDLE_SECONDS) & ~(
                (signal_ts >= last) & (now - signal_ts <= self.thresholds.lead_seconds)
            )
        gone |= last < retention_cutoff(self._newest_ts, self.session_retention_seconds)
        for session_id in self.table.ids_of(np.flatnonzero(gone)):
            self._remove(session_id)

    def _check_guard(self, now: float) -> None:
        """An instance the guard turned to `lru` since the last look: the scheduler withdraws
        the pins and demotes carried out there (else they outlive the verdict). One whose
        verdict flipped since its advice was handed on: hand every row on again this pass
        (rare: a verdict holds for minutes)."""
        if self.guard is None or self.scheduler is None:
            return
        # Counted, not read off the state: a verdict may be `trial` again by the next look.
        for instance_id, verdict in list(self.guard.verdicts.items()):
            seen = self._fallbacks.get(instance_id, 0)
            if verdict.fallbacks != seen:
                self._fallbacks[instance_id] = verdict.fallbacks
                if verdict.fallbacks > seen:
                    self.scheduler.withdraw(instance_id, now)
        # ... and its demotes alone, where they cost more than the room they made.
        for instance_id, demotes in list(self.guard.demotes.items()):
            seen = self._suspensions.get(instance_id, 0)
            if demotes.suspensions != seen:
                self._suspensions[instance_id] = demotes.suspensions
                if demotes.suspensions > seen:
                    self.scheduler.withdraw(instance_id, now, kinds=_DEMOTES)
        if any(self.guard.mode(i, now) != was for i, was in self._allowed.items()):
            self.table.marks[:, _M_AT] = np.nan
            self._allowed.clear()

    def _score_chunk(
        self, rows: np.ndarray, now: float, model_seconds: dict[str, float]
    ) -> tuple[int, int]:
        """Advise on these rows with the serving model (ledger, scheduler) and the shadow
        (ledger); returns how many were advised and how many handed to the scheduler."""
        if not len(rows):
            return 0, 0
        started = time.perf_counter()
        advisor = self._advisor(self.models.serving.predictor)
        matrices: dict[bytes, np.ndarray] = {}  # the models share the chunk's features
        read = partial(self.store.sessions, resident=False)  # no model reads residency
        advice = advise_rows(advisor, self.table, self._held, rows, now, matrices, read)
        model_seconds["live"] += time.perf_counter() - started
        self._record("live", advice, now)
        handed = self._hand_on(advisor, advice, now) if self.scheduler is not None else 0
        shadow = self.models.shadow
        if shadow is not None:
            started = time.perf_counter()
            try:
                shadow_advice = advise_rows(
                    self._advisor(shadow.predictor),
                    self.table,
                    self._held,
                    rows,
                    now,
                    matrices,
                    read,
                )
            except Exception:  # a broken shadow must never cost the serving model its scoring
                log.exception(
                    "the shadow model %s failed to score %d sessions", shadow.version, len(rows)
                )
            else:
                model_seconds["shadow"] += time.perf_counter() - started
                self._record("shadow", shadow_advice, now)
        return len(advice.rows) + len(advice.queued), handed

    def _record(self, slot: str, advice: TableAdvice, now: float) -> None:
        retention = RETENTION_NAMES[advice.retention].tolist()
        self.ledger.record_columns(
            slot,
            self.table.ids_of(advice.rows),
            retention,
            advice.prefetch.tolist(),
            advice.p_keep.tolist(),
            now,
            self.table.advisor_columns(advice.rows)[1].tolist(),  # the cost of the advice
        )

    def _hand_on(self, advisor: Advisor, advice: TableAdvice, now: float) -> int:
        """The advice the scheduler must hear: what changed since it last heard of the session,
        or what it has held long enough to need refreshing, and every queued request's."""
        assert self.scheduler is not None
        marks = self.table.marks
        rows = advice.rows
        code = advice.retention * 2 + advice.prefetch
        old = marks[rows]
        refresh = min(HANDOFF_REFRESH_SECONDS, self.scheduler.advice_ttl_seconds / 4)
        with np.errstate(invalid="ignore"):  # NaN marks: never told, or changed since
            stale = ~(now - old[:, _M_AT] < refresh)
        changed = (
            stale
            | (code != old[:, _M_CODE])
            | (np.abs(advice.p_soon - old[:, _M_SOON]) >= HANDOFF_P_STEP)
            | (np.abs(advice.p_keep - old[:, _M_KEEP]) >= HANDOFF_P_STEP)
        )
        take = np.flatnonzero(changed)
        out = session_advice(advisor, self.table, self._held, advice, take, now)
        if not out:
            return 0
        told = rows[take]
        marks[told, _M_CODE] = code[take]
        marks[told, _M_SOON] = advice.p_soon[take]
        marks[told, _M_KEEP] = advice.p_keep[take]
        marks[told, _M_AT] = now
        if self.guard is not None:
            for a in out:
                if a.instance_id not in self._allowed:
                    self._allowed[a.instance_id] = self.guard.mode(a.instance_id, now)
            out = self.guard.filter(out, now)
        self.scheduler.advise(out, now)
        return len(out)
