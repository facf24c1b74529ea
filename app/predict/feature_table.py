"""The features of many live sessions at once, columnar, so a planner tick costs numpy, not Python.

`session_features` (app/predict/features.py) stays the reference: readable, one session at a
time, what training reads. This table computes the same numbers (tests/predict/test_features.py
checks the parity) by splitting them in two:

- what changes only when the session does (turns, gap statistics, tokens, service time, the
  reference timestamps): computed once per change, by `upsert(view)`, or for many views at once;
- what changes with the clock (idle and since-arrival seconds, how late against the median gap,
  the decayed arrival counts): computed for every row at once by `matrix(now, horizons)`.

A decayed count sum(exp(-(now - a) / tau)) over a session's arrivals is kept as its value at the
session's newest arrival `ref`; at any `now >= ref` it is that value times exp(-(now - ref) / tau),
one multiply per session and tau. Rows whose newest arrival is after `now` (the reference clamps
each age at zero) are recomputed term by term: a tick never sees them, a replay seldom does.

`feature_matrix(views, now, horizons)`, the bulk entry point, picks between the two: the
reference for a few views, a table built for the call from many.

Beside the features, each row holds what an advisor reads of the session without the model (its
state, how many context blocks, its latest signal's time: `advisor_columns`) and `marks`, columns
a caller owns (the scoring loop's record of the advice it last handed on), reset to NaN whenever
the row is upserted: a changed session is news to whoever keeps them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import chain
from operator import attrgetter
from typing import cast

import numpy as np

from app.predict.features import (
    DEPLOYMENT_FEATURES,
    FEATURES,
    SESSION_FEATURES,
    SIGNAL_AGE_KINDS,
    session_features,
    signal_summary,
    tool_features,
)
from app.predict.tool_durations import ToolDurations
from app.state.base import SessionView

NAN = float("nan")
_VIEW_FIELDS = attrgetter("turns", "state", "context_tokens", "last_activity_ts", "last_request")
_REQUEST_FIELDS = attrgetter("prompt_tokens", "output_tokens", "routed_ts", "finished_ts")
RUNNING_STATES = ("queued", "running")
# The decayed-arrival features and their time constants, as session_features computes them.
DECAYED_FEATURES: tuple[tuple[str, float], ...] = (
    ("arrivals_decayed_60s", 60.0),
    ("arrivals_decayed_600s", 600.0),
)

_COL = {name: i for i, name in enumerate(SESSION_FEATURES)}
_IDLE = _COL["idle_seconds"]
_SINCE_ARRIVAL = _COL["since_arrival_seconds"]
_GAP_MEDIAN = _COL["gap_median_seconds"]
_IDLE_OVER_MEDIAN = _COL["idle_over_gap_median"]
# Columns filled per session change, in the order _static_row returns them.
_STATIC_COLUMNS = tuple(
    _COL[name]
    for name in (
        "turns",
        "running",
        "gap_last_seconds",
        "gap_prev_seconds",
        "gap_median_seconds",
        "gap_min_seconds",
        "gap_max_seconds",
        "context_tokens",
        "last_prompt_tokens",
        "last_output_tokens",
        "last_service_seconds",
        # signal_summary's static part, in its order
        "signals_this_spell",
        "signal_expected_prompt_tokens",
        "signal_lead_median_seconds",
        "signal_followed_share",
        "tool_lead_last_seconds",
    )
)
_SIGNAL_STATIC = slice(11, len(_STATIC_COLUMNS))
# No signals: none this spell, the rest unknown.
_NO_SIGNAL_STATIC = (0.0, NAN, NAN, NAN, NAN)
_SIGNAL_AGE_COLUMNS = [_COL[f"since_{kind}_signal_seconds"] for kind in SIGNAL_AGE_KINDS]
_EXPECTED_IN = _COL["signal_expected_in_seconds"]
# Per-row clock references (the second list _static_row returns), by position:
# last activity, last arrival (NaN: none), newest arrival (-inf: none, so every decayed sum
# scales to 0 without a special case), each decayed sum as of the newest arrival, then
# signal_summary's references (the latest signal of each kind this spell, the estimate's due
# time; NaN: none).
_LAST_ACTIVITY, _LAST_ARRIVAL, _DECAY_REF, _DECAY_SUMS = 0, 1, 2, 3
_SIGNAL_TS = _DECAY_SUMS + len(DECAYED_FEATURES)
_SIGNAL_DUE = _SIGNAL_TS + len(SIGNAL_AGE_KINDS)
_AUX = _SIGNAL_DUE + 1
# A session's state as a number, for the advisor's columns.
STATE_CODES = {"idle": 0, "queued": 1, "running": 2, "closed": 3}


def _median(values: Sequence[float]) -> float:
    # statistics.median's arithmetic, so the same float, without its type dispatch.
    s = sorted(values)
    k = len(s) // 2
    return s[k] if len(s) % 2 else (s[k - 1] + s[k]) / 2


def _static_row(view: SessionView) -> tuple[list[float], list[float], bool]:
    """One session's clock-free columns, its clock references, and whether it is closed."""
    arrivals = view.recent_arrivals_ts
    gaps = view.inter_turn_gaps_seconds
    last = view.last_request
    service = NAN
    if last is not None and last.routed_ts is not None and last.finished_ts is not None:
        service = max(last.finished_ts - last.routed_ts, 0.0)
    static = [
        float(view.turns),
        1.0 if view.state in RUNNING_STATES else 0.0,
        gaps[-1] if gaps else NAN,
        gaps[-2] if len(gaps) > 1 else NAN,
        _median(gaps) if gaps else NAN,
        min(gaps) if gaps else NAN,
        max(gaps) if gaps else NAN,
        float(view.context_tokens),
        float(last.prompt_tokens) if last is not None and last.prompt_tokens is not None else NAN,
        float(last.output_tokens) if last is not None and last.output_tokens is not None else NAN,
        service,
    ]
    if view.signals:
        signal_static, signal_refs = signal_summary(view)
    else:
        signal_static, signal_refs = list(_NO_SIGNAL_STATIC), [NAN] * (len(SIGNAL_AGE_KINDS) + 1)
    static.extend(signal_static)
    if arrivals:
        ref = max(arrivals)
        aux = [
            view.last_activity_ts,
            arrivals[-1],
            ref,
            *(sum(math.exp(-(ref - a) / tau) for a in arrivals) for _, tau in DECAYED_FEATURES),
        ]
    else:
        aux = [view.last_activity_ts, NAN, -math.inf, *(0.0 for _ in DECAYED_FEATURES)]
    aux.extend(signal_refs)
    return static, aux, view.state == "closed"


class FeatureTable:
    """Live sessions' features as columns; rows in `session_ids` order.

    Keep it current with `upsert(view)` whenever a session changes and `remove(session_id)` when
    it goes; `matrix(now, horizons)` then builds the model's input for every row (or some rows)
    with a handful of numpy operations. `FeatureTable.from_views(views)` builds one in bulk.
    """

    def __init__(self, capacity: int = 1024, *, marks: int = 0) -> None:
        capacity = max(capacity, 1)
        self._static = np.full((capacity, len(SESSION_FEATURES)), NAN)
        self._aux = np.zeros((capacity, _AUX))
        self._closed = np.zeros(capacity, dtype=bool)
        # The advisor's columns: state code, context blocks, latest signal ts (NaN: none).
        self._state = np.zeros(capacity, dtype=np.int8)
        self._blocks = np.zeros(capacity, dtype=np.int64)
        self._signal_ts = np.full(capacity, NAN)
        self._marks = np.full((capacity, marks), NAN)
        # Arrival times per row, read only for rows whose newest arrival is after `now`.
        self._arrivals: list[Sequence[float]] = []
        self._ids: list[str] = []
        self._row: dict[str, int] = {}
        # Rows removed since the table was made: while it holds still, no row has moved.
        self.removals = 0

    @classmethod
    def from_views(cls, views: Sequence[SessionView]) -> FeatureTable:
        table = cls(capacity=len(views))
        table.upsert_many(views)
        return table

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._row

    @property
    def session_ids(self) -> list[str]:
        """Session ids in row order (a copy: removals move rows)."""
        return list(self._ids)

    def rows_of(self, session_ids: Iterable[str]) -> np.ndarray:
        """Row indices of these sessions, for `matrix(rows=...)`; KeyError for one not held."""
        return np.fromiter((self._row[s] for s in session_ids), dtype=np.intp)

    def row(self, session_id: str) -> int | None:
        """The session's row, None when not held."""
        return self._row.get(session_id)

    def ids_of(self, rows: np.ndarray) -> list[str]:
        """The session ids of these rows, in that order."""
        ids = self._ids
        return [ids[r] for r in rows.tolist()]

    def advisor_columns(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For these rows: the state code (STATE_CODES), the context's block count, and the
        last activity ts; `signal_ts(rows)` has the latest signal's."""
        return self._state[rows], self._blocks[rows], self._aux[rows, _LAST_ACTIVITY]

    def signal_ts(self, rows: np.ndarray) -> np.ndarray:
        """The ts of each row's latest signal (the greatest; NaN: none)."""
        return self._signal_ts[rows]

    @property
    def marks(self) -> np.ndarray:
        """The caller's columns, one row per session (a view: write through it)."""
        return self._marks[: len(self._ids)]

    def closed(self, rows: np.ndarray | None = None) -> np.ndarray:
        """Whether each row's session is closed (the predictor answers 0 for those)."""
        n = len(self._ids)
        return self._closed[:n].copy() if rows is None else self._closed[rows]

    def upsert(self, view: SessionView) -> None:
        """Add the session or replace its row: a few microseconds of Python."""
        static, aux, closed = _static_row(view)
        row = self._row.get(view.session_id)
        if row is None:
            row = self._append(view.session_id, view.recent_arrivals_ts)
        else:
            self._arrivals[row] = view.recent_arrivals_ts
        self._static[row, _STATIC_COLUMNS] = static
        self._aux[row] = aux
        self._closed[row] = closed
        self._state[row] = STATE_CODES[view.state]
        self._blocks[row] = len(view.block_hashes)
        self._signal_ts[row] = view.signals[-1].ts if view.signals else NAN
        self._marks[row] = NAN

    def upsert_many(self, views: Sequence[SessionView]) -> None:
        """`upsert` for each view (the last wins for a repeated id), vectorised over the views."""
        if len({v.session_id for v in views}) != len(views):
            for view in views:
                self.upsert(view)
            return
        ids = [v.session_id for v in views]
        found = list(map(self._row.get, ids))
        new = [i for i, row in enumerate(found) if row is None]
        first = len(self._ids)
        if first + len(new) > len(self._static):
            self._grow(max(2 * len(self._static), first + len(new)))
        for k, i in enumerate(new):
            found[i] = first + k
        rows = cast(list[int], found)  # every None was just given its new row
        self._ids.extend(ids[i] for i in new)
        self._row.update((ids[i], first + k) for k, i in enumerate(new))
        self._arrivals.extend(views[i].recent_arrivals_ts for i in new)
        for view, row in zip(views, rows):
            if row < first:
                self._arrivals[row] = view.recent_arrivals_ts
        static, aux, closed = _static_columns(views)
        self._static[np.ix_(rows, _STATIC_COLUMNS)] = static
        self._aux[rows] = aux
        self._closed[rows] = closed
        self._state[rows] = [STATE_CODES[v.state] for v in views]
        self._blocks[rows] = [len(v.block_hashes) for v in views]
        self._signal_ts[rows] = [v.signals[-1].ts if v.signals else NAN for v in views]
        self._marks[rows] = NAN

    def remove(self, session_id: str) -> bool:
        """Drop the session's row (the last row moves into its place); False if not held."""
        row = self._row.pop(session_id, None)
        if row is None:
            return False
        self.removals += 1
        last = len(self._ids) - 1
        if row != last:
            moved = self._ids[last]
            self._static[row] = self._static[last]
            self._aux[row] = self._aux[last]
            self._closed[row] = self._closed[last]
            self._state[row] = self._state[last]
            self._blocks[row] = self._blocks[last]
            self._signal_ts[row] = self._signal_ts[last]
            self._marks[row] = self._marks[last]
            self._arrivals[row] = self._arrivals[last]
            self._ids[row] = moved
            self._row[moved] = row
        self._ids.pop()
        self._arrivals.pop()
        return True

    def session_matrix(self, now: float, rows: np.ndarray | None = None) -> np.ndarray:
        """SESSION_FEATURES at `now`, one row per session (all rows, or `rows` in that order)."""
        n = len(self._ids)
        take = slice(0, n) if rows is None else np.asarray(rows, dtype=np.intp)
        x = self._static[take].copy()
        aux = self._aux[take]
        idle = np.maximum(now - aux[:, _LAST_ACTIVITY], 0.0)
        x[:, _IDLE] = idle
        x[:, _SINCE_ARRIVAL] = np.maximum(now - aux[:, _LAST_ARRIVAL], 0.0)  # NaN stays NaN
        median = x[:, _GAP_MEDIAN]
        x[:, _IDLE_OVER_MEDIAN] = np.divide(
            idle, median, out=np.full(len(x), NAN), where=median > 0
        )
        ref = aux[:, _DECAY_REF]
        age = np.maximum(now - ref, 0.0)  # inf for no arrivals: the scale is 0
        for k, (name, tau) in enumerate(DECAYED_FEATURES):
            x[:, _COL[name]] = np.exp(-age / tau) * aux[:, _DECAY_SUMS + k]
        # NaN (no such signal) stays NaN through the subtraction and np.maximum.
        x[:, _SIGNAL_AGE_COLUMNS] = np.maximum(now - aux[:, _SIGNAL_TS:_SIGNAL_DUE], 0.0)
        x[:, _EXPECTED_IN] = aux[:, _SIGNAL_DUE] - now
        late = np.flatnonzero(ref > now)
        if len(late):
            taken = np.arange(n) if rows is None else cast(np.ndarray, take)  # rows: an array
            for i, row in zip(late, taken[late]):
                arrivals = self._arrivals[row]
                for name, tau in DECAYED_FEATURES:
                    x[i, _COL[name]] = sum(math.exp(-max(now - a, 0.0) / tau) for a in arrivals)
        return x

    def matrix(
        self,
        now: float,
        horizons: Sequence[float],
        rows: np.ndarray | None = None,
        deployment: Sequence[float] | None = None,
        tools: ToolDurations | None = None,
    ) -> np.ndarray:
        """FEATURES at `now`: one row per (session, horizon), sessions outer, as
        `feature_matrix`; `deployment`: the DEPLOYMENT_FEATURES values (NaN without); `tools`:
        what the TOOL_FEATURES are read from (NaN without)."""
        base = self.session_matrix(now, rows)
        h = np.asarray(horizons, dtype=np.float64)
        out = np.empty((len(base), len(h), len(FEATURES)))
        out[:, :, : len(SESSION_FEATURES)] = base[:, None, :]
        out[:, :, len(SESSION_FEATURES) : _TOOLS] = _deployment_values(deployment)
        out[:, :, _TOOLS:-1] = NAN
        if tools is not None and tools.sessions_in_flight and len(base):
            self._fill_tools(out[:, :, _TOOLS:-1], tools, now, horizons, rows)
        out[:, :, -1] = h
        return out.reshape(len(base) * len(h), len(FEATURES))

    def _fill_tools(
        self,
        out: np.ndarray,
        tools: ToolDurations,
        now: float,
        horizons: Sequence[float],
        rows: np.ndarray | None,
    ) -> None:
        """The TOOL_FEATURES of the rows whose sessions have a call in flight, into `out`
        (rows by horizons by TOOL_FEATURES). Whichever is fewer is walked: the sessions in
        flight, or the rows asked for (a tick's chunk is a few of many)."""
        rows = None if rows is None else np.asarray(rows, dtype=np.intp)
        n = len(self._ids) if rows is None else len(rows)
        asked = None
        if tools.sessions_in_flight >= n:
            asked = self._ids if rows is None else self.ids_of(rows)
        found = tools.features(now, horizons, asked)
        if rows is None:
            for session_id, values in found.items():
                row = self._row.get(session_id)
                if row is not None:
                    out[row] = values
            return
        held = np.fromiter((self._row.get(s, -1) for s in found), dtype=np.intp, count=len(found))
        ids = self._ids
        for i in np.flatnonzero(np.isin(rows, held)).tolist():
            out[i] = found[ids[rows[i]]]

    def _append(self, session_id: str, arrivals: Sequence[float]) -> int:
        row = len(self._ids)
        if row == len(self._static):
            self._grow(2 * row)
        self._ids.append(session_id)
        self._arrivals.append(arrivals)
        self._row[session_id] = row
        return row

    def _grow(self, capacity: int) -> None:
        n = len(self._static)
        static = np.full((capacity, len(SESSION_FEATURES)), NAN)
        static[:n] = self._static
        aux = np.zeros((capacity, _AUX))
        aux[:n] = self._aux
        closed = np.zeros(capacity, dtype=bool)
        closed[:n] = self._closed
        self._static, self._aux, self._closed = static, aux, closed
        self._state = np.concatenate([self._state, np.zeros(capacity - n, dtype=np.int8)])
        self._blocks = np.concatenate([self._blocks, np.zeros(capacity - n, dtype=np.int64)])
        self._signal_ts = np.concatenate([self._signal_ts, np.full(capacity - n, NAN)])
        self._marks = np.concatenate(
            [self._marks, np.full((capacity - n, self._marks.shape[1]), NAN)]
        )


_TOOLS = len(SESSION_FEATURES) + len(DEPLOYMENT_FEATURES)  # the first TOOL_FEATURES column

# Below this many sessions the per-session reference is quicker than numpy's fixed costs
# (they crossed between 32 and 64 sessions on the 2-core development machine).
VECTORISE_FROM_SESSIONS = 48


def _deployment_values(deployment: Sequence[float] | None) -> list[float]:
    if deployment is None:
        return [NAN] * len(DEPLOYMENT_FEATURES)
    if len(deployment) != len(DEPLOYMENT_FEATURES):
        raise ValueError(f"{len(deployment)} deployment values for {list(DEPLOYMENT_FEATURES)}")
    return list(deployment)


def feature_matrix(
    views: Sequence[SessionView],
    now: float,
    horizons: Sequence[float],
    deployment: Sequence[float] | None = None,
    tools: ToolDurations | None = None,
) -> np.ndarray:
    """One row per (session, horizon), sessions outer: rows[i * len(horizons) + j].

    Equal to `session_features` row by row, then `deployment` (DeploymentSignals.features(),
    the same for every row; NaN when not given), then `tool_features` of `tools` (NaN when not
    given), then the horizon; many sessions go through the columnar FeatureTable, which
    computes the same numbers with numpy.
    """
    shared = _deployment_values(deployment)
    if len(views) >= VECTORISE_FROM_SESSIONS:
        return FeatureTable.from_views(views).matrix(now, horizons, deployment=shared, tools=tools)
    rows = []
    for view in views:
        base = [*session_features(view, now), *shared]
        by_horizon = tool_features(tools, view.session_id, now, horizons)
        for h, tool in zip(horizons, by_horizon):
            rows.append([*base, *tool, float(h)])
    return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(FEATURES))


def _segments(
    lists: Sequence[Sequence[float]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Flattened values, each list's start and length, and which lists are non-empty."""
    lengths = np.fromiter(map(len, lists), dtype=np.intp, count=len(lists))
    flat = np.fromiter(chain.from_iterable(lists), dtype=np.float64, count=int(lengths.sum()))
    starts = np.cumsum(lengths) - lengths
    return flat, starts, lengths, lengths > 0


def _static_columns(views: Sequence[SessionView]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """_static_row for many views at once: segmented numpy over the flattened gaps and arrivals."""
    n = len(views)
    static = np.full((n, len(_STATIC_COLUMNS)), NAN)
    aux = np.zeros((n, _AUX))
    # attrgetter and plain lists: attribute access on 10,000 views is most of the cost here.
    turns, states, context, activity, lasts = zip(*map(_VIEW_FIELDS, views)) if n else ((),) * 5
    static[:, 0] = turns
    static[:, 1] = [s in RUNNING_STATES for s in states]
    static[:, 7] = context
    aux[:, _LAST_ACTIVITY] = activity
    static[:, _SIGNAL_STATIC] = _NO_SIGNAL_STATIC
    aux[:, _SIGNAL_TS:] = NAN
    for i, view in enumerate(views):
        if view.signals:  # a few sessions at a time have any: Python for those only
            signal_static, signal_refs = signal_summary(view)
            static[i, _SIGNAL_STATIC] = signal_static
            aux[i, _SIGNAL_TS:] = signal_refs
    closed = np.array([s == "closed" for s in states], dtype=bool)
    with_last = [i for i, r in enumerate(lasts) if r is not None]
    if with_last:
        fields = np.array(
            [_REQUEST_FIELDS(lasts[i]) for i in with_last], dtype=np.float64
        )  # None -> NaN
        static[with_last, 8] = fields[:, 0]
        static[with_last, 9] = fields[:, 1]
        static[with_last, 10] = np.maximum(fields[:, 3] - fields[:, 2], 0.0)  # NaN stays NaN

    gaps, starts, lengths, has = _segments([v.inter_turn_gaps_seconds for v in views])
    if has.any():
        ends = starts + lengths
        static[has, 2] = gaps[ends[has] - 1]
        two = lengths > 1
        static[two, 3] = gaps[ends[two] - 2]
        segment = np.repeat(np.arange(n), lengths)
        ordered = gaps[np.lexsort((gaps, segment))]
        mid = starts[has] + lengths[has] // 2
        odd = lengths[has] % 2 == 1
        below = ordered[np.where(odd, mid, mid - 1)]
        static[has, 4] = np.where(odd, ordered[mid], (below + ordered[mid]) / 2)
        static[has, 5] = np.minimum.reduceat(gaps, starts[has])
        static[has, 6] = np.maximum.reduceat(gaps, starts[has])

    arrivals, starts, lengths, has = _segments([v.recent_arrivals_ts for v in views])
    aux[:, _LAST_ARRIVAL] = NAN
    aux[:, _DECAY_REF] = -math.inf
    if has.any():
        ends = starts + lengths
        aux[has, _LAST_ARRIVAL] = arrivals[ends[has] - 1]
        ref = np.maximum.reduceat(arrivals, starts[has])
        aux[has, _DECAY_REF] = ref
        age = np.repeat(ref, lengths[has]) - arrivals
        for k, (_, tau) in enumerate(DECAYED_FEATURES):
            aux[has, _DECAY_SUMS + k] = np.add.reduceat(np.exp(-age / tau), starts[has])
    return static, aux, closed
