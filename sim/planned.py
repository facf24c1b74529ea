"""The service's planner driving the cluster model: the `heuristic` and `learned` policies.

Each tick the planner (app/engine/planner.py) scores every idle live session from the engine's
own state. Retention: a block's eviction key is the smallest expected wait among the sessions
whose context holds it (evict the largest first, as Belady evicts the furthest next use).
Prefetch: a session likely to return within the lead time gets its missing blocks fetched to
its instance, displacing only blocks whose expected wait is longer than its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from app.engine.planner import MAX_IDLE_SECONDS, Planner
from app.engine.state.base import SessionView
from sim.policies import Policy

if TYPE_CHECKING:
    from sim.cluster import Cluster, SimRequest

# Blocks no scored session holds: evicted before any scored one (LRU among themselves).
UNSCORED_KEY = 1e9


class PlannedPolicy(Policy):
    tick_seconds = 20.0

    def __init__(self, planner: Planner, session_view: Callable[[str], SessionView | None], name: str) -> None:
        self.planner = planner
        self.name = name
        self._session_view = session_view
        self._idle: set[str] = set()
        self._keys: dict[int, float] = {}
        # Sessions already fetched for in their current idle spell: one order per spell, not
        # one per tick (a context evicted again after its fetch is not chased).
        self._fetched: set[str] = set()
        self.evict_key = lambda b: self._keys.get(b, UNSCORED_KEY)  # type: ignore[assignment]

    def attach(self, cluster: Cluster) -> None:
        super().attach(cluster)

    def on_arrival(self, r: SimRequest, now: float) -> None:
        self._idle.discard(r.session_id)
        self._fetched.discard(r.session_id)

    def on_finished(self, r: SimRequest, now: float) -> None:
        self._idle.add(r.session_id)
        self._plan([r.session_id], now, prefetch=False)

    def on_tick(self, now: float) -> None:
        horizon = now - MAX_IDLE_SECONDS
        views = [v for v in (self._session_view(s) for s in self._idle) if v is not None]
        self._idle = {v.session_id for v in views if v.last_activity_ts >= horizon and v.state == "idle"}
        self._plan(sorted(self._idle), now, prefetch=True, views=[v for v in views if v.session_id in self._idle])

    def _plan(self, session_ids: list[str], now: float, *, prefetch: bool,
              views: list[SessionView] | None = None) -> None:
        if views is None:
            views = [v for v in (self._session_view(s) for s in session_ids) if v is not None]
        advice = self.planner.advise(views, now)
        cluster = self.cluster
        index = {inst.instance_id: inst.idx for inst in cluster.instances}
        changed: dict[int, float] = {}
        for a in advice:
            for b in a.block_hashes:
                key = changed.get(b)  # type: ignore[arg-type]
                if key is None or a.expected_wait_seconds < key:
                    changed[b] = a.expected_wait_seconds  # type: ignore[index]
        if prefetch:
            # A full pass: blocks no idle session holds any more fall back to unscored.
            for b in self._keys.keys() - changed.keys():
                changed[b] = UNSCORED_KEY
        for b, key in changed.items():
            old = self._keys.get(b)
            # Re-ranking costs a heap push per copy: skip changes too small to reorder anything.
            if old is None or abs(key - old) > 0.02 * old:
                self._keys[b] = key
                for inst in cluster.instances:
                    inst.hbm.rekey(b)
        if not prefetch:
            return
        for a in sorted((a for a in advice if a.prefetch and a.session_id not in self._fetched),
                        key=lambda a: a.expected_wait_seconds):
            idx = index.get(a.instance_id) if a.instance_id is not None else None  # type: ignore[arg-type]
            if idx is None:
                continue
            hbm = cluster.instances[idx].hbm
            missing = [b for b in a.block_hashes if b not in hbm]
            if not missing:
                continue
            short = len(missing) - hbm.free
            if short > 0:
                victims = hbm.choose_victims(short, now, exclude=set(a.block_hashes))  # type: ignore[arg-type]
                # Displace only contexts expected to wait longer than this one.
                if victims is None or any(self.evict_key(v) <= a.expected_wait_seconds for v in victims):  # type: ignore[misc]
                    continue
            if cluster.prefetch(idx, a.block_hashes):  # type: ignore[arg-type]
                self._fetched.add(a.session_id)
