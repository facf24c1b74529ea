"""Advice on a FeatureTable's rows as columns: what the scoring loop's pass computes.

`advise_rows` is `Advisor.advise` (app/decide/advisor.py) on many sessions at once, the same
numbers with numpy instead of a loop (tests/decide/test_score_table.py holds them equal);
`session_advice` turns the columns the scheduler is handed back into SessionAdvice. `Held` is
what the scorer keeps of a session beside its row (what the advice carries), `held_of` reads it
off a view.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from app.core.errors import StoreError
from app.decide.advisor import NEEDED_SHARE, Advisor, Retention, SessionAdvice
from app.predict.feature_table import STATE_CODES, FeatureTable
from app.predict.predictors import TablePredictor
from app.state.base import SessionView
from kvprefetch_client.events import BlockHash

# Retention codes of the columns, in this order.
RETENTIONS: tuple[Retention, ...] = ("keep", "demote", "lru")
_KEEP, _DEMOTE, _LRU = 0, 1, 2
RETENTION_NAMES = np.array(RETENTIONS, dtype=object)
_IDLE, _QUEUED = STATE_CODES["idle"], STATE_CODES["queued"]


class Held(NamedTuple):
    """What the scorer keeps of a session beside its table row: what the advice carries and the
    signal floor reads (a full view is ~3.7 KB; this, its blocks' pointers and ~100 bytes), and a
    fingerprint of what the table and the advice read, to tell a re-read that brings news."""

    instance_id: str | None
    block_hashes: tuple[BlockHash, ...]
    signal_kind: str | None
    fingerprint: int


def held_of(view: SessionView) -> Held:
    return Held(
        view.instance_id,
        tuple(view.block_hashes),
        view.signals[-1].kind if view.signals else None,
        hash(
            (
                view.last_activity_ts,
                view.state,
                view.turns,
                view.signals_total,
                view.instance_id,
                view.context_tokens,
                len(view.block_hashes),
                view.block_hashes[-1] if view.block_hashes else None,
                view.last_request,
                view.signals[-1] if view.signals else None,
                tuple(view.recent_arrivals_ts),
            )
        ),
    )


@dataclass(frozen=True, slots=True)
class TableAdvice:
    """An Advisor's advice on some rows of a FeatureTable, as columns: `rows` (the idle sessions
    advised, in the order given) and `queued` (rows whose request waits for a slot)."""

    rows: np.ndarray
    retention: np.ndarray  # codes into RETENTIONS
    keep_seconds: float
    p_keep: np.ndarray
    p_soon: np.ndarray
    p_return: np.ndarray
    prefetch: np.ndarray
    needed_in_seconds: np.ndarray
    queued: np.ndarray
    # P(a return lands where the context is), the same for every row (SessionAdvice.p_routed).
    p_routed: float = 1.0


def _interp_rows(x: np.ndarray, xp: np.ndarray, fp: np.ndarray) -> np.ndarray:
    """np.interp(x[i], xp[i], fp) for every row i at once (xp[i] non-decreasing), with numpy's
    own arithmetic, so each value equals the scalar call's."""
    m = xp.shape[1]
    j = (xp <= x[:, None]).sum(axis=1) - 1  # the last point at or below x
    lo = np.clip(j, 0, m - 1)
    hi = np.clip(j + 1, 0, m - 1)
    take = np.arange(len(x))
    x_lo, x_hi = xp[take, lo], xp[take, hi]
    with np.errstate(divide="ignore", invalid="ignore"):
        slope = (fp[hi] - fp[lo]) / (x_hi - x_lo)
        out = slope * (x - x_lo) + fp[lo]
    out = np.where(x_lo == x, fp[lo], out)
    out = np.where(j >= m - 1, fp[m - 1], out)
    return np.where(j < 0, fp[0], out)


def advise_rows(
    advisor: Advisor,
    table: FeatureTable,
    held: Mapping[str, Held],
    rows: np.ndarray,
    now: float,
    matrices: dict[bytes, np.ndarray] | None = None,
    read: Callable[[Sequence[str]], list[SessionView | None]] | None = None,
) -> TableAdvice:
    """`advisor.advise` of the sessions in these rows, as columns: the same numbers (the table's
    features, the advisor's thresholds, curve, signal floor) with numpy instead of a loop.
    `held`: what the scorer keeps of each session (the kinds of the signals that set a floor);
    `matrices`: feature matrices shared by the models that advise on the same rows at the same
    time (LearnedPredictor.p_within_table); `read`: the store's bulk read, for a model that scores
    views only (the heuristic), which reads the rows' sessions from the store."""
    state, blocks, last = table.advisor_columns(rows)
    signal_ts = table.signal_ts(rows)
    with np.errstate(invalid="ignore"):  # NaN (no signal) compares False
        signalled = (signal_ts >= last) & (now - signal_ts <= advisor.lead_seconds)
    idle = (state == _IDLE) & (blocks > 0) & ((now - last <= advisor.max_idle_seconds) | signalled)
    live = rows[idle]
    queued = rows[(state == _QUEUED) & (blocks > 0)]
    grid_times = advisor._grid
    predictor = advisor.predictor
    if not len(live):
        p = np.zeros((0, len(grid_times)))
    elif isinstance(predictor, TablePredictor):
        p = predictor.p_within_table(table, now, grid_times, live, matrices=matrices)
    else:
        if read is None:
            raise ValueError(f"{predictor.name} scores views only: advise_rows needs `read`")
        views = [v for v in read(table.ids_of(live)) if v is not None]
        if len(views) != len(live):
            raise StoreError("sessions went from the store while their rows were advised")
        p = predictor.p_within(views, now, grid_times)
    # Rows (positions in `live`) whose tool calls are in flight: their tools' curves, as advise.
    tooled = np.zeros(len(live), dtype=bool)
    # A deployment with no call in flight (every chat one) pays nothing for it on this path.
    if advisor.tools is not None and advisor.tools.sessions_in_flight and len(live):
        ids = table.ids_of(live)
        outlooks = advisor.tool_outlooks(ids, now)
        if outlooks:
            tooled = np.fromiter((s in outlooks for s in ids), dtype=bool, count=len(ids))
            p = np.array(p, dtype=np.float64)
            p[tooled] = [outlooks[s] for s in ids if s in outlooks]
    grid = np.maximum.accumulate(np.clip(p, 0.0, 1.0), axis=1)
    p_same = advisor.routes.p_same if advisor.routes is not None else 1.0
    grid *= p_same
    p_soon, p_keep, p_return = (grid[:, j].copy() for j in advisor._at)
    # When a prefetch must have landed (Advisor._needed_in), every row at once.
    lead_at = advisor._lead_at
    xp = np.concatenate([np.zeros((len(grid), 1)), grid[:, : lead_at + 1]], axis=1)
    fp = np.asarray(advisor._times[: lead_at + 2], dtype=np.float64)
    needed = np.where(
        p_soon <= 0.0, advisor.lead_seconds, _interp_rows(NEEDED_SHARE * p_soon, xp, fp)
    )
    if advisor.deployment is not None:
        floored = np.flatnonzero(signalled[idle] & ~tooled)
        if len(floored):
            ids = table.ids_of(live[floored])
            bound = advisor.deployment.followed_lower_bound
            kinds = [held[s].signal_kind for s in ids]
            floor = np.array([bound(k) if k is not None else 0.0 for k in kinds]) * p_same
            lift = floor > p_soon[floored]
            p_soon[floored[lift]] = floor[lift]
            needed[floored[lift]] = 0.0
            # As Advisor.advise: the longer horizons are at least as sure (a resident context
            # is kept until the turn the signal announces).
            at = floored[lift]
            p_keep[at] = np.maximum(p_keep[at], floor[lift])
            p_return[at] = np.maximum(p_return[at], floor[lift])
    retention = np.where(
        p_keep >= advisor.keep_min_p,
        _KEEP,
        np.where(p_return <= advisor.demote_max_p, _DEMOTE, _LRU),
    )
    return TableAdvice(
        live,
        retention,
        advisor.keep_horizon_seconds,
        p_keep,
        p_soon,
        p_return,
        p_soon >= advisor.prefetch_bar(p_same),
        needed,
        queued,
        p_same,
    )


def session_advice(
    advisor: Advisor,
    table: FeatureTable,
    held: Mapping[str, Held],
    advice: TableAdvice,
    take: np.ndarray,
    now: float,
) -> list[SessionAdvice]:
    """The SessionAdvice of the idle rows at positions `take` of `advice` (what the scheduler
    reads), in that order, then of every queued row (Advisor.queued_advice)."""
    out = []
    ids = table.ids_of(advice.rows[take])
    columns = zip(
        ids,
        advice.retention[take].tolist(),
        advice.p_keep[take].tolist(),
        advice.p_soon[take].tolist(),
        advice.p_return[take].tolist(),
        advice.prefetch[take].tolist(),
        advice.needed_in_seconds[take].tolist(),
    )
    for session_id, code, p_keep, p_soon, p_return, prefetch, needed_in in columns:
        h = held[session_id]
        out.append(
            SessionAdvice(
                session_id,
                h.instance_id,
                h.block_hashes,
                RETENTIONS[code],
                advice.keep_seconds if code == _KEEP else 0.0,
                p_keep,
                p_soon,
                p_return,
                prefetch,
                advisor.shared_blocks(h.block_hashes, now),
                needed_in,
                p_routed=advice.p_routed,
            )
        )
    for session_id in table.ids_of(advice.queued):
        h = held[session_id]
        out.append(advisor.queued_advice(session_id, h.instance_id, h.block_hashes, now))
    return out
