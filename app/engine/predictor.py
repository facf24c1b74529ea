"""Predictors of each live session's next request: when, and how likely.

`predict_one` / `predict_many` in the style of river. The heuristic needs no model: it reads the
session's own history. The learned LightGBM predictor (issue 4) implements the same interface.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from app.engine.state.base import SessionView

# REFERENCE.md ("What real traffic looks like"): the gap to a conversation's next turn has a
# median of ~78-126 s; this is the prior for a session with no gap of its own yet.
PRIOR_GAP_SECONDS = 100.0
# Keep a context for this many expected gaps before giving up on it; human think time is widely
# spread (p90 ~4-5x the median), so one gap would drop many returning sessions.
KEEP_GAPS = 3.0
MAX_KEEP_SECONDS = 900.0


@dataclass(frozen=True, slots=True)
class ArrivalPrediction:
    session_id: str
    # When the next request is expected (same clock as the events' ts).
    expected_arrival_ts: float
    # How long from now the context is worth keeping resident.
    keep_seconds: float
    # Probability that the session comes back at all within the keep window.
    p_return: float


class Predictor(Protocol):
    name: str

    def predict_one(self, session: SessionView, now: float) -> ArrivalPrediction: ...

    def predict_many(self, sessions: Sequence[SessionView], now: float) -> list[ArrivalPrediction]: ...


class HeuristicPredictor:
    """The session's median recent gap between turns, else a prior; no learning."""

    name = "heuristic"

    def __init__(self, prior_gap_seconds: float = PRIOR_GAP_SECONDS, keep_gaps: float = KEEP_GAPS,
                 max_keep_seconds: float = MAX_KEEP_SECONDS) -> None:
        self.prior_gap_seconds = prior_gap_seconds
        self.keep_gaps = keep_gaps
        self.max_keep_seconds = max_keep_seconds

    def predict_one(self, session: SessionView, now: float) -> ArrivalPrediction:
        gaps = session.inter_turn_gaps_seconds
        gap = statistics.median(gaps) if gaps else self.prior_gap_seconds
        last = session.recent_arrivals_ts[-1] if session.recent_arrivals_ts else session.last_activity_ts
        expected = max(last + gap, now)
        keep = min(max(expected - now, 0.0) + self.keep_gaps * gap, self.max_keep_seconds)
        p_return = 0.0 if session.state == "closed" else (0.6 if gaps else 0.4)
        return ArrivalPrediction(session.session_id, expected, keep, p_return)

    def predict_many(self, sessions: Sequence[SessionView], now: float) -> list[ArrivalPrediction]:
        return [self.predict_one(s, now) for s in sessions]
