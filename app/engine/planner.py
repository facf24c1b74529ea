"""From predictions to advice: which contexts to keep, which to let go, which to fetch early.

The planner ranks every idle live session by its expected wait until its next request
(Belady's "next use", in expectation: app.engine.predictor.ArrivalPrediction) and marks for
prefetch those likely to return within the lead time a fetch needs. The replay simulator carries
the advice out in its cluster model; the service turns it into orders for the transfer layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from app.engine.events import BlockHash
from app.engine.predictor import HORIZON_GRID, Predictor, predictions_from_matrix
from app.engine.state.base import SessionView

# Sessions idle longer than this are not scored: their contexts go by plain LRU.
MAX_IDLE_SECONDS = 1800.0


@dataclass(frozen=True, slots=True)
class SessionAdvice:
    session_id: str
    instance_id: str | None
    block_hashes: tuple[BlockHash, ...]
    # Retention rank: the smaller, the longer the context is worth keeping.
    expected_wait_seconds: float
    # P(next request within the planner's lead time).
    p_soon: float
    prefetch: bool


class Planner:
    def __init__(self, predictor: Predictor, *, lead_seconds: float = 30.0, prefetch_min_p: float = 0.5,
                 max_idle_seconds: float = MAX_IDLE_SECONDS) -> None:
        self.predictor = predictor
        self.lead_seconds = lead_seconds
        # Value of a prefetch = P(needed in time) x the stall it avoids; its cost is the bytes,
        # and the stall avoided grows with the bytes, so the test is on the probability alone.
        self.prefetch_min_p = prefetch_min_p
        self.max_idle_seconds = max_idle_seconds
        self._horizons = tuple(sorted({*HORIZON_GRID, lead_seconds}))
        self._lead_index = self._horizons.index(lead_seconds)

    def advise(self, sessions: Sequence[SessionView], now: float) -> list[SessionAdvice]:
        live = [s for s in sessions if s.state == "idle" and now - s.last_activity_ts <= self.max_idle_seconds
                and s.block_hashes]
        if not live:
            return []
        p = self.predictor.p_within(live, now, self._horizons)
        p = np.maximum.accumulate(np.clip(p, 0.0, 1.0), axis=1)
        grid = [i for i, h in enumerate(self._horizons) if h in HORIZON_GRID]
        predictions = predictions_from_matrix(live, now, p[:, grid])
        out = []
        for view, prediction, row in zip(live, predictions, p):
            p_soon = float(row[self._lead_index])
            out.append(SessionAdvice(view.session_id, view.instance_id, tuple(view.block_hashes),
                                     prediction.expected_wait_seconds, p_soon, p_soon >= self.prefetch_min_p))
        return out
