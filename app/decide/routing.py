"""Where a session's next request will land: on the instance that holds its context, or not.

A context kept on instance A is worth something only if the session's next request is routed to
A. Whether it is depends on the deployment's router, not on the session: a sticky or KV-aware
router sends nearly every turn back (P ~ 1), a least-loaded one spreads them (P ~ 1/instances).
So it is learned online from the routing events themselves, not by the model: a model trained
on one router's logs would carry that router's habit to every deployment.
"""

from __future__ import annotations

import math
from collections import OrderedDict

# Instances remembered by the estimate (their count is what it reads): the store's own cap.
MAX_INSTANCES_SEEN = 10_000


class SameInstanceEstimate:
    """P(a returning session is routed to the instance of its previous request), as an
    exponentially decayed share of recent returns, starting from a prior worth a few returns."""

    def __init__(
        self, *, prior: float = 1.0, prior_weight: float = 5.0, half_life_returns: float = 500.0
    ) -> None:
        if not 0.0 <= prior <= 1.0:
            raise ValueError("prior must be within [0, 1]")
        self._decay = math.exp(math.log(0.5) / half_life_returns)
        self._same = prior * prior_weight
        self._total = prior_weight
        # The instances requests went to (up to MAX_INSTANCES_SEEN): how many a return may go to.
        self._instances: set[str] = set()

    def observe(self, previous_instance_id: str | None, instance_id: str) -> None:
        """A request of a session whose previous request went to `previous_instance_id`."""
        if len(self._instances) < MAX_INSTANCES_SEEN:
            self._instances.add(instance_id)
        if previous_instance_id is None:
            return  # a first turn says nothing about returns
        self._same = self._same * self._decay + (previous_instance_id == instance_id)
        self._total = self._total * self._decay + 1.0

    @property
    def p_same(self) -> float:
        return self._same / self._total

    @property
    def last_is_likeliest(self) -> bool:
        """Whether a return lands on the session's last instance at least as often as on any one
        other (taken as equally likely): where a prefetch goes. A router that moves sessions
        away (p_same below 1/instances) leaves no instance to send one to."""
        others = len(self._instances) - 1
        return others <= 0 or self.p_same >= (1.0 - self.p_same) / others


class RouteTracker:
    """Feeds a SameInstanceEstimate from routing events: remembers each session's last instance
    while the store does (a session forgotten counts as a first turn).

    By event time, with the store's rule (app/state/base.py): a session with no event for
    `retention_seconds` before the newest event seen is forgotten, and an event older than that
    is ignored. The most recently active `max_sessions` are kept in any case.
    """

    def __init__(
        self,
        estimate: SameInstanceEstimate | None = None,
        *,
        max_sessions: int = 200_000,
        retention_seconds: float = math.inf,
    ) -> None:
        if retention_seconds <= 0:
            raise ValueError("retention_seconds must be positive")
        self.estimate = estimate or SameInstanceEstimate()
        self.max_sessions = max_sessions
        self.retention_seconds = retention_seconds
        # session -> (its last instance, its last activity ts); least recently touched first.
        # An OrderedDict: `see` takes from the front, and a dict's first key after many deletes
        # there is found by scanning every freed slot (docs/decisions.md, "Ingest at half the
        # ceiling, and steady": 3x the cost per event once retention starts forgetting).
        self._last: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._cutoff = -math.inf

    def __len__(self) -> int:
        return len(self._last)

    def see(self, ts: float) -> None:
        """Any event's time: moves the cutoff, and forgets what it passes (oldest first; one
        touched out of time order waits its turn, and lookups check the cutoff meanwhile)."""
        cutoff = ts - self.retention_seconds
        if cutoff <= self._cutoff:
            return
        self._cutoff = cutoff
        last = self._last
        while last:
            oldest = next(iter(last))
            if last[oldest][1] >= cutoff:
                break
            del last[oldest]

    def routed(self, session_id: str, instance_id: str, ts: float) -> None:
        self.see(ts)
        if ts < self._cutoff:
            return  # about a past the store has forgotten
        previous = self._last.pop(session_id, None)
        if previous is not None and previous[1] < self._cutoff:
            previous = None
        self.estimate.observe(previous[0] if previous is not None else None, instance_id)
        self._last[session_id] = (instance_id, max(ts, previous[1]) if previous is not None else ts)
        if len(self._last) > self.max_sessions:
            self._last.popitem(last=False)

    def touched(self, session_id: str, ts: float) -> None:
        """Another event of the session (started, finished): it is still active."""
        self.see(ts)
        entry = self._last.get(session_id)
        if entry is not None and ts > entry[1] and entry[1] >= self._cutoff:
            self._last[session_id] = (entry[0], ts)
            self._last.move_to_end(session_id)

    def closed(self, session_id: str, ts: float | None = None) -> None:
        if ts is not None:
            self.see(ts)
        self._last.pop(session_id, None)
