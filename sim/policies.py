"""Policies: what to keep in HBM and what to fetch before it is asked for. One interface.

- `none`: LRU retention, loads on demand. What engines do today.
- `lookahead`: prefetch a request's context as soon as it is queued (CachedAttention).
- `belady`: evict the block whose next use is furthest in the future; no prefetch. Knows the
  future; isolates what retention alone can win.
- `oracle`: Belady eviction plus just-in-time prefetch of every future request's reused blocks to
  the instance its router will pick, within link bandwidth. The upper bound. It is approximate:
  it predicts the destination by asking the router at prefetch time, and Belady's next use is
  global, not per instance.
- `heuristic`: the service's HeuristicPredictor (app/engine/predictor.py), reading the engine's
  live state: keep a finished turn's context for a few of the session's own gaps, and prefetch it
  shortly before the session's median gap has passed.
- `learned`: the LightGBM predictor (issue 4) in the same role.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from app.core.errors import ConfigError
from app.engine.predictor import HeuristicPredictor, Predictor

if TYPE_CHECKING:
    from sim.cluster import Cluster, SimRequest

POLICIES = ("none", "lookahead", "belady", "oracle", "heuristic", "learned")
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
        for b, t in zip(r.hash_ids, self._next_after[r.index]):
            self.next_use[b] = t


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


class PredictorPolicy(Policy):
    """Drives retention and prefetch from a Predictor reading the engine's live state."""

    lead_margin_seconds = 0.5
    # Below this chance of a return, moving gigabytes is more likely waste than help: leave the
    # context to LRU.
    min_p_return = 0.5

    def __init__(self, predictor: Predictor, session_view: Callable[[str], object]) -> None:
        self.predictor = predictor
        self.name = predictor.name
        self._session_view = session_view
        self._latest: dict[str, int] = {}  # session -> index of its latest request

    def on_arrival(self, r: SimRequest, now: float) -> None:
        self._latest[r.session_id] = r.index

    def on_finished(self, r: SimRequest, now: float) -> None:
        view = self._session_view(r.session_id)
        if view is None:
            return
        p = self.predictor.predict_one(view, now)  # type: ignore[arg-type]
        blocks = list(r.hash_ids)
        cluster = self.cluster
        if p.p_return <= 0:
            cluster.demote(r.instance, blocks)
            return
        if p.p_return < self.min_p_return:
            return
        cluster.keep(r.instance, blocks, now + p.keep_seconds)
        lead = len(blocks) * cluster.block_bytes / cluster.scenario.pool_link_bytes_per_second
        at = p.expected_arrival_ts - lead - self.lead_margin_seconds
        if at > now:
            cluster.call_at(at, self._refetch(r))

    def _refetch(self, r: SimRequest) -> Callable[[], None]:
        def refetch() -> None:
            if self._latest.get(r.session_id) != r.index:
                return  # the session already came back
            instance = self.cluster.session_instance.get(r.session_id, r.instance)
            self.cluster.prefetch(instance, r.hash_ids)
            self.cluster.keep(instance, r.hash_ids, self.cluster.now + 60.0)
        return refetch


def make_policy(name: str, *, session_view: Callable[[str], object] | None = None,
                model_dir: str | None = None) -> Policy:
    if name == "none":
        return NoPrefetch()
    if name == "lookahead":
        return Lookahead()
    if name == "belady":
        return Belady()
    if name == "oracle":
        return Oracle()
    if name == "heuristic":
        if session_view is None:
            raise ValueError("the heuristic policy reads the engine's state: pass session_view")
        return PredictorPolicy(HeuristicPredictor(), session_view)
    if name == "learned":
        raise ConfigError("the learned policy needs a trained model, which issue 4 adds "
                          f"(asked for {model_dir or 'the bundled model'})")
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
