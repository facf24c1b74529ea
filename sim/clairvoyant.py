"""A predictor that knows each session's next arrival from the trace: P(within h) is 1 or 0.

Served by the replay's engine (the `clairvoyant` policy, sim/planned.py), it measures what a
perfect model would win through the same planner, so the gap from `learned` to `clairvoyant` is
the model's, and from `clairvoyant` to `oracle` the mechanism's.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from app.state.base import SessionView

if TYPE_CHECKING:
    from sim.cluster import SimRequest


class Clairvoyant:
    name = "clairvoyant"

    def __init__(self) -> None:
        self._arrivals: dict[str, list[float]] = {}

    def learn(self, requests: Sequence[SimRequest]) -> None:
        arrivals: dict[str, list[float]] = {}
        for r in requests:
            arrivals.setdefault(r.session_id, []).append(r.arrival)
        self._arrivals = {s: sorted(a) for s, a in arrivals.items()}

    def p_within(
        self, sessions: Sequence[SessionView], now: float, horizons: Sequence[float]
    ) -> np.ndarray:
        out = np.zeros((len(sessions), len(horizons)))
        for i, s in enumerate(sessions):
            times = self._arrivals.get(s.session_id, [])
            k = bisect.bisect_right(times, now)
            if k < len(times):
                wait = times[k] - now
                out[i] = [1.0 if wait <= h else 0.0 for h in horizons]
        return out
