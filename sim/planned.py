"""The service's planner driving the cluster model: the `heuristic` and `learned` policies.

On every finish, and every tick for every idle live session, the planner (app/decide/advisor.py)
reads the session from the engine's own state and advises: keep its context for a while, demote
it, or leave it to LRU; and, if it is likely back within the lead time and its context is not on
its instance, prefetch it there (once per idle spell: a context evicted again is not chased).
The cluster model carries the advice out as a tier would carry out pin-with-TTL and demote orders.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

from app.decide.advisor import MAX_IDLE_SECONDS, Advisor, SessionAdvice
from app.decide.guard import LruGuard
from app.decide.routing import RouteTracker
from app.state.base import SessionView
from sim.policies import Policy

if TYPE_CHECKING:
    from sim.cluster import Cluster, SimRequest


class PlannedPolicy(Policy):
    tick_seconds = 20.0

    def __init__(
        self,
        planner: Advisor,
        session_view: Callable[[str], SessionView | None],
        name: str,
        guard: LruGuard | None = None,
    ) -> None:
        self.planner = planner
        # The engine's: where the advice lost to plain LRU, LRU's is carried out instead.
        self.guard = guard
        self.name = name
        self._session_view = session_view
        self._idle: set[str] = set()
        self._fetched: set[str] = set()
        # Per instance, the latest advice for each idle session whose context is there: what a
        # prefetch into a full HBM would displace, and what each is worth.
        self._advised: dict[int, dict[str, SessionAdvice]] = {}
        self._advised_at: dict[str, int] = {}
        # Instances whose advice the guard has turned off: their keeps and demotions were
        # withdrawn when it did, so none lingers past the verdict.
        self._off: set[int] = set()
        # Feeds the planner's estimate of where returns land.
        self.routes = RouteTracker(planner.routes) if planner.routes is not None else None

    def on_arrival(self, r: SimRequest, now: float) -> None:
        self._idle.discard(r.session_id)
        self._fetched.discard(r.session_id)
        self._unadvise(r.session_id)
        if self.routes is not None:
            self.routes.routed(r.session_id, self.cluster.instances[r.instance].instance_id, now)
        if r.admitted_at is None:  # queued for a slot: the planner fetches its context now
            self._act([r.session_id], now)

    def on_finished(self, r: SimRequest, now: float) -> None:
        self._idle.add(r.session_id)
        self._act([r.session_id], now)

    def on_tick(self, now: float) -> None:
        self._act(sorted(self._idle), now)

    def on_signal(self, session_id: str, kind: str, now: float) -> None:
        # A signal is news about the next request: the session is advised at once (its view
        # holds the signal: the engine took it before the policy hears of it), however long it
        # has been idle, and its context may be fetched again this spell. A session with a
        # request in flight has nothing to fetch ahead of.
        if session_id not in self._idle:
            view = self._session_view(session_id)
            if view is None or view.state != "idle":
                return
        self._fetched.discard(session_id)
        self._act([session_id], now)

    def _views(self, session_ids: list[str], now: float) -> list[SessionView]:
        """The sessions' views; those no longer idle, or idle past what the planner scores, leave
        the idle set (and `_dropped` hears of them)."""
        views = [v for v in (self._session_view(s) for s in session_ids) if v is not None]
        cutoff = now - MAX_IDLE_SECONDS
        for v in views:
            if v.state != "idle" or v.last_activity_ts < cutoff:
                self._idle.discard(v.session_id)
                self._dropped(v.session_id)
        return views

    def _withdraw(self, now: float) -> None:
        """Withdraw the advice in force on instances the guard has just turned off."""
        assert self.guard is not None
        for inst in self.cluster.instances:
            if self.guard.allowed(inst.instance_id, now):
                self._off.discard(inst.idx)
            elif inst.idx not in self._off:
                self._off.add(inst.idx)
                self.cluster.clear_advice(inst.idx)

    def _unadvise(self, session_id: str) -> None:
        idx = self._advised_at.pop(session_id, None)
        if idx is not None:
            self._advised[idx].pop(session_id, None)

    def _dropped(self, session_id: str) -> None:
        """A session left the idle set."""

    def _instance_index(self, instance_id: str | None) -> int | None:
        if instance_id is None:
            return None
        return next(
            (inst.idx for inst in self.cluster.instances if inst.instance_id == instance_id), None
        )

    def _act(self, session_ids: list[str], now: float) -> None:
        views = self._views(session_ids, now)
        cluster = self.cluster
        advice = self.planner.advise(views, now)
        if self.guard is not None:
            self._withdraw(now)
            advice = self.guard.filter(advice, now)
        for a in advice:
            idx = self._instance_index(a.instance_id)
            if idx is None:
                continue
            # The traces' hash_ids are checked to be ints, so the advice names int blocks.
            blocks = cast("list[int]", list(a.block_hashes))
            if a.retention == "keep":
                cluster.keep(idx, blocks, now + a.keep_seconds)
            elif a.retention == "demote":
                cluster.demote(idx, cast("list[int]", list(a.demotable_blocks)))
            self._unadvise(a.session_id)
            self._advised.setdefault(idx, {})[a.session_id] = a
            self._advised_at[a.session_id] = idx
            if (
                a.prefetch
                and a.session_id not in self._fetched
                and self._room_for(idx, a, blocks)
                and cluster.prefetch(idx, blocks)
            ):
                self._fetched.add(a.session_id)
                # Held once landed, as the scheduler's order holds it (its ttl): at least through
                # the lead it was fetched for.
                cluster.keep(idx, blocks, now + max(a.keep_seconds, self.planner.lead_seconds))

    def _room_for(self, idx: int, cand: SessionAdvice, blocks: list[int]) -> bool:
        """May the candidate's missing blocks come in? A swap is priced by what it would push
        out (docs/decisions.md, 21): free room and demoted blocks cost nothing; then contexts
        advised as less likely back than the candidate, and not kept, go, least likely first
        (demoted for it here); past those, what LRU would evict next is content no advice
        keeps (each context's chance below `keep_min_p`, or it would be kept), taken by the
        cache's own order for a candidate more likely back than that."""
        hbm = self.cluster.instances[idx].hbm
        wanted = set(blocks)
        need = sum(1 for b in wanted if b not in hbm) - hbm.free - hbm.demoted
        if need <= 0:
            return True
        # Kept contexts are never displaced, as the scheduler never demotes what it pinned:
        # demoting them undid the keep advice (decisions 21).
        others = sorted(
            (
                a
                for a in self._advised.get(idx, {}).values()
                if a.session_id != cand.session_id and a.retention != "keep"
            ),
            key=lambda a: (a.p_keep, a.session_id),
        )
        entries = hbm.entries
        out: dict[int, None] = {}
        for a in others:
            if a.p_keep >= cand.p_soon or len(out) >= need:
                break
            for b in cast("list[int]", list(a.demotable_blocks)):
                if b in entries and not entries[b].demoted and b not in wanted and b not in out:
                    out[b] = None
        if len(out) < need and cand.p_soon <= self.planner.keep_min_p:
            return False
        if out:
            self.cluster.demote(idx, list(out))
        return True


class Clairvoyant:
    """A predictor that knows each session's next arrival from the trace: P(within h) is 1 or 0.
    Through the same planner it measures what a perfect model would win, so the gap from
    `learned` to `clairvoyant` is the model's, and from `clairvoyant` to `oracle` the
    mechanism's."""

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


class ClairvoyantPolicy(PlannedPolicy):
    def attach(self, cluster: Cluster) -> None:
        super().attach(cluster)
        self.planner.predictor.learn(cluster.requests)  # type: ignore[attr-defined]
