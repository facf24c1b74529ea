"""The predictor the service serves, and swapping it for another model without a gap."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from app.engine.advice import AdviceLedger
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


def load_checked(model_dir: Path, sample: Sequence[SessionView] = (),
                 now: float | None = None) -> LearnedPredictor:
    """Load a model and make it answer for a sample of sessions before it may serve.

    `sample` is live sessions from the store (the probe session when there are none), scored at
    `now`: a model that loads but breaks on the traffic it would serve is caught here, not after
    the swap. Raises ModelError when the files are missing, do not load, compute other features,
    or do not give probabilities in [0, 1] for every session of the sample.
    """
    model = LearnedPredictor(model_dir)
    if sample:
        sessions, what = list(sample), f"{len(sample)} live session{'s' if len(sample) != 1 else ''}"
    else:
        sessions, what = [_probe_session()], "the probe session"
    if now is None:
        now = max(s.last_activity_ts for s in sessions) + 30.0
    try:
        p = model.p_within(sessions, now, (15.0, 60.0, 600.0))
    except Exception as exc:  # a model that breaks on real sessions is refused, not served
        raise ModelError(f"{model_dir}: the model fails on {what}: {exc!r}") from None
    if p.shape != (len(sessions), 3) or not ((p >= 0) & (p <= 1)).all():
        raise ModelError(f"{model_dir}: the model's answers on {what} are not probabilities")
    return model


class ModelRegistry:
    """Holds the serving predictor and the shadow beside it; a swap replaces one in a single
    assignment, or nothing at all, and starts that model's advice ledger afresh."""

    def __init__(self, model_dir: Path, shadow_dir: Path | None = None, *,
                 ledger: AdviceLedger | None = None) -> None:
        self.ledger = ledger if ledger is not None else AdviceLedger()
        try:
            model = load_checked(model_dir)
            self.serving = Serving(model, f"learned ({model.version})", model.version)
        except ModelError as exc:
            log.warning("serving the heuristic: %s", exc)
            self.serving = Serving(HeuristicPredictor(), f"heuristic ({exc})", None)
        # The shadow is scored beside the serving model and never advises anyone.
        self.shadow: Serving | None = None
        # Why the configured shadow is not there; a shadow that fails never stops the service.
        self.shadow_problem: str | None = None
        if shadow_dir is not None:
            try:
                self.set_shadow(shadow_dir)
            except ModelError as exc:
                log.warning("no shadow model: %s", exc)
                self.shadow_problem = str(exc)

    def reload(self, model_dir: Path, sample: Sequence[SessionView] = (),
               now: float | None = None) -> Serving:
        model = load_checked(model_dir, sample, now)  # raises before anything changes
        self.serving = Serving(model, f"learned ({model.version})", model.version)
        self.ledger.start("live")
        log.info("now serving model %s from %s", model.version, model_dir)
        return self.serving

    def set_shadow(self, model_dir: Path, sample: Sequence[SessionView] = (),
                   now: float | None = None) -> Serving:
        model = load_checked(model_dir, sample, now)
        self.shadow = Serving(model, f"learned ({model.version})", model.version)
        self.shadow_problem = None
        self.ledger.start("shadow")
        log.info("shadowing model %s from %s", model.version, model_dir)
        return self.shadow

    def clear_shadow(self) -> None:
        self.shadow, self.shadow_problem = None, None
        self.ledger.stop("shadow")
