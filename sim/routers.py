"""Routers: which instance a request goes to. What serving systems do today, and one that knows KV.

- `sticky`: a session stays on its instance (best for KV reuse), overflowing to the least-loaded
  instance when its queue is longer than the scenario's `sticky_overflow_queue`.
- `least-loaded`: fewest running + queued requests (round-robin-like when all are equal).
- `kv-aware`: most of the request's reused blocks resident in HBM, then least loaded (what
  Dynamo's KV router and llm-d's scorer do with engine KV events).
- `hinted`: asks the service's route hint (app/decide/hints.py, what `POST /v1/route-hint`
  answers) over every instance and takes its recommendation: where the session's context is or
  soonest will be, weighed against each instance's queue. Where the context is comes from the
  engine's store (the events the cluster emitted), never from the cluster itself; the queues
  are read live from the cluster, as a router knows its own. A session with no context known
  goes to the least loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from app.decide.hints import HintConfig, InstanceLoad, route_hint

if TYPE_CHECKING:
    from app.state.base import StateStore
    from sim.cluster import Cluster, SimRequest
    from sim.scenario import Scenario

ROUTERS = ("sticky", "least-loaded", "kv-aware", "hinted")


class Router(Protocol):
    name: str

    def route(self, r: SimRequest, cluster: Cluster) -> int: ...


def _least_loaded(cluster: Cluster, start: int) -> int:
    # Start the tie-break at a rotating index so equal loads spread evenly.
    n = len(cluster.instances)
    order = [(start + k) % n for k in range(n)]
    return min(order, key=lambda i: cluster.instances[i].load)


class LeastLoaded:
    name = "least-loaded"

    def route(self, r: SimRequest, cluster: Cluster) -> int:
        return _least_loaded(cluster, r.index)


class Sticky:
    name = "sticky"

    def route(self, r: SimRequest, cluster: Cluster) -> int:
        home = cluster.session_instance.get(r.session_id)
        if home is not None and len(cluster.instances[home].queue) <= cluster.scenario.sticky_overflow_queue:
            return home
        return _least_loaded(cluster, r.index)


class KvAware:
    name = "kv-aware"

    def route(self, r: SimRequest, cluster: Cluster) -> int:
        reused = r.hash_ids[: cluster.reused_prefix(r.hash_ids)]
        n = len(cluster.instances)

        def score(i: int) -> tuple[int, int]:
            inst = cluster.instances[i]
            resident = sum(1 for b in reused if b in inst.hbm)
            overloaded = len(inst.queue) > cluster.scenario.sticky_overflow_queue
            return (0 if overloaded else -resident, inst.load)

        return min(((r.index + k) % n for k in range(n)), key=score)


class Hinted:
    name = "hinted"

    def __init__(self, store: StateStore, config: HintConfig) -> None:
        self.store = store
        self.config = config

    def route(self, r: SimRequest, cluster: Cluster) -> int:
        n = len(cluster.instances)
        # Candidates from a rotating start, so that equal hints spread as least-loaded's ties do.
        order = [cluster.instances[(r.index + k) % n] for k in range(n)]
        loads = {inst.instance_id: InstanceLoad(queue_depth=len(inst.queue), running_requests=inst.running)
                 for inst in order}
        # With the `scheduled` policy, its open prefetches are on their way, as in the service.
        scheduler = getattr(cluster.policy, "scheduler", None)
        inflight = scheduler.open_orders() if scheduler is not None else ()
        hint = route_hint(self.store, r.session_id, [inst.instance_id for inst in order], cluster.now,
                          config=self.config, inflight=inflight, loads=loads)
        if not hint.context_known:
            return _least_loaded(cluster, r.index)
        return next(inst.idx for inst in order if inst.instance_id == hint.recommended)


def hint_config(scenario: Scenario) -> HintConfig:
    return HintConfig.for_cluster(scenario.cluster)


def make_router(name: str, *, store: StateStore | None = None, scenario: Scenario | None = None) -> Router:
    """`store` and `scenario`: the engine's state and the cluster's numbers, for `hinted`."""
    if name == "hinted":
        if store is None or scenario is None:
            raise ValueError("the hinted router reads the engine's own state: it needs the in-process engine")
        return Hinted(store, hint_config(scenario))
    routers: dict[str, type] = {"sticky": Sticky, "least-loaded": LeastLoaded, "kv-aware": KvAware}
    try:
        return routers[name]()
    except KeyError:
        raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}") from None
