"""The service's planner driving the cluster model: the `heuristic` and `learned` policies.

On every finish, and every tick for every idle live session, the planner (app/engine/planner.py)
reads the session from the engine's own state and advises: keep its context for a while, demote
it, or leave it to LRU; and, if it is likely back within the lead time and its context is not on
its instance, prefetch it there (once per idle spell: a context evicted again is not chased).
The cluster model carries the advice out as a tier would carry out pin-with-TTL and demote orders.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from app.engine.planner import MAX_IDLE_SECONDS, Planner
from app.engine.routing import RouteTracker
from app.engine.state.base import SessionView
from sim.policies import Policy

if TYPE_CHECKING:
    from sim.cluster import SimRequest


class PlannedPolicy(Policy):
    tick_seconds = 20.0

    def __init__(self, planner: Planner, session_view: Callable[[str], SessionView | None], name: str) -> None:
        self.planner = planner
        self.name = name
        self._session_view = session_view
        self._idle: set[str] = set()
        self._fetched: set[str] = set()
        # Feeds the planner's estimate of where returns land.
        self.routes = RouteTracker(planner.routes) if planner.routes is not None else None

    def on_arrival(self, r: SimRequest, now: float) -> None:
        self._idle.discard(r.session_id)
        self._fetched.discard(r.session_id)
        if self.routes is not None:
            self.routes.routed(r.session_id, self.cluster.instances[r.instance].instance_id)

    def on_finished(self, r: SimRequest, now: float) -> None:
        self._idle.add(r.session_id)
        self._act([r.session_id], now)

    def on_tick(self, now: float) -> None:
        self._act(sorted(self._idle), now)

    def _act(self, session_ids: list[str], now: float) -> None:
        views = [v for v in (self._session_view(s) for s in session_ids) if v is not None]
        cutoff = now - MAX_IDLE_SECONDS
        for v in views:
            if v.state != "idle" or v.last_activity_ts < cutoff:
                self._idle.discard(v.session_id)
        cluster = self.cluster
        index = {inst.instance_id: inst.idx for inst in cluster.instances}
        for a in self.planner.advise(views, now):
            idx = index.get(a.instance_id) if a.instance_id is not None else None
            if idx is None:
                continue
            blocks = list(a.block_hashes)
            if a.retention == "keep":
                cluster.keep(idx, blocks, now + a.keep_seconds)  # type: ignore[arg-type]
            elif a.retention == "demote":
                cluster.demote(idx, blocks)  # type: ignore[arg-type]
            if a.prefetch and a.session_id not in self._fetched:
                if any(b not in cluster.instances[idx].hbm for b in blocks) and cluster.prefetch(idx, blocks):  # type: ignore[arg-type]
                    self._fetched.add(a.session_id)
