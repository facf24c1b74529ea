"""Serving model against shadow by a proper scoring rule, on the same sessions at the same moments.

The advice ledger's hit rate rewards a model that says keep for everyone (it gets every hit), so it
cannot choose between two models. This judge scores each model's `p_keep` (P(the session is back
within the keep horizon)) with the Brier score against what happened, paired: both models were
asked about the same session at the same scoring tick, so each pair's difference cancels what the
session itself makes easy or hard. docs/decisions.md (20) has why.

One open pair per session (the first tick's advice after its last pair was resolved): a session
is advised every tick, and pairs a second apart say nearly the same thing. A pair resolves to 1
when the session's next request is routed within the horizon of the advice, to 0 when the
horizon passes (by event time) without one or the session closes first. It counts once its
horizon has passed, whatever its outcome: counting a return as soon as it comes would weigh the
pairs judged so far towards returns (their zeros take the whole horizon to come), so only pairs
made at least a horizon ago count, every one of them. Bounded: at most `max_pending` pairs wait
in each state; past that the oldest open ones are dropped and the oldest resolved ones count
early.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Literal

# Pending pairs kept; ~100 bytes each.
MAX_PENDING = 200_000
# Paired standard errors the mean difference must clear (about a 2.5% one-sided test).
PROMOTE_Z = 2.0

Verdict = Literal["promote", "discard", "wait"]


@dataclass(frozen=True, slots=True)
class JudgeStats:
    # Pairs judged since the judge was reset.
    judged: int
    # Mean Brier score of each model's p_keep on those pairs (lower is better); None before any.
    live_brier: float | None
    shadow_brier: float | None
    # Mean of (live Brier - shadow Brier) per pair: positive when the shadow is better.
    mean_gain: float | None
    # Its standard error (None below two pairs).
    gain_se: float | None
    # Pairs dropped unjudged (the bound on open pairs), and those not counted yet.
    dropped: int
    pending: int


class PairedJudge:
    def __init__(self, horizon_seconds: float, *, max_pending: int = MAX_PENDING) -> None:
        if horizon_seconds <= 0:
            raise ValueError("horizon_seconds must be positive")
        self.horizon_seconds = horizon_seconds
        self.max_pending = max_pending
        self.reset()

    def reset(self) -> None:
        """A model changed in either slot: what was judged was about the old pair of models."""
        # session -> (made_ts, p_live, p_shadow), unresolved; insertion order is advice order.
        self._open: dict[str, tuple[float, float, float]] = {}
        # (made_ts, seq, p_live, p_shadow, outcome): resolved, counted once the horizon passed.
        self._resolved: list[tuple[float, int, float, float, float]] = []
        self._seq = itertools.count()
        self._n = 0
        self._live = self._shadow = 0.0
        self._sum = self._sum_sq = 0.0
        self._dropped = 0

    def pair(self, session_id: str, made_ts: float, p_live: float, p_shadow: float) -> None:
        """Both models' p_keep for a session at one tick; ignored while one is open for it."""
        if session_id in self._open:
            return
        self._open[session_id] = (made_ts, p_live, p_shadow)
        while len(self._open) > self.max_pending:
            del self._open[next(iter(self._open))]
            self._dropped += 1

    def arrived(self, session_id: str, ts: float) -> None:
        """The session's next request was routed at `ts`."""
        pending = self._open.pop(session_id, None)
        if pending is None:
            return
        made_ts = pending[0]
        if ts < made_ts:
            return  # advice made after an arrival it did not know of: not a forecast of it
        self._resolve(pending, 1.0 if ts - made_ts <= self.horizon_seconds else 0.0)

    def closed(self, session_id: str) -> None:
        """The session closed: it does not come back."""
        pending = self._open.pop(session_id, None)
        if pending is not None:
            self._resolve(pending, 0.0)

    def _resolve(self, pending: tuple[float, float, float], outcome: float) -> None:
        made_ts, p_live, p_shadow = pending
        heapq.heappush(self._resolved, (made_ts, next(self._seq), p_live, p_shadow, outcome))
        if len(self._resolved) > self.max_pending:
            _, _, p_live, p_shadow, outcome = heapq.heappop(self._resolved)
            self._judge(p_live, p_shadow, outcome)

    def advance(self, newest_ts: float) -> None:
        """Event time reached `newest_ts`: the pairs whose horizon has passed count, those still
        open as 0 (oldest first, so this costs what it counts)."""
        due = newest_ts - self.horizon_seconds
        resolved = self._resolved
        while resolved and resolved[0][0] < due:
            _, _, p_live, p_shadow, outcome = heapq.heappop(resolved)
            self._judge(p_live, p_shadow, outcome)
        open_ = self._open
        while open_:
            session_id = next(iter(open_))
            made_ts, p_live, p_shadow = open_[session_id]
            if made_ts >= due:
                return
            del open_[session_id]
            self._judge(p_live, p_shadow, 0.0)

    def _judge(self, p_live: float, p_shadow: float, outcome: float) -> None:
        live = (p_live - outcome) ** 2
        shadow = (p_shadow - outcome) ** 2
        gain = live - shadow
        self._n += 1
        self._live += live
        self._shadow += shadow
        self._sum += gain
        self._sum_sq += gain * gain

    def stats(self) -> JudgeStats:
        n = self._n
        if n == 0:
            return JudgeStats(0, None, None, None, None, self._dropped, self.pending)
        mean = self._sum / n
        se = None
        if n > 1:
            variance = max(0.0, (self._sum_sq - n * mean * mean) / (n - 1))
            se = math.sqrt(variance / n)
        return JudgeStats(
            n, self._live / n, self._shadow / n, mean, se, self._dropped, self.pending
        )

    @property
    def pending(self) -> int:
        """Pairs not counted yet: open, or resolved within the last horizon."""
        return len(self._open) + len(self._resolved)


def verdict(stats: JudgeStats, *, min_judged: int, margin: float, z: float = PROMOTE_Z) -> Verdict:
    """`promote` when, on at least `min_judged` pairs, the shadow's Brier score is lower than the
    serving model's by at least `margin` of the serving model's and by `z` paired standard
    errors; `discard` when, on as many pairs, it is worse by `z` standard errors; else `wait`
    (the caller discards when the shadow's time is up)."""
    if stats.judged < max(min_judged, 2) or stats.mean_gain is None or stats.gain_se is None:
        return "wait"
    assert stats.live_brier is not None
    gain, se = stats.mean_gain, stats.gain_se
    if gain >= margin * stats.live_brier and gain > z * se:
        return "promote"
    if gain < -z * se:
        return "discard"
    return "wait"


__all__ = ["MAX_PENDING", "PROMOTE_Z", "JudgeStats", "PairedJudge", "Verdict", "verdict"]
