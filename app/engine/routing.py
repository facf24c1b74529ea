"""Where a session's next request will land: on the instance that holds its context, or not.

A context kept on instance A is worth something only if the session's next request is routed to
A. Whether it is depends on the deployment's router, not on the session: a sticky or KV-aware
router sends nearly every turn back (P ~ 1), a least-loaded one spreads them (P ~ 1/instances).
So it is learned online from the routing events themselves, not by the model: a model trained
on one router's logs would carry that router's habit to every deployment.
"""

from __future__ import annotations

import math


class SameInstanceEstimate:
    """P(a returning session is routed to the instance of its previous request), as an
    exponentially decayed share of recent returns, starting from a prior worth a few returns."""

    def __init__(self, *, prior: float = 1.0, prior_weight: float = 5.0, half_life_returns: float = 500.0) -> None:
        if not 0.0 <= prior <= 1.0:
            raise ValueError("prior must be within [0, 1]")
        self._decay = math.exp(math.log(0.5) / half_life_returns)
        self._same = prior * prior_weight
        self._total = prior_weight

    def observe(self, previous_instance_id: str | None, instance_id: str) -> None:
        """A request of a session whose previous request went to `previous_instance_id`."""
        if previous_instance_id is None:
            return  # a first turn says nothing about returns
        self._same = self._same * self._decay + (previous_instance_id == instance_id)
        self._total = self._total * self._decay + 1.0

    @property
    def p_same(self) -> float:
        return self._same / self._total


class RouteTracker:
    """Feeds a SameInstanceEstimate from routing events: remembers each session's last instance
    (the most recent `max_sessions`; a session forgotten counts as a first turn)."""

    def __init__(self, estimate: SameInstanceEstimate | None = None, *, max_sessions: int = 200_000) -> None:
        self.estimate = estimate or SameInstanceEstimate()
        self.max_sessions = max_sessions
        self._last: dict[str, str] = {}  # oldest first

    def routed(self, session_id: str, instance_id: str) -> None:
        self.estimate.observe(self._last.pop(session_id, None), instance_id)
        self._last[session_id] = instance_id
        if len(self._last) > self.max_sessions:
            del self._last[next(iter(self._last))]

    def closed(self, session_id: str) -> None:
        self._last.pop(session_id, None)
