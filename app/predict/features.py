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
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from app.predict.tool_durations import TOOL_FEATURES, ToolDurations
from app.state.base import SessionView, SignalView
from kvprefetch_client.events import SIGNAL_KINDS, Event, RequestRouted, SessionSignal

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
# The deployment's, the same for every session at a moment (DeploymentSignals): whether this
# deployment sends signals at all. Without them "no signal this spell" means "not back soon"
# where signals are sent and nothing where none are, and a model cannot tell the two apart.
DEPLOYMENT_FEATURES: tuple[str, ...] = (
    "deployment_signalled_arrival_share",  # of recent arrivals, announced by a signal (0: none)
    "deployment_signals_per_arrival",  # recent signals per recent arrival (false alarms add)
    # How reliable each kind is here: of its recent signals judged (followed by an arrival of
    # the session within SIGNAL_FOLLOW_SECONDS, or not), the followed share; NaN for a kind not
    # seen. Beside a session's since_<kind>_signal_seconds, what its latest signal is worth in
    # this deployment, whatever the deployments the model was trained on made of that kind.
    *(f"deployment_{kind}_followed_share" for kind in SIGNAL_AGE_KINDS),
)
# Then the session's tool call in flight, read from the deployment's own tool run times
# (app/predict/tool_durations.py, TOOL_FEATURES: NaN without one), then the horizon.
FEATURES: tuple[str, ...] = (
    *SESSION_FEATURES,
    *DEPLOYMENT_FEATURES,
    *TOOL_FEATURES,
    HORIZON_FEATURE,
)
# "Recent", for the deployment's features: events weigh exp(-age / this), by event time.
DEPLOYMENT_WINDOW_SECONDS = 600.0
# A deployment's signals waiting for their session's arrival: at most this many sessions (the
# oldest go first past it); each waits at most SIGNAL_FOLLOW_SECONDS of event time anyway.
DEPLOYMENT_MAX_PENDING_SESSIONS = 100_000
# ... and at most this many waiting signals per session (a flood judges the oldest unfollowed).
PENDING_PER_SESSION = 8


class DeploymentSignals:
    """DEPLOYMENT_FEATURES: how much of the whole deployment's traffic its signals announce.

    Told every event the store applied, in the order it applied them (`observe`: the service's
    Ingestor calls it for each accepted batch, training/dataset.py for each event of a log), so
    the service and training compute the same numbers. Its own object, not a SessionView's: it
    is the deployment's, not a session's, and an in-process count costs neither store a key.

    An arrival (request_routed) counts as signalled when a signal of its session came at most
    SIGNAL_FOLLOW_SECONDS before it (and after the session's previous arrival: each signal
    announces one arrival). Arrivals, signalled arrivals and signals are summed with weights
    exp(-age / window_seconds), ages by event time (never the wall clock), so the features are
    ratios of decayed sums: the same between two events whatever the clock says. NaN before the
    first arrival; 0 where signals are not sent (the 'no signals here' value). Each signal is
    judged once: followed when an arrival of its session comes within SIGNAL_FOLLOW_SECONDS after
    it, not followed once that window has passed without one; each kind's followed share is of
    its judged signals, decayed the same way (NaN for a kind none of whose signals was judged).
    Memory: a few floats per kind column, and per session whose signals still wait, at most
    PENDING_PER_SESSION of them, for at most `max_pending_sessions` sessions.
    """

    def __init__(
        self,
        *,
        window_seconds: float = DEPLOYMENT_WINDOW_SECONDS,
        follow_seconds: float = SIGNAL_FOLLOW_SECONDS,
        max_pending_sessions: int = DEPLOYMENT_MAX_PENDING_SESSIONS,
    ) -> None:
        self.window_seconds = window_seconds
        self.follow_seconds = follow_seconds
        self.max_pending_sessions = max(max_pending_sessions, 1)
        self._ref_ts = -math.inf  # the newest event ts seen: the sums are as of then
        self._arrivals = 0.0
        self._signalled = 0.0
        self._signals = 0.0
        kinds = len(SIGNAL_AGE_KINDS)
        self._judged = [0.0] * kinds
        self._followed = [0.0] * kinds
        # session -> its signals (ts, kind column) not yet judged, oldest first; sessions in the
        # order their first waiting signal came.
        self._pending: OrderedDict[str, list[tuple[float, int]]] = OrderedDict()

    def __len__(self) -> int:
        """Sessions with a signal still waiting for its arrival (what the memory grows with)."""
        return len(self._pending)

    def observe(self, events: Iterable[Event]) -> None:
        """Take applied events, in the store's order; other types than routed and signal pass."""
        for e in events:
            if isinstance(e, RequestRouted):
                self.arrival(e.session_id, e.ts)
            elif isinstance(e, SessionSignal):
                self.signal(e.session_id, e.ts, e.kind)

    def _weight(self, ts: float) -> float:
        # Move the reference to the newest ts (scaling the sums down), or weigh an older event.
        if ts > self._ref_ts:
            if self._ref_ts > -math.inf:
                scale = math.exp(-(ts - self._ref_ts) / self.window_seconds)
                self._arrivals *= scale
                self._signalled *= scale
                self._signals *= scale
                self._judged = [x * scale for x in self._judged]
                self._followed = [x * scale for x in self._followed]
            self._ref_ts = ts
            self._forget(ts - self.follow_seconds)
            return 1.0
        return math.exp(-(self._ref_ts - ts) / self.window_seconds)

    def _judge(self, ts: float, column: int, followed: bool) -> None:
        weight = self._weight_of(ts)
        self._judged[column] += weight
        if followed:
            self._followed[column] += weight

    def _weight_of(self, ts: float) -> float:
        # An event's weight as of the reference, without moving it.
        return math.exp(-max(self._ref_ts - ts, 0.0) / self.window_seconds)

    def _forget(self, before_ts: float) -> None:
        """Signals whose window closed before `before_ts` are judged not followed; sessions past
        the bound go (their waiting signals judged not followed too)."""
        pending = self._pending
        while pending:
            session_id, waiting = next(iter(pending.items()))
            if waiting[0][0] >= before_ts and len(pending) <= self.max_pending_sessions:
                break
            del pending[session_id]
            keep = []
            for ts, column in waiting:
                if ts < before_ts or len(pending) >= self.max_pending_sessions:
                    self._judge(ts, column, followed=False)
                else:
                    keep.append((ts, column))
            if keep:
                pending[session_id] = keep  # re-queued behind the rest: its oldest is younger

    def signal(self, session_id: str, ts: float, kind: str = "other") -> None:
        self._signals += self._weight(ts)
        column = signal_kind_column(kind)
        if ts < self._ref_ts - self.follow_seconds:
            self._judge(ts, column, followed=False)  # its window closed before it came here
            return
        waiting = self._pending.pop(session_id, [])
        waiting.append((ts, column))
        waiting.sort()
        while len(waiting) > PENDING_PER_SESSION:  # a flood: the oldest are judged unfollowed
            old_ts, old_column = waiting.pop(0)
            self._judge(old_ts, old_column, followed=False)
        self._pending[session_id] = waiting
        self._forget(self._ref_ts - self.follow_seconds)

    def arrival(self, session_id: str, ts: float) -> None:
        weight = self._weight(ts)
        self._arrivals += weight
        waiting = self._pending.pop(session_id, None)
        if waiting is None:
            return
        later = []
        announced = False
        for signal_ts, column in waiting:
            if signal_ts > ts:  # a signal stamped after this arrival announces a later one
                later.append((signal_ts, column))
                continue
            followed = ts - signal_ts <= self.follow_seconds
            announced = announced or followed
            self._judge(signal_ts, column, followed)
        if announced:
            self._signalled += weight
        if later:
            self._pending[session_id] = later

    def features(self) -> list[float]:
        """DEPLOYMENT_FEATURES now (they change only with events), NaN before any arrival."""
        if self._arrivals <= 0.0:
            return [NAN] * len(DEPLOYMENT_FEATURES)
        return [
            self._signalled / self._arrivals,
            self._signals / self._arrivals,
            *(f / j if j > 0.0 else NAN for f, j in zip(self._followed, self._judged)),
        ]

    def followed_lower_bound(self, kind: str, z: float = 2.0) -> float:
        """How surely a signal of `kind` is followed here by an arrival within the follow window:
        the Wilson lower bound (z standard errors) of its followed share, its decayed count of
        judged signals taken as the sample size; 0 for a kind none of whose signals was judged.
        A bound, not the share: a few lucky signals must not make a kind look reliable."""
        column = signal_kind_column(kind)
        n = self._judged[column]
        if n <= 0.0:
            return 0.0
        share = min(self._followed[column] / n, 1.0)
        z2 = z * z
        centre = share + z2 / (2 * n)
        spread = z * math.sqrt(share * (1 - share) / n + z2 / (4 * n * n))
        return max((centre - spread) / (1 + z2 / n), 0.0)


def deployment_features(deployment: DeploymentSignals | None) -> list[float]:
    """DEPLOYMENT_FEATURES of `deployment`, NaN for every one without it (a caller that keeps
    none: a model trained on them reads LightGBM's missing value)."""
    return deployment.features() if deployment is not None else [NAN] * len(DEPLOYMENT_FEATURES)


def tool_features(
    tools: ToolDurations | None, session_id: str, now: float, horizons: Sequence[float]
) -> list[list[float]]:
    """TOOL_FEATURES of one session at `now`, one row per horizon; NaN without a call of it in
    flight (or without `tools`: a caller that keeps none)."""
    found = tools.features(now, horizons, (session_id,)) if tools is not None else {}
    return found.get(session_id) or [[NAN] * len(TOOL_FEATURES) for _ in horizons]


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
