"""The deployment's own tool run times: per tool, how long its calls take, learned from the
`session_signal`s agent frameworks post (issue 28, point 6).

A **run** is a `tool_started` (with `tool`, its name) to the session's next `tool_finished` (of
that tool when the finish names one, else the session's oldest run), or, when no finish comes,
to the session's next `request_routed` (the agent's next call: every run of the session ends
there). Times are event times (`ts`), never the wall clock, so the service (fed by the ingest, in
the order accepted) and a replay of the event log in time order (training/dataset.py's
`load_events`, then `observe`) build the same state from the same events.

Bounded whatever clients send:

- **Tools.** The `tracked` most frequent tools each keep their own distribution; the rest are
  pooled as `other` (a tool named `other`, or a start without a `tool`, always is). Frequencies
  are tool_started counts: exact for the tracked tools, the Space-Saving estimate (Metwally et
  al., 2005: `4 x tracked` counters) for the rest. An untracked tool takes the least frequent
  tracked one's place once it is PROMOTE_RATIO times as frequent (so two tools of about the same
  frequency do not swap at every call); the one it displaces has its distribution merged into
  `other` and its recent returns dropped; the newcomer starts empty.
- **Distributions.** Counts in fixed log-spaced buckets (BUCKET_BOUNDS_SECONDS: 0.01 s to
  10,000 s, 8 a decade, and one above), with the smallest and largest run: quantiles and the CDF
  interpolate inside a bucket on a log scale, clamped to the runs seen (so 20 runs of 5 s give a
  median of exactly 5 s). From them, P(returned within t | running for s) = (F(s+t) - F(s)) /
  (1 - F(s)), the conditional median, and the predicted return of a run in flight: its start
  plus the conditional median of its tool given how long it has run (None once it has outlasted
  every run seen).
- **In flight.** At most `max_in_flight` runs (the oldest expire first), MAX_RUNS_PER_SESSION per
  session; a run still open `max_run_seconds` after its start (by the newest event time seen)
  expires, as do a closed session's. Expired runs are counted (`expired`), never measured.
- **Returns.** The last `recent_returns` per tool: the return predicted at the start (the start
  plus the tool's median then) against the actual one.

The arrival model's tool features (TOOL_FEATURES, part of app/predict/features.py's FEATURES) are
read here (`features`), by the service from the engine's instance and by training from one fed
the same log (training/dataset.py), both built by `tool_durations_for` from the KVP_TOOLS_*
settings.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvprefetch_client.events import Event

if TYPE_CHECKING:
    from app.core.config import Settings

OTHER_TOOL = "other"
# 0.01 s to 10,000 s, 8 buckets a decade (each 1.33x the last); runs above fall in one more.
BUCKET_BOUNDS_SECONDS: tuple[float, ...] = tuple(0.01 * 10 ** (i / 8) for i in range(49))
# An untracked tool displaces the least frequent tracked one at this many times its frequency.
PROMOTE_RATIO = 1.5
# Space-Saving counters per tracked tool, for the untracked tools' frequencies.
CANDIDATES_PER_TRACKED = 4
# Parallel calls of one session in flight (an agent's parallel tools); more: its oldest expires.
MAX_RUNS_PER_SESSION = 16
# Runs of a tool before its distribution speaks for a call in flight (`outlooks`).
OUTLOOK_MIN_RUNS = 10
# Below this survival a distribution says nothing about a run (it outlasted every run seen).
_NO_SURVIVAL = 1e-9

# A session's tool call in flight, as the arrival model sees it (NaN without one; the two
# quantiles and the chance NaN too where its tool's runs say nothing: none seen, or none lasted
# so long). With several calls of a session in flight, the one expected back last: an agent calls
# the model again once every parallel call returned (as `outlooks` has it).
TOOL_FEATURES: tuple[str, ...] = (
    "tool_running_seconds",  # since the call started
    "tool_remaining_p50_seconds",  # its tool's conditional quantiles given the time run, less it
    "tool_remaining_p90_seconds",
    "tool_back_within_horizon_p",  # P(returned within the row's horizon | running so long)
    "tool_runs_seen",  # the runs its tool's distribution holds
)

# Told of each run measured: the tool's label and its seconds (the metrics' histogram).
ReturnHook = Callable[[str, float], None]


class RunTimes:
    """One label's run times: counts in BUCKET_BOUNDS_SECONDS's buckets, the count, the shortest
    and the longest run."""

    __slots__ = ("counts", "max_seconds", "min_seconds", "n", "sum_seconds")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKET_BOUNDS_SECONDS) + 1)
        self.n = 0
        self.min_seconds = math.inf
        self.max_seconds = -math.inf
        self.sum_seconds = 0.0

    def add(self, seconds: float) -> None:
        self.counts[bisect.bisect_right(BUCKET_BOUNDS_SECONDS, seconds)] += 1
        self.n += 1
        self.sum_seconds += seconds
        self.min_seconds = min(self.min_seconds, seconds)
        self.max_seconds = max(self.max_seconds, seconds)

    def merge(self, other: RunTimes) -> None:
        for i, c in enumerate(other.counts):
            self.counts[i] += c
        self.n += other.n
        self.sum_seconds += other.sum_seconds
        self.min_seconds = min(self.min_seconds, other.min_seconds)
        self.max_seconds = max(self.max_seconds, other.max_seconds)

    def _edges(self, i: int) -> tuple[float, float]:
        """Bucket i's range, clamped to the runs seen."""
        lo = BUCKET_BOUNDS_SECONDS[i - 1] if i > 0 else 0.0
        hi = BUCKET_BOUNDS_SECONDS[i] if i < len(BUCKET_BOUNDS_SECONDS) else self.max_seconds
        return max(lo, self.min_seconds), min(hi, self.max_seconds)

    def cdf(self, seconds: float) -> float | None:
        """F(seconds): the share of runs that took at most `seconds`; None with no run."""
        if self.n == 0:
            return None
        if seconds < self.min_seconds:
            return 0.0
        if seconds >= self.max_seconds:
            return 1.0
        below = 0.0
        for i, c in enumerate(self.counts):
            if not c:
                continue
            a, b = self._edges(i)
            if seconds >= b:
                below += c
            elif seconds > a:
                below += c * (math.log(seconds / a) / math.log(b / a) if a > 0 else seconds / b)
            else:
                break  # the buckets above start higher still
        return below / self.n

    def quantile(self, q: float) -> float | None:
        """The run time below which a share `q` (0-1) of the runs fall; None with no run."""
        if self.n == 0:
            return None
        target, cum = min(max(q, 0.0), 1.0) * self.n, 0
        for i, c in enumerate(self.counts):
            if not c:
                continue
            if cum + c >= target:
                a, b = self._edges(i)
                f = (target - cum) / c
                if a == b:
                    return a
                return a * (b / a) ** f if a > 0 else f * b
            cum += c
        return self.max_seconds

    def conditional_quantile(self, q: float, running_seconds: float) -> float | None:
        """The run time below which a share `q` of the runs that lasted past `running_seconds`
        fall (at least `running_seconds`); None with no run, or none that lasted so long."""
        below = self.cdf(running_seconds)
        if below is None or 1.0 - below <= _NO_SURVIVAL:
            return None
        at = self.quantile(below + q * (1.0 - below))
        # At least the time run: the interpolation's inverse only up to rounding.
        return None if at is None else max(at, running_seconds)

    def p_within(self, seconds: float, running_seconds: float) -> float | None:
        """P(returned within `seconds` more | running for `running_seconds`); None with no run,
        or none that lasted so long."""
        below = self.cdf(running_seconds)
        if below is None or 1.0 - below <= _NO_SURVIVAL:
            return None
        later = self.cdf(running_seconds + max(seconds, 0.0))
        assert later is not None
        return min(max((later - below) / (1.0 - below), 0.0), 1.0)

    def state(self) -> tuple[Any, ...]:
        return (tuple(self.counts), self.n, self.min_seconds, self.max_seconds, self.sum_seconds)


@dataclass(slots=True)
class _Run:
    session_id: str
    tool: str | None  # as posted
    started_at: float
    predicted_return_at: float | None  # at the start: the start plus its tool's median then


@dataclass(frozen=True, slots=True)
class RunningTool:
    """A tool call in flight: its session, the tool as posted, since when, and when it is
    predicted back now (None: it outlasted every run of its tool seen, or none was seen)."""

    session_id: str
    tool: str | None
    label: str
    started_at: float
    running_seconds: float
    predicted_return_at: float | None


@dataclass(frozen=True, slots=True)
class ToolReturn:
    """A run measured: the return predicted at its start (None: no run of its tool seen then)
    against the actual one."""

    started_at: float
    predicted_return_at: float | None
    returned_at: float


@dataclass(frozen=True, slots=True)
class ToolSummary:
    """One label's figures: runs measured, quantiles (None before the first), runs in flight,
    the latest returns (oldest first)."""

    tool: str
    calls: int
    p50_seconds: float | None
    p90_seconds: float | None
    in_flight: int
    returns: tuple[ToolReturn, ...] = field(default=())


class ToolDurations:
    """Per-tool run-time distributions and the tool calls in flight (module docstring). Fed by
    `observe`: the engine's ingest observer, or a replay of an event log in time order."""

    def __init__(
        self,
        *,
        tracked: int = 32,
        max_run_seconds: float = 3600.0,
        max_in_flight: int = 100_000,
        recent_returns: int = 16,
        on_return: ReturnHook | None = None,
    ) -> None:
        if tracked < 0:
            raise ValueError("tracked must be >= 0")
        if max_run_seconds <= 0:
            raise ValueError("max_run_seconds must be > 0")
        if max_in_flight < 1 or recent_returns < 1:
            raise ValueError("max_in_flight and recent_returns must be >= 1")
        self.tracked = tracked
        self.max_run_seconds = max_run_seconds
        self.max_in_flight = max_in_flight
        self.recent_returns = recent_returns
        self._on_return = on_return
        self._max_candidates = CANDIDATES_PER_TRACKED * tracked
        # tracked tool -> its tool_started count (exact since tracked, plus its estimate then)
        self._frequency: dict[str, int] = {}
        # untracked tool -> its Space-Saving estimate
        self._candidates: dict[str, int] = {}
        self._times: dict[str, RunTimes] = {OTHER_TOOL: RunTimes()}
        self._returns: dict[str, deque[ToolReturn]] = {OTHER_TOOL: deque(maxlen=recent_returns)}
        # every run in flight, oldest start first (as accepted); and each session's run ids
        self._runs: OrderedDict[int, _Run] = OrderedDict()
        self._sessions: dict[str, list[int]] = {}
        # tool as posted -> its runs in flight (keys bounded by max_in_flight)
        self._running_by_tool: dict[str | None, int] = {}
        self._next_id = 0
        self._newest = -math.inf
        self.expired = 0
        self.measured = 0
        # Bumped when the tracked set changes (the metrics' children follow it).
        self.labels_version = 0
        self._lock = threading.Lock()  # observe() on the store thread, reads on the loop

    # -- feeding --------------------------------------------------------------------------------

    def observe(self, events: Iterable[Event]) -> None:
        """The ingest observer: every accepted event, in order. Expiry runs per event, so the
        state does not depend on how the events were batched."""
        with self._lock:
            for e in events:
                if e.ts > self._newest:
                    self._newest = e.ts
                    if self._runs:
                        self._expire()
                if e.type == "session_signal":
                    if e.kind == "tool_started":
                        self._started(e.session_id, e.tool, e.ts)
                    elif e.kind == "tool_finished" and e.session_id in self._sessions:
                        self._finished(e.session_id, e.tool, e.ts)
                elif e.type == "request_routed":
                    if e.session_id in self._sessions:
                        self._routed(e.session_id, e.ts)
                elif e.type == "session_closed" and e.session_id in self._sessions:
                    for run_id in list(self._sessions[e.session_id]):
                        self._drop(run_id)

    def advance(self, ts: float) -> None:
        """Event time has reached `ts`: the runs `observe` would have expired by an event at `ts`
        expire (a replay that skips the events that do not concern tools: training/fleet.py)."""
        with self._lock:
            if ts > self._newest:
                self._newest = ts
                if self._runs:
                    self._expire()

    def _started(self, session_id: str, tool: str | None, ts: float) -> None:
        label = self._count(tool)
        if ts < self._newest - self.max_run_seconds:
            self.expired += 1  # posted too late to be measured
            return
        median = self._times[label].quantile(0.5)
        run_id, self._next_id = self._next_id, self._next_id + 1
        self._runs[run_id] = _Run(session_id, tool, ts, None if median is None else ts + median)
        held = self._sessions.setdefault(session_id, [])
        held.append(run_id)
        self._running_by_tool[tool] = self._running_by_tool.get(tool, 0) + 1
        if len(held) > MAX_RUNS_PER_SESSION:
            self._drop(held[0])
        while len(self._runs) > self.max_in_flight:
            self._drop(next(iter(self._runs)))

    def _finished(self, session_id: str, tool: str | None, ts: float) -> None:
        for run_id in self._sessions[session_id]:
            run = self._runs[run_id]
            if (tool is None or run.tool == tool) and run.started_at <= ts:
                self._end(run_id, ts)
                return

    def _routed(self, session_id: str, ts: float) -> None:
        for run_id in list(self._sessions[session_id]):
            if self._runs[run_id].started_at <= ts:  # a request before the start is not its end
                self._end(run_id, ts)

    def _end(self, run_id: int, ts: float) -> None:
        run = self._forget(run_id)
        label = self.label(run.tool)
        seconds = ts - run.started_at
        self._times[label].add(seconds)
        self.measured += 1
        self._returns[label].append(ToolReturn(run.started_at, run.predicted_return_at, ts))
        if self._on_return is not None:
            self._on_return(label, seconds)

    def _forget(self, run_id: int) -> _Run:
        run = self._runs.pop(run_id)
        left = self._running_by_tool[run.tool] - 1
        if left:
            self._running_by_tool[run.tool] = left
        else:
            del self._running_by_tool[run.tool]
        held = self._sessions[run.session_id]
        held.remove(run_id)
        if not held:
            del self._sessions[run.session_id]
        return run

    def _drop(self, run_id: int) -> None:
        self._forget(run_id)
        self.expired += 1

    def _expire(self) -> None:
        """Runs started more than max_run_seconds before the newest event time expire (the runs
        are in the order accepted: this stops at the first one still inside)."""
        floor = self._newest - self.max_run_seconds
        while self._runs:
            run_id, run = next(iter(self._runs.items()))
            if run.started_at >= floor:
                return
            self._drop(run_id)

    # -- which tools are tracked ----------------------------------------------------------------

    def label(self, tool: str | None) -> str:
        """The label a tool's runs are kept under: its name while tracked, else `other`."""
        return tool if tool is not None and tool in self._frequency else OTHER_TOOL

    def _count(self, tool: str | None) -> str:
        """Count a call of `tool`, tracking it when it is among the most frequent; its label."""
        if tool is None or tool == OTHER_TOOL or self.tracked == 0:
            return OTHER_TOOL
        if tool in self._frequency:
            self._frequency[tool] += 1
            return tool
        estimate = self._candidates.pop(tool, 0) + 1
        if len(self._frequency) < self.tracked:
            self._track(tool, estimate)
            return tool
        weakest = min(self._frequency, key=self._frequency.__getitem__)
        if estimate >= PROMOTE_RATIO * self._frequency[weakest]:
            self._untrack(weakest)
            self._track(tool, estimate)
            return tool
        self._candidate(tool, estimate)
        return OTHER_TOOL

    def _candidate(self, tool: str, estimate: int) -> None:
        if tool not in self._candidates and len(self._candidates) >= self._max_candidates:
            # Space-Saving: the least counted makes room, and its count carries over.
            least = min(self._candidates, key=self._candidates.__getitem__)
            estimate = max(estimate, self._candidates.pop(least) + 1)
        self._candidates[tool] = estimate

    def _track(self, tool: str, frequency: int) -> None:
        self._frequency[tool] = frequency
        self._times[tool] = RunTimes()
        self._returns[tool] = deque(maxlen=self.recent_returns)
        self.labels_version += 1

    def _untrack(self, tool: str) -> None:
        self._times[OTHER_TOOL].merge(self._times.pop(tool))
        del self._returns[tool]
        self._candidate(tool, self._frequency.pop(tool))
        self.labels_version += 1

    # -- reading --------------------------------------------------------------------------------

    def labels(self) -> list[str]:
        """The tracked tools, most frequent first, then `other`."""
        with self._lock:
            return self._labels()

    def _labels(self) -> list[str]:
        ranked = sorted(self._frequency, key=lambda t: -self._frequency[t])
        return [*ranked, OTHER_TOOL]

    @property
    def in_flight(self) -> int:
        return len(self._runs)

    def in_flight_by_label(self) -> dict[str, int]:
        """Runs in flight per label, every label listed."""
        with self._lock:
            return self._in_flight_by_label()

    def _in_flight_by_label(self) -> dict[str, int]:
        out = {t: self._running_by_tool.get(t, 0) for t in self._labels()[:-1]}
        out[OTHER_TOOL] = len(self._runs) - sum(out.values())
        return out

    def distribution(self, tool: str | None) -> RunTimes:
        """The run times `tool`'s calls are judged by (its own, or `other`'s); a copy."""
        with self._lock:
            copy = RunTimes()
            copy.merge(self._times[self.label(tool)])
            return copy

    def running(self, now: float, session_id: str | None = None) -> list[RunningTool]:
        """The calls in flight (a session's, or all), oldest first, with their predicted return
        as of `now` (event time: the service clock, or a replay's)."""
        with self._lock:
            ids = self._sessions.get(session_id, []) if session_id is not None else self._runs
            return [self._running(self._runs[i], now) for i in ids]

    def oldest_running(self, now: float, per_label: int) -> dict[str, list[RunningTool]]:
        """Per label, its `per_label` longest-running calls in flight, oldest first (as
        `running`); a label with none is left out."""
        with self._lock:
            out: dict[str, list[RunningTool]] = {}
            full, labels = 0, len(self._frequency) + 1
            for run in self._runs.values():
                listed = out.setdefault(self.label(run.tool), [])
                if len(listed) < per_label:
                    listed.append(self._running(run, now))
                    full += len(listed) == per_label
                    if full == labels:
                        break
            return out

    def _running(self, run: _Run, now: float) -> RunningTool:
        label = self.label(run.tool)
        running = max(now - run.started_at, 0.0)
        rest = self._times[label].conditional_quantile(0.5, running)
        return RunningTool(
            run.session_id,
            run.tool,
            label,
            run.started_at,
            running,
            None if rest is None else run.started_at + rest,
        )

    def p_back_within(self, session_id: str, seconds: float, now: float) -> float | None:
        """P(the session's tool returns within `seconds` of `now` | it has run since its start):
        of the session's oldest call in flight; None without one, or with nothing to go by."""
        with self._lock:
            held = self._sessions.get(session_id)
            if not held:
                return None
            run = self._runs[held[0]]
            times = self._times[self.label(run.tool)]
            return times.p_within(seconds, max(now - run.started_at, 0.0))

    def outlooks(
        self,
        seconds: Sequence[float],
        now: float,
        session_ids: Iterable[str],
        min_runs: int = OUTLOOK_MIN_RUNS,
    ) -> dict[str, list[float]]:
        """For each of `session_ids` with calls in flight: P(back within each of `seconds` of
        `now`), from its tools' distributions given how long each has run. An agent calls the
        model again once all of its parallel calls returned, so the chances multiply; and a share
        of runs never return (the agent stopped: expired), which scales them all. A session is
        left out when any of its calls has a tool with fewer than `min_runs` runs, or outlasted
        every run of its tool: there the distribution says nothing."""
        with self._lock:
            out: dict[str, list[float]] = {}
            returned = self.measured / (self.measured + self.expired) if self.measured else 0.0
            for session_id in session_ids:
                held = self._sessions.get(session_id)
                if not held:
                    continue
                curve = [returned] * len(seconds)
                for run_id in held:
                    run = self._runs[run_id]
                    times = self._times[self.label(run.tool)]
                    running = max(now - run.started_at, 0.0)
                    if times.n < min_runs or times.p_within(0.0, running) is None:
                        break
                    for j, t in enumerate(seconds):
                        curve[j] *= times.p_within(t, running) or 0.0
                else:
                    out[session_id] = curve
            return out

    @property
    def sessions_in_flight(self) -> int:
        """Sessions with a call in flight."""
        return len(self._sessions)

    def features(
        self, now: float, horizons: Sequence[float], session_ids: Iterable[str] | None = None
    ) -> dict[str, list[list[float]]]:
        """TOOL_FEATURES at `now` (event time), one row per horizon, of each session with a call
        in flight, of `session_ids` or all; a session without one is left out (all NaN)."""
        with self._lock:
            held = self._sessions
            ids = held if session_ids is None else [s for s in session_ids if s in held]
            return {s: self._features(held[s], now, horizons) for s in ids}

    def _features(
        self, run_ids: list[int], now: float, horizons: Sequence[float]
    ) -> list[list[float]]:
        # The call expected back last (TOOL_FEATURES); one nothing can be said of is that one
        # (the session's return is as unknown as its), the oldest first among equals.
        best: tuple[float, RunTimes, float, float | None] | None = None
        for run_id in run_ids:
            run = self._runs[run_id]
            times = self._times[self.label(run.tool)]
            running = max(now - run.started_at, 0.0)
            p50 = times.conditional_quantile(0.5, running)
            back = math.inf if p50 is None else run.started_at + p50
            if best is None or back > best[0]:
                best = (back, times, running, p50)
        assert best is not None  # a session is held only with a call in flight
        _, times, running, p50 = best
        if p50 is None:
            head = [running, math.nan, math.nan]
            return [[*head, math.nan, float(times.n)] for _ in horizons]
        p90 = times.conditional_quantile(0.9, running)
        assert p90 is not None  # the same survival as the median's
        head = [running, p50 - running, p90 - running]
        out = []
        for h in horizons:
            p = times.p_within(h, running)
            out.append([*head, math.nan if p is None else p, float(times.n)])
        return out

    def summaries(self) -> list[ToolSummary]:
        """Every label's figures, tracked tools most frequent first, then `other`."""
        with self._lock:
            in_flight = self._in_flight_by_label()
            return [
                ToolSummary(
                    label,
                    self._times[label].n,
                    self._times[label].quantile(0.5),
                    self._times[label].quantile(0.9),
                    in_flight[label],
                    tuple(self._returns[label]),
                )
                for label in self._labels()
            ]

    def state(self) -> dict[str, Any]:
        """Everything it holds, as plain values: equal for equal histories (online == offline)."""
        with self._lock:
            return {
                "frequency": list(self._frequency.items()),
                "candidates": list(self._candidates.items()),
                "times": {k: v.state() for k, v in self._times.items()},
                "returns": {k: list(v) for k, v in self._returns.items()},
                "runs": [
                    (r.session_id, r.tool, r.started_at, r.predicted_return_at)
                    for r in self._runs.values()
                ],
                "newest": self._newest,
                "expired": self.expired,
                "measured": self.measured,
            }


def tool_durations_for(settings: Settings, on_return: ReturnHook | None = None) -> ToolDurations:
    """A ToolDurations of the KVP_TOOLS_* settings: the engine's, and training's (the same
    settings, so the same features from the same events)."""
    return ToolDurations(
        tracked=settings.tools_tracked,
        max_run_seconds=settings.tool_max_run_seconds,
        max_in_flight=settings.tools_max_in_flight,
        on_return=on_return,
    )
