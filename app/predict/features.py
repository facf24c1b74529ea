"""The features of a session at a moment: one module, for the service and for training.

Training (training/dataset.py) replays an event log through the service's own MemoryStore and
calls `session_features` on the store's SessionView at each decision point, exactly as the
service does on its live state. So a model never sees a feature the service computes differently
(tests/predict/test_features.py checks the parity). Many sessions at once go through
app/predict/feature_table.py (`feature_matrix`), which builds on the names and the reference here.

Every feature is relative (seconds since, ratios, counts): nothing depends on the wall-clock date
or on one trace's time of day, so a model trained on one trace can be judged on another.
"""

from __future__ import annotations

import math
import statistics

from app.state.base import SessionView

NAN = float("nan")

# The question a row asks: does the session send its next request within `horizon_seconds`?
HORIZON_FEATURE = "horizon_seconds"

SESSION_FEATURES: tuple[str, ...] = (
    "idle_seconds",  # since the session's last event (a finish, usually)
    "since_arrival_seconds",  # since its last request arrived
    "turns",
    "running",  # 1 while its latest request is queued or running
    "gap_last_seconds",  # the latest gap between two of its arrivals
    "gap_prev_seconds",
    "gap_median_seconds",
    "gap_min_seconds",
    "gap_max_seconds",
    "idle_over_gap_median",  # how late it is against its own habit
    "arrivals_decayed_60s",  # arrivals weighted exp(-age / 60 s)
    "arrivals_decayed_600s",
    "context_tokens",
    "last_prompt_tokens",
    "last_output_tokens",
    "last_service_seconds",  # routed to finished of the latest request
)
FEATURES: tuple[str, ...] = (*SESSION_FEATURES, HORIZON_FEATURE)


def session_features(view: SessionView, now: float) -> list[float]:
    """SESSION_FEATURES of one session at `now`, NaN where the history is too short."""
    arrivals = view.recent_arrivals_ts
    gaps = view.inter_turn_gaps_seconds
    last = view.last_request
    last_arrival = arrivals[-1] if arrivals else NAN
    median_gap = statistics.median(gaps) if gaps else NAN
    idle = max(now - view.last_activity_ts, 0.0)
    service = NAN
    if last is not None and last.routed_ts is not None and last.finished_ts is not None:
        service = max(last.finished_ts - last.routed_ts, 0.0)
    return [
        idle,
        max(now - last_arrival, 0.0) if arrivals else NAN,
        float(view.turns),
        1.0 if view.state in ("queued", "running") else 0.0,
        gaps[-1] if gaps else NAN,
        gaps[-2] if len(gaps) > 1 else NAN,
        median_gap,
        min(gaps) if gaps else NAN,
        max(gaps) if gaps else NAN,
        idle / median_gap if gaps and median_gap > 0 else NAN,
        sum(math.exp(-max(now - a, 0.0) / 60.0) for a in arrivals),
        sum(math.exp(-max(now - a, 0.0) / 600.0) for a in arrivals),
        float(view.context_tokens),
        float(last.prompt_tokens) if last is not None and last.prompt_tokens is not None else NAN,
        float(last.output_tokens) if last is not None and last.output_tokens is not None else NAN,
        service,
    ]
