"""Routers: which instance a request goes to. What serving systems do today, and one that knows KV.

- `sticky`: a session stays on its instance (best for KV reuse), overflowing to the least-loaded
  instance when its queue is longer than the scenario's `sticky_overflow_queue`.
- `least-loaded`: fewest running + queued requests (round-robin-like when all are equal).
- `kv-aware`: most of the request's reused blocks resident in HBM, then least loaded (what
  Dynamo's KV router and llm-d's scorer do with engine KV events).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from sim.cluster import Cluster, SimRequest

ROUTERS = ("sticky", "least-loaded", "kv-aware")


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


def make_router(name: str) -> Router:
    routers: dict[str, type] = {"sticky": Sticky, "least-loaded": LeastLoaded, "kv-aware": KvAware}
    try:
        return routers[name]()
    except KeyError:
        raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}") from None
