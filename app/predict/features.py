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

import bisect
import math
import statistics

from app.state.base import SessionView, SignalView
from kvprefetch_client.events import SIGNAL_KINDS

NAN = float("nan")

# The question a row asks: does the session send its next request within `horizon_seconds`?
HORIZON_FEATURE = "horizon_seconds"

HISTORY_FEATURES: tuple[str, ...] = (
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

# A signal's follow-through is judged over this window: followed = a request within it.
SIGNAL_FOLLOW_SECONDS = 60.0
# The kinds with an age column of their own; a deployment's other kinds share "other".
SIGNAL_AGE_KINDS: tuple[str, ...] = (*SIGNAL_KINDS, "other")
# Signals of "this spell" are those after the session's latest arrival (or all of them, before
# its first): they announce the next request. Older ones teach how this session's signals went.
SIGNAL_FEATURES: tuple[str, ...] = (
    *(f"since_{kind}_signal_seconds" for kind in SIGNAL_AGE_KINDS),  # the latest this spell
    "signals_this_spell",
    "signal_expected_in_seconds",  # the latest estimate this spell, less its age (< 0: overdue)
    "signal_expected_prompt_tokens",
    "signal_lead_median_seconds",  # this session's past signals: signal to next arrival
    "signal_followed_share",  # of its past signals, followed within SIGNAL_FOLLOW_SECONDS
    "tool_lead_last_seconds",  # the tool now running: its latest lead in this session
)
SESSION_FEATURES: tuple[str, ...] = (*HISTORY_FEATURES, *SIGNAL_FEATURES)
FEATURES: tuple[str, ...] = (*SESSION_FEATURES, HORIZON_FEATURE)


def signal_kind_column(kind: str) -> int:
    """Which age column a signal kind fills: its own, or "other"."""
    return SIGNAL_AGE_KINDS.index(kind) if kind in SIGNAL_KINDS else len(SIGNAL_KINDS)


def signal_summary(view: SessionView) -> tuple[list[float], list[float]]:
    """A session's signals, clock-free: the static signal features (signals_this_spell onwards,
    without signal_expected_in_seconds) and the clock references (the ts of the latest signal of
    each SIGNAL_AGE_KINDS this spell, then the time its latest estimate points at), NaN for none.

    The FeatureTable keeps this per session and ages it at each tick; `session_features` ages it
    at once."""
    seen = sorted(view.signals, key=lambda s: s.ts)
    arrivals = sorted(view.recent_arrivals_ts)
    last_arrival = arrivals[-1] if arrivals else -math.inf
    spell = [s for s in seen if s.ts > last_arrival]
    latest_ts = [NAN] * len(SIGNAL_AGE_KINDS)
    for s in spell:
        latest_ts[signal_kind_column(s.kind)] = s.ts
    estimates = [s.ts + s.expected_in_seconds for s in spell if s.expected_in_seconds is not None]
    sizes = [s.expected_prompt_tokens for s in spell if s.expected_prompt_tokens is not None]
    # Leads of past signals whose next arrival is among the arrivals the session keeps (a signal
    # at the last arrival's very ts precedes none of them).
    leads: list[tuple[SignalView, float]] = [
        (s, arrivals[bisect.bisect_right(arrivals, s.ts)] - s.ts)
        for s in seen
        if arrivals and arrivals[0] <= s.ts < last_arrival
    ]
    running_tool = next(
        (s.tool for s in reversed(spell) if s.kind == "tool_started" and s.tool), None
    )
    tool_leads = [lead for s, lead in leads if s.kind == "tool_started" and s.tool == running_tool]
    static = [
        float(len(spell)),
        float(sizes[-1]) if sizes else NAN,
        statistics.median(lead for _, lead in leads) if leads else NAN,
        sum(lead <= SIGNAL_FOLLOW_SECONDS for _, lead in leads) / len(leads) if leads else NAN,
        tool_leads[-1] if running_tool is not None and tool_leads else NAN,
    ]
    return static, [*latest_ts, estimates[-1] if estimates else NAN]


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
    signals, refs = signal_summary(view)
    ages = [max(now - ts, 0.0) if not math.isnan(ts) else NAN for ts in refs[:-1]]
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
        *ages,
        signals[0],
        refs[-1] - now,  # NaN stays NaN
        *signals[1:],
    ]
