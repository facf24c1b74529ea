"""The scoring loop: advises on live idle sessions with the serving model and the shadow, so the
advice ledger can tell, when each session's next request comes, whether the model had it right.

One tick reads a page of live sessions (at most `sessions_per_tick`, newest activity first, each
tick continuing where the last one stopped, back to the newest after the oldest), runs the same
Planner the policies use for each model, and records the advice. A tick does not yield: its
store read and its records happen with no ingestion in between, so no advice is recorded on a
view that an already-ingested arrival made stale. The page bound is what keeps one tick from
holding the event loop long: a page of 256 takes 10-30 ms with two learned models on the 2-core
development machine, most of it building the session views.
"""

from __future__ import annotations

import asyncio
import logging

from app.core.clock import Clock
from app.core.errors import StoreError
from app.engine.advice import AdviceLedger
from app.engine.models import ModelRegistry
from app.engine.planner import MAX_IDLE_SECONDS, Planner
from app.engine.state.base import SessionCursor, StateStore, cursor_of

log = logging.getLogger(__name__)


class Scorer:
    def __init__(self, store: StateStore, models: ModelRegistry, ledger: AdviceLedger, clock: Clock, *,
                 sessions_per_tick: int = 256) -> None:
        self.store = store
        self.models = models
        self.ledger = ledger
        self.clock = clock
        self.sessions_per_tick = sessions_per_tick
        self._cursor: SessionCursor | None = None

    def tick(self) -> int:
        """Score one page of live sessions now (by the injected clock); returns how many were read."""
        now = self.clock.now()
        # Sessions idle longer than the planner looks at are not read at all.
        page = self.store.live_sessions(self.sessions_per_tick, before=self._cursor,
                                        active_since_ts=now - MAX_IDLE_SECONDS)
        self._cursor = cursor_of(page[-1]) if len(page) == self.sessions_per_tick else None
        if not page:
            return 0
        live = self.models.serving
        self.ledger.record("live", Planner(live.predictor).advise(page, now), now)
        shadow = self.models.shadow
        if shadow is not None:
            try:
                advice = Planner(shadow.predictor).advise(page, now)
            except Exception:  # a broken shadow must never cost the serving model its scoring
                log.exception("the shadow model %s failed to score %d sessions", shadow.version, len(page))
            else:
                self.ledger.record("shadow", advice, now)
        return len(page)

    async def run(self, interval_seconds: float) -> None:
        """Tick every `interval_seconds` until cancelled."""
        while True:
            await asyncio.sleep(interval_seconds)
            # Nothing a tick raises ends scoring for the life of the process; a store blip is
            # expected (and says so once a tick), anything else is a bug worth its traceback.
            try:
                self.tick()
            except StoreError as exc:
                log.warning("scoring tick skipped: %s", exc)
            except Exception:
                log.exception("scoring tick failed")
