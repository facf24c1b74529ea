"""Policies: what to keep in HBM and what to fetch before it is asked for. One interface.

- `none`: LRU retention, loads on demand. What engines do today.
- `lookahead`: prefetch a request's context as soon as it is queued (CachedAttention).
- `belady`: evict the block whose next use is furthest in the future; no prefetch. Knows the
  future; isolates what retention alone can win.
- `oracle`: Belady eviction plus just-in-time prefetch of every future request's reused blocks to
  the instance its router will pick, within link bandwidth. The upper bound. It is approximate:
  it predicts the destination by asking the router at prefetch time, and Belady's next use is
  global, not per instance.
- `heuristic`: the service's planner (app/decide/advisor.py) over the HeuristicPredictor: each
  session's median gap between its turns, no learning (sim/planned.py).
- `learned`: the same planner over the LightGBM predictor trained from event logs (training/).
- `clairvoyant`: the same planner over a predictor that knows each session's next arrival: what
  a perfect model would win through the same mechanism (a diagnostic, like `oracle`).
- `scheduled`: the learned planner's advice through the service's scheduler
  (app/decide/scheduler.py): orders within link shares and destination room, deduplicated,
  cancelled when the chance falls (sim/scheduled.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from app.predict.predictors import DEFAULT_MODEL_DIR, HeuristicPredictor, LearnedPredictor

if TYPE_CHECKING:
    from app.state.base import StateStore
    from sim.cluster import Cluster, SimRequest
    from sim.scenario import Scenario

POLICIES = ("none", "lookahead", "belady", "oracle", "heuristic", "learned", "scheduled", "clairvoyant")
INF = float("inf")


class Policy:
    """The hooks the cluster model calls. Subclasses act through cluster.prefetch/keep/demote."""

    name = "none"
    tick_seconds: float | None = None
    evict_key: Callable[[int], float] | None = None  # None: LRU

    def attach(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def on_arrival(self, r: SimRequest, now: float) -> None:
        """After routing and the first admission attempt."""

    def before_admit(self, r: SimRequest, now: float) -> None:
        """A request is being admitted (its blocks are about to be pinned and touched)."""

    def on_finished(self, r: SimRequest, now: float) -> None:
        """A request finished; its blocks are resident and unpinned."""

    def on_tick(self, now: float) -> None:
        """Every tick_seconds, when set."""


class NoPrefetch(Policy):
    name = "none"


class Lookahead(Policy):
    name = "lookahead"

    def on_arrival(self, r: SimRequest, now: float) -> None:
        if r.admitted_at is None:  # queued: there is time to fetch before its slot frees
            reused = self.cluster.reused_prefix(r.hash_ids)
            self.cluster.prefetch(r.instance, r.hash_ids[:reused])


class Belady(Policy):
    name = "belady"

    def attach(self, cluster: Cluster) -> None:
        super().attach(cluster)
        self.next_use: dict[int, float] = {}
        # For each request, the arrival of the next request carrying each of its blocks.
        following: dict[int, float] = {}
        self._next_after: list[list[float]] = [[] for _ in cluster.requests]
        for r in reversed(cluster.requests):
            self._next_after[r.index] = [following.get(b, INF) for b in r.hash_ids]
            for b in r.hash_ids:
                following[b] = r.arrival
        # The first use of every block, for blocks placed before any request uses them.
        for b, t in following.items():
            self.next_use[b] = t
        self.evict_key = self.next_use.get  # type: ignore[assignment]

    def before_admit(self, r: SimRequest, now: float) -> None:
        others = [inst.hbm for inst in self.cluster.instances if inst.idx != r.instance]
        for b, t in zip(r.hash_ids, self._next_after[r.index]):
            self.next_use[b] = t
            # Copies on other instances must be ranked by the new next use too: left at the old
            # one (now in the past) they would look needed soonest and never be evicted.
            for hbm in others:
                if b in hbm:
                    hbm.rekey(b)


class Oracle(Belady):
    name = "oracle"
    # Start a fetch this much before it would land exactly on time.
    margin_seconds = 0.25

    def attach(self, cluster: Cluster) -> None:
        super().attach(cluster)
        seen: set[int] = set()
        for r in cluster.requests:
            if r.hash_ids and r.hash_ids[0] in seen:  # it may reuse something
                lead = len(r.hash_ids) * cluster.block_bytes / cluster.scenario.pool_link_bytes_per_second
                cluster.call_at(r.arrival - lead - self.margin_seconds, self._fetch_for(r))
            seen.update(r.hash_ids)

    def _fetch_for(self, r: SimRequest) -> Callable[[], None]:
        def fetch() -> None:
            reused = self.cluster.reused_prefix(r.hash_ids)
            if reused:
                self.cluster.prefetch(self.cluster.router.route(r, self.cluster), r.hash_ids[:reused])
        return fetch


def make_policy(name: str, *, session_view: Callable[[str], object] | None = None,
                model_dir: str | None = None, planner_options: dict[str, float] | None = None,
                store: StateStore | None = None, scenario: Scenario | None = None) -> Policy:
    """`planner_options`: keyword arguments for app.decide.advisor.Advisor (heuristic, learned,
    scheduled). `store` and `scenario`: the engine's state and the cluster, for `scheduled`."""
    if name == "none":
        return NoPrefetch()
    if name == "lookahead":
        return Lookahead()
    if name == "belady":
        return Belady()
    if name == "oracle":
        return Oracle()
    if name == "scheduled":
        from app.decide.advisor import Advisor
        from app.decide.routing import SameInstanceEstimate
        from app.decide.scheduler import Scheduler, SchedulerConfig
        from sim.scheduled import ScheduledPolicy

        if session_view is None or store is None or scenario is None:
            raise ValueError("the scheduled policy reads the engine's own state: it needs the in-process engine")
        config = SchedulerConfig(bytes_per_block=scenario.block_bytes, block_tokens=scenario.block_tokens,
                                 pool_link_bytes_per_second=scenario.pool_link_bytes_per_second,
                                 host_link_bytes_per_second=scenario.host_link_bytes_per_second,
                                 prefill_tokens_per_second=scenario.prefill_tokens_per_second)
        planner = Advisor(LearnedPredictor(model_dir or DEFAULT_MODEL_DIR), routes=SameInstanceEstimate(),
                          **(planner_options or {}))
        return ScheduledPolicy(planner, Scheduler(store, config), session_view)  # type: ignore[arg-type]
    if name == "clairvoyant":
        from app.decide.advisor import Advisor
        from sim.planned import Clairvoyant, ClairvoyantPolicy

        if session_view is None:
            raise ValueError("the clairvoyant policy reads the engine's state: pass session_view")
        return ClairvoyantPolicy(Advisor(Clairvoyant(), **(planner_options or {})), session_view,  # type: ignore[arg-type]
                                 "clairvoyant")
    if name in ("heuristic", "learned"):
        from app.decide.advisor import Advisor
        from app.decide.routing import SameInstanceEstimate
        from sim.planned import PlannedPolicy

        if session_view is None:
            raise ValueError(f"the {name} policy reads the engine's state: pass session_view")
        predictor = HeuristicPredictor() if name == "heuristic" else LearnedPredictor(model_dir or DEFAULT_MODEL_DIR)
        planner = Advisor(predictor, routes=SameInstanceEstimate(), **(planner_options or {}))
        return PlannedPolicy(planner, session_view, name)  # type: ignore[arg-type]
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
