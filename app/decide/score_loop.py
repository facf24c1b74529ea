"""The scoring loop: advises on live idle sessions with the serving model and the shadow, so the
advice ledger can tell, when each session's next request comes, whether the model had it right.

One tick reads a page of live sessions (at most `sessions_per_tick`, newest activity first, each
tick continuing where the last one stopped, back to the newest after the oldest), runs the same
Advisor the policies use for each model, and records the advice. A tick does not yield: its
store read and its records happen with no ingestion in between, so no advice is recorded on a
view that an already-ingested arrival made stale. The page bound is what keeps one tick from
holding the event loop long: a page of 256 takes 10-30 ms with two learned models on the 2-core
development machine, most of it building the session views.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from app.core.clock import Clock
from app.core.errors import StoreError
from app.decide.advisor import MAX_IDLE_SECONDS, Advisor, Thresholds
from app.decide.guard import LruGuard
from app.decide.popularity import PrefixPopularity
from app.decide.routing import SameInstanceEstimate
from app.decide.scheduler import Scheduler
from app.observe.ledger import AdviceLedger
from app.predict.features import DeploymentSignals
from app.predict.predictors import Predictor
from app.predict.registry import ModelRegistry
from app.state.base import SessionCursor, SessionView, StateStore, cursor_of
from app.state.storethread import Offload
from kvprefetch_client.events import Event, RequestFinished, RequestRouted, SessionSignal

log = logging.getLogger(__name__)

MAX_NEWS_QUEUE = 100_000


class Scorer:
    """`scheduler`, when given, takes the serving model's advice too (the shadow's never);
        `routes` weighs the advice by where returns land (app/decide/routing.py); `guard`, where the
    advice lost to LRU, hands the scheduler LRU's instead (app/decide/guard.py); `popularity`, which
    context heads other sessions share (never demoted: app/decide/popularity.py); `deployment`,
    what each kind of signal has been worth here (a fresh one's floor); `observe_seconds`,
        when given, is told each model's time to score the page (slot, seconds), after its advice is
        recorded (the metrics' latency histogram); `thresholds`, the advisor's (the settings')."""

    def __init__(
        self,
        store: StateStore,
        models: ModelRegistry,
        ledger: AdviceLedger,
        clock: Clock,
        *,
        sessions_per_tick: int = 256,
        scheduler: Scheduler | None = None,
        routes: SameInstanceEstimate | None = None,
        popularity: PrefixPopularity | None = None,
        deployment: DeploymentSignals | None = None,
        observe_seconds: Callable[[str, float], None] | None = None,
        thresholds: Thresholds | None = None,
        guard: LruGuard | None = None,
    ) -> None:
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
        self.observe_seconds = observe_seconds
        self._cursor: SessionCursor | None = None
        # Sessions with news (a request just finished, or a signal came): advised at the next
        # tick, ahead of the page, so a fresh context's keep or demote, or a signal's prefetch,
        # does not wait for the page to come round.
        self._news: dict[str, None] = {}

    def observe(self, events: Sequence[Event]) -> None:
        """The ingest observer: notes finishes and signals (bounded; past the bound the page
        covers them)."""
        for e in events:
            # A finish changes what to keep; a signal says the session may be back soon; a
            # routed request may wait for a slot (its context is then fetched): all are advised
            # at the next tick rather than when the page comes round.
            if (
                isinstance(e, (RequestFinished, SessionSignal, RequestRouted))
                and len(self._news) < MAX_NEWS_QUEUE
            ):
                self._news[e.session_id] = None

    def _advisor(self, predictor: Predictor) -> Advisor:
        return Advisor(
            predictor,
            routes=self.routes,
            popularity=self.popularity,
            deployment=self.deployment,
            **self.thresholds.advisor_options(),
        )

    def tick(
        self,
        session_ids: Sequence[str] | None = None,
        *,
        views: Sequence[SessionView] | None = None,
    ) -> int:
        """Score one page of live sessions now (by the injected clock); returns how many were read.
        `session_ids`: score exactly these, in this order, instead (the page and the finished
        queue are left as they are): for a driver that decides which, like the replay; `views`:
        those sessions as the driver just read them (not read again)."""
        now = self.clock.now()
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
        (on the store thread, app/state/storethread.py)."""
        while True:
            await asyncio.sleep(interval_seconds)
            # Nothing a tick raises ends scoring for the life of the process; a store blip is
            # expected (and says so once a tick), anything else is a bug worth its traceback.
            try:
                if offload is None:
                    self.tick()
                else:
                    await offload(self.tick)
            except StoreError as exc:
                log.warning("scoring tick skipped: %s", exc)
            except Exception:
                log.exception("scoring tick failed")
