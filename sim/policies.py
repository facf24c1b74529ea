"""Policies: what to keep in HBM and what to fetch before it is asked for. One interface.

- `none`: LRU retention, loads on demand. What engines do today.
- `lookahead`: prefetch a request's context as soon as it is queued (CachedAttention).
- `belady`: evict the block whose next use is furthest in the future; no prefetch. Knows the
  future; isolates what retention alone can win.
- `oracle`: Belady eviction plus just-in-time prefetch of every future request's reused blocks to
  the instance its router will pick, within link bandwidth. The upper bound. It is approximate:
  it predicts the destination by asking the router at prefetch time, and Belady's next use is
  global, not per instance.
- `heuristic`, `learned`, `clairvoyant`: the service's own engine under the replay's clock
  (sim/planned.py): its scorer advises with the model it serves, its scheduler
  (app/decide/scheduler.py) turns the advice into orders within link shares and destination
  room, and the cluster model carries them out as a tier would. `heuristic` serves each
  session's median gap between its turns (no learning); `learned` the LightGBM predictor trained
  from event logs (training/); `clairvoyant` a predictor that knows each session's next arrival:
  what a perfect model would win through the same planner (a diagnostic, like `oracle`).
  `scheduled` is another name for `learned`.
- `signal`: LRU retention, and on every session_signal (sim/signals.py) a prefetch of the
  session's context to its instance at once: the naive use of the signals, the baseline a model
  that reads them is measured against. Without signals it is `none`.

The policies built on the service's planner live in sim/planned.py, on top of this module;
`make_policy` (sim/policy_registry.py) builds any of them by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sim.cluster import Cluster, SimRequest

POLICIES = (
    "none",
    "lookahead",
    "belady",
    "oracle",
    "heuristic",
    "learned",
    "clairvoyant",
    "signal",
)
# The policies that run the service's engine (its model, scorer and scheduler).
PLANNER_POLICIES = ("heuristic", "learned", "clairvoyant")
# What `learned` was called when it alone went through the service's scheduler.
SCHEDULED_ALIAS = "scheduled"
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

    def on_signal(self, session_id: str, kind: str, now: float) -> None:
        """A session_signal was emitted for the session (sim/signals.py)."""


class NoPrefetch(Policy):
    name = "none"


class Lookahead(Policy):
    name = "lookahead"

    def on_arrival(self, r: SimRequest, now: float) -> None:
        if r.admitted_at is None:  # queued: there is time to fetch before its slot frees
            reused = self.cluster.reused_prefix(r.hash_ids)
            self.cluster.prefetch(r.instance, r.hash_ids[:reused])


class SignalPrefetch(Policy):
    name = "signal"

    def attach(self, cluster: Cluster) -> None:
        super().attach(cluster)
        self.context: dict[str, tuple[int, ...]] = {}  # each session's latest request's blocks

    def on_arrival(self, r: SimRequest, now: float) -> None:
        self.context[r.session_id] = r.hash_ids

    def on_signal(self, session_id: str, kind: str, now: float) -> None:
        blocks = self.context.get(session_id)
        idx = self.cluster.session_instance.get(session_id)
        if blocks is None or idx is None:
            return
        reused = self.cluster.reused_prefix(blocks)
        if reused:
            self.cluster.prefetch(idx, blocks[:reused])


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
                lead = cluster.spec.load_seconds(len(r.hash_ids) * cluster.block_bytes, "pool")
                cluster.call_at(r.arrival - lead - self.margin_seconds, self._fetch_for(r))
            seen.update(r.hash_ids)

    def _fetch_for(self, r: SimRequest) -> Callable[[], None]:
        def fetch() -> None:
            reused = self.cluster.reused_prefix(r.hash_ids)
            if reused:
                self.cluster.prefetch(
                    self.cluster.router.route(r, self.cluster), r.hash_ids[:reused]
                )

        return fetch
