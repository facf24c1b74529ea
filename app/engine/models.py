"""The predictor the service serves, and swapping it for another model without a gap."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from app.engine.predictor import HeuristicPredictor, LearnedPredictor, ModelError, Predictor
from app.engine.state.base import SessionView

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Serving:
    predictor: Predictor
    # What /readyz says: "learned (default)" or why the heuristic serves.
    description: str
    version: str | None


def _probe_session() -> SessionView:
    return SessionView(session_id="probe", state="idle", turns=2, first_seen_ts=0.0, last_activity_ts=60.0,
                       closed_ts=None, instance_id="probe", context_tokens=8000, context_bytes=0,
                       block_hashes=[1], block_tokens=512, recent_arrivals_ts=[0.0, 50.0],
                       inter_turn_gaps_seconds=[50.0], last_request=None, resident_blocks={})


def load_checked(model_dir: Path, sample: list[SessionView] | None = None) -> LearnedPredictor:
    """Load a model and make it answer for a sample of sessions before it may serve.

    Raises ModelError when the files are missing, do not load, compute other features, or give
    probabilities outside [0, 1].
    """
    model = LearnedPredictor(model_dir)
    sessions = sample or [_probe_session()]
    p = model.p_within(sessions, sessions[0].last_activity_ts + 30.0, (15.0, 60.0, 600.0))
    if p.shape != (len(sessions), 3) or not ((p >= 0) & (p <= 1)).all():
        raise ModelError(f"{model_dir}: the model's answers on a sample are not probabilities")
    return model


class ModelRegistry:
    """Holds the serving predictor; a reload replaces it in one assignment, or not at all."""

    def __init__(self, model_dir: Path) -> None:
        try:
            model = load_checked(model_dir)
            self.serving = Serving(model, f"learned ({model.version})", model.version)
        except ModelError as exc:
            log.warning("serving the heuristic: %s", exc)
            self.serving = Serving(HeuristicPredictor(), f"heuristic ({exc})", None)

    def reload(self, model_dir: Path, sample: list[SessionView] | None = None) -> Serving:
        model = load_checked(model_dir, sample)  # raises before anything changes
        self.serving = Serving(model, f"learned ({model.version})", model.version)
        log.info("now serving model %s from %s", model.version, model_dir)
        return self.serving
