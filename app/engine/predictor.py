"""Predictors of each live session's next request: how likely within a horizon, and when.

`predict_one` / `predict_many` in the style of river, plus `p_within`, the matrix the planner
uses: for each session and each horizon h, P(the next request arrives within h seconds).
The heuristic needs no model: it reads the session's own history. The learned predictor is a
LightGBM model over app.engine.features, trained from event logs (training/).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from app.core.errors import KvpError
from app.engine.features import FEATURES, feature_matrix
from app.engine.state.base import SessionView

# REFERENCE.md ("What real traffic looks like"): the gap to a conversation's next turn has a
# median of ~78-126 s; this is the prior for a session with no gap of its own yet.
PRIOR_GAP_SECONDS = 100.0
# The bundled model (`make model` rebuilds it); the service and `replay --policy learned` default to it.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent.parent / "models" / "default"
# The horizons a prediction is read at; beyond the last, a session counts as not returning.
HORIZON_GRID: tuple[float, ...] = (5.0, 15.0, 30.0, 60.0, 120.0, 180.0, 300.0, 600.0, 900.0)


# What a session that does not come back within the grid costs in expected wait: about an hour,
# so the chance of a return at all dominates the retention rank.
NO_SHOW_WAIT_SECONDS = 3600.0


class ModelError(KvpError):
    """A model that cannot serve: missing files, or features that differ from the service's."""


@dataclass(frozen=True, slots=True)
class ArrivalPrediction:
    session_id: str
    # P(next request within h) for h in HORIZON_GRID, non-decreasing.
    p_within: tuple[float, ...]
    # When the next request is expected, if it comes (the conditional median, same clock as ts).
    expected_arrival_ts: float
    # Expected seconds until the next request, a no-show counting as NO_SHOW_WAIT_SECONDS past the
    # grid: the retention rank (smaller: keep longer), Belady's next use in expectation.
    expected_wait_seconds: float

    @property
    def p_return(self) -> float:
        return self.p_within[-1]


class Predictor(Protocol):
    name: str

    def p_within(self, sessions: Sequence[SessionView], now: float, horizons: Sequence[float]) -> np.ndarray:
        """Shape (len(sessions), len(horizons))."""
        ...


def predictions_from_matrix(sessions: Sequence[SessionView], now: float, p: np.ndarray,
                            horizons: Sequence[float] = HORIZON_GRID) -> list[ArrivalPrediction]:
    p = np.maximum.accumulate(np.clip(p, 0.0, 1.0), axis=1)  # a longer wait can only add returns
    widths = np.diff(np.asarray([0.0, *horizons]))
    waits = ((1.0 - p) * widths).sum(axis=1) + (1.0 - p[:, -1]) * NO_SHOW_WAIT_SECONDS
    out = []
    for view, row, wait in zip(sessions, p, waits):
        half = row[-1] / 2.0
        k = int(np.searchsorted(row, half)) if row[-1] > 0 else len(horizons) - 1
        out.append(ArrivalPrediction(view.session_id, tuple(float(x) for x in row),
                                     now + horizons[min(k, len(horizons) - 1)], float(wait)))
    return out


class _PredictMixin:
    def predict_many(self, sessions: Sequence[SessionView], now: float) -> list[ArrivalPrediction]:
        if not sessions:
            return []
        return predictions_from_matrix(sessions, now, self.p_within(sessions, now, HORIZON_GRID))  # type: ignore[attr-defined]

    def predict_one(self, session: SessionView, now: float) -> ArrivalPrediction:
        return self.predict_many([session], now)[0]


class HeuristicPredictor(_PredictMixin):
    """The session's median recent gap between turns, else a prior; a fixed chance of return,
    until the session is `give_up_gaps` gaps late, when it counts as gone."""

    name = "heuristic"

    def __init__(self, prior_gap_seconds: float = PRIOR_GAP_SECONDS, give_up_gaps: float = 3.0) -> None:
        self.prior_gap_seconds = prior_gap_seconds
        self.give_up_gaps = give_up_gaps

    def p_within(self, sessions: Sequence[SessionView], now: float, horizons: Sequence[float]) -> np.ndarray:
        out = np.zeros((len(sessions), len(horizons)))
        for i, s in enumerate(sessions):
            if s.state == "closed":
                continue
            gaps = s.inter_turn_gaps_seconds
            gap = statistics.median(gaps) if gaps else self.prior_gap_seconds
            last = s.recent_arrivals_ts[-1] if s.recent_arrivals_ts else s.last_activity_ts
            if now - last > self.give_up_gaps * gap:
                continue
            due_in = max(last + gap - now, 0.0)
            p = 0.6 if gaps else 0.4
            out[i] = [p if h >= due_in else 0.0 for h in horizons]
        return out


class LearnedPredictor(_PredictMixin):
    """A LightGBM model of P(next request within horizon), from models/<version>/."""

    name = "learned"

    def __init__(self, model_dir: Path | str) -> None:
        import lightgbm as lgb

        self.model_dir = Path(model_dir)
        model_file = self.model_dir / "model.txt"
        if not model_file.is_file():
            raise ModelError(f"no model at {model_file}")
        try:
            self.booster = lgb.Booster(model_file=str(model_file))
        except lgb.basic.LightGBMError as exc:
            raise ModelError(f"{model_file} does not load: {exc}") from None
        names = tuple(self.booster.feature_name())
        if names != FEATURES:
            raise ModelError(f"{model_file} was trained on features {list(names)}; this service computes "
                             f"{list(FEATURES)}")
        card_file = self.model_dir / "card.json"
        self.card = json.loads(card_file.read_text()) if card_file.is_file() else {}
        self.version = self.model_dir.name

    def p_within(self, sessions: Sequence[SessionView], now: float, horizons: Sequence[float]) -> np.ndarray:
        if not sessions:
            return np.zeros((0, len(horizons)))
        x = feature_matrix(sessions, now, horizons)
        p = self.booster.predict(x, num_threads=1)
        out = p.reshape(len(sessions), len(horizons))
        closed = np.array([s.state == "closed" for s in sessions])
        out[closed] = 0.0
        return out
