"""Routers: sticky keeps a session home until its queue overflows; least-loaded; kv-aware; hinted
asks the engine's route hint."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import pytest

from app.state import MemoryStore
from kvprefetch_client.events import KvBlocksStored, RequestFinished
from sim.cluster import Cluster, SimRequest
from sim.policies import Policy
from sim.replay import replay
from sim.routers import ROUTERS, Hinted, KvAware, LeastLoaded, Sticky, hint_config, make_router
from sim.scenario import load_scenario
from sim.traces import load_trace
from tests.conftest import trace_slice
from tests.sim.test_cluster import (
    BLOCK_TOKENS,
    BYTES_PER_TOKEN,
    CheckedCluster,
    context,
    request,
    scenario,
)


def cluster(instances: int = 4, overflow: int = 2) -> Cluster:
    scen = scenario(prefill=1e4, instances=instances).model_copy(
        update={"sticky_overflow_queue": overflow}
    )
    return Cluster(scen, [], LeastLoaded(), Policy())


def load(c: Cluster, loads: list[int]) -> None:
    """Give each instance a load: running requests up to the slot limit, the rest queued."""
    for inst, n in zip(c.instances, loads):
        inst.running = min(n, c.scenario.max_running_requests)
        inst.queue.clear()
        for k in range(n - inst.running):
            inst.queue.append(request(1000 + k, 0.0, [k]))


def queued(c: Cluster, idx: int, n: int) -> None:
    c.instances[idx].queue.clear()
    c.instances[idx].queue.extend(request(1000 + k, 0.0, [k]) for k in range(n))


def test_least_loaded_picks_the_least_loaded() -> None:
    c = cluster()
    load(c, [5, 3, 9, 4])
    assert all(LeastLoaded().route(request(i, 0.0, [1]), c) == 1 for i in range(8))
    load(c, [5, 3, 9, 1])
    assert LeastLoaded().route(request(0, 0.0, [1]), c) == 3
    load(c, [0, 0, 12, 12])  # queued requests count too
    assert LeastLoaded().route(request(0, 0.0, [1]), c) in (0, 1)


def test_least_loaded_spreads_ties() -> None:
    c = cluster()
    assert [LeastLoaded().route(request(i, 0.0, [1]), c) for i in range(8)] == [
        0,
        1,
        2,
        3,
        0,
        1,
        2,
        3,
    ]


def test_sticky_keeps_a_session_on_its_instance() -> None:
    c = cluster(overflow=2)
    c.session_instance["s"] = 2
    load(c, [0, 0, 8, 0])  # busiest, but its queue is within the overflow limit
    queued(c, 2, 2)
    assert Sticky().route(request(0, 0.0, [1], session="s"), c) == 2
    assert (
        Sticky().route(request(1, 0.0, [1], session="new"), c) != 2
    )  # a new session: least loaded


def test_sticky_overflows_past_the_queue_limit() -> None:
    c = cluster(overflow=2)
    c.session_instance["s"] = 2
    load(c, [4, 1, 0, 3])
    queued(c, 2, 3)  # one past sticky_overflow_queue
    assert Sticky().route(request(0, 0.0, [1], session="s"), c) == 1


def test_sticky_through_the_cluster() -> None:
    """Every turn of a session lands where the first did; the cluster remembers the latest home."""
    requests = [request(i, float(i), context(0, 2 + i), session="s") for i in range(5)]
    requests += [request(5 + i, 0.5 + i, context(100 + 10 * i, 2)) for i in range(5)]
    requests.sort(key=lambda r: r.arrival)
    for i, r in enumerate(requests):
        r.index = i
    c = CheckedCluster(scenario(prefill=1e4, instances=4), requests, Sticky(), Policy())
    c.run()
    homes = {r.instance for r in requests if r.session_id == "s"}
    assert len(homes) == 1 and c.session_instance["s"] in homes
    assert all(r.hit_blocks == r.reused_blocks for r in requests if r.session_id == "s")


def test_kv_aware_picks_the_instance_holding_most_reused_blocks() -> None:
    c = cluster(overflow=2)
    c.written.update(context(0, 6))
    r = request(0, 0.0, [*context(0, 6), 99])
    for b in context(0, 2):
        c.instances[0].hbm.insert(b)
    for b in context(0, 5):
        c.instances[3].hbm.insert(b)
    for b in [99, 100, 101, 102, 103, 104]:  # resident but not reused: does not count
        c.instances[1].hbm.insert(b)
    load(c, [0, 0, 0, 6])
    assert KvAware().route(r, c) == 3  # despite the load
    queued(c, 3, 3)  # overloaded: its blocks no longer count
    assert KvAware().route(r, c) == 0


def test_kv_aware_breaks_ties_by_load() -> None:
    c = cluster()
    load(c, [3, 1, 2, 5])
    assert KvAware().route(request(0, 0.0, [7, 8]), c) == 1  # nothing reused anywhere: least loaded


def test_make_router() -> None:
    store = MemoryStore(bytes_per_token=BYTES_PER_TOKEN, block_tokens=BLOCK_TOKENS)
    assert [
        make_router(n, store=store, scenario=scenario(prefill=1e4)).name for n in ROUTERS
    ] == list(ROUTERS)
    with pytest.raises(
        ValueError,
        match="unknown router 'nope'; choose from sticky, least-loaded, kv-aware, hinted",
    ):
        make_router("nope")
    with pytest.raises(ValueError, match="the hinted router reads the engine's own state"):
        make_router("hinted")


def test_the_router_sees_the_request() -> None:
    seen: list[SimRequest] = []

    class Spy(LeastLoaded):
        def route(self, r: SimRequest, cluster: Cluster) -> int:
            seen.append(r)
            return super().route(r, cluster)

    r = request(0, 0.0, [1])
    CheckedCluster(scenario(prefill=1e4), [r], Spy(), Policy()).run()
    assert seen == [r] and r.instance == 0


# -- hinted -----------------------------------------------------------------------------------

_ids = itertools.count()


def engine_store(
    c: Cluster, session: str, blocks: Sequence[int], hbm: dict[int, Sequence[int]]
) -> MemoryStore:
    """The engine's view: `session` finished a turn with context `blocks`, each instance of `hbm`
    holds the given blocks, and the pool holds them all."""
    store = MemoryStore(bytes_per_token=BYTES_PER_TOKEN, block_tokens=BLOCK_TOKENS)
    events: list = [
        RequestFinished(
            event_id=f"e{next(_ids)}",
            ts=1.0,
            session_id=session,
            request_id="r0",
            instance_id="gpu-0",
            output_tokens=0,
            block_hashes=list(blocks),
        ),
        KvBlocksStored(event_id=f"e{next(_ids)}", ts=1.0, tier="pool", block_hashes=list(blocks)),
    ]
    events += [
        KvBlocksStored(
            event_id=f"e{next(_ids)}",
            ts=1.0,
            tier="hbm",
            instance_id=f"gpu-{i}",
            block_hashes=list(held),
        )
        for i, held in hbm.items()
    ]
    store.apply(events)
    return store


def hinted(c: Cluster, store: MemoryStore) -> Hinted:
    return Hinted(store, hint_config(c.scenario))


def test_hinted_sends_a_returning_session_where_its_context_is() -> None:
    c = cluster(overflow=2)
    store = engine_store(c, "s", context(0, 8), {2: context(0, 8), 1: context(0, 3)})
    load(c, [0, 1, 8, 2])  # gpu-2 runs every slot but has no queue: nothing to wait for
    assert all(
        hinted(c, store).route(request(i, 0.0, [*context(0, 8), 99], session="s"), c) == 2
        for i in range(4)
    )


def test_hinted_leaves_a_much_busier_home_for_the_next_best() -> None:
    c = cluster(overflow=2)
    store = engine_store(c, "s", context(0, 8), {2: context(0, 8), 1: context(0, 3)})
    load(c, [0, 0, 8, 0])
    queued(c, 2, 1)  # one queued behind 8 running: ~1.25 s of wait against 0.05 s of recompute
    # gpu-1 holds 3 of the 8 blocks: it beats gpu-0 and gpu-3, which hold none.
    assert hinted(c, store).route(request(0, 0.0, context(0, 9), session="s"), c) == 1


def test_hinted_reads_where_the_context_is_from_the_engine_not_the_cluster() -> None:
    c = cluster()
    for b in context(0, 8):  # the cluster holds it on gpu-0, but the engine was never told
        c.instances[0].hbm.insert(b)
    store = engine_store(c, "s", context(0, 8), {3: context(0, 8)})
    assert hinted(c, store).route(request(0, 0.0, context(0, 8), session="s"), c) == 3


def test_hinted_sends_a_new_session_to_the_least_loaded() -> None:
    c = cluster()
    store = engine_store(c, "s", context(0, 8), {2: context(0, 8)})
    load(c, [5, 3, 9, 4])
    r = request(0, 0.0, context(100, 4), session="new")
    assert hinted(c, store).route(r, c) == LeastLoaded().route(r, c) == 1
    load(c, [0, 0, 0, 0])
    assert [hinted(c, store).route(request(i, 0.0, [1], session="new"), c) for i in range(4)] == [
        0,
        1,
        2,
        3,
    ]


def test_hinted_replays_deterministically_and_keeps_sessions_on_their_context(
    tmp_path: Path,
) -> None:
    trace = load_trace(trace_slice(tmp_path, "conversation_first60", 300))
    scen = load_scenario("default")
    runs = [replay(trace, scen, router=r) for r in ("hinted", "hinted", "least-loaded")]
    first, again, spread = (run.summary for run in runs)
    assert {k: v for k, v in first.items() if k != "wall_seconds"} == {
        k: v for k, v in again.items() if k != "wall_seconds"
    }
    assert [r.instance for r in runs[0].requests] == [r.instance for r in runs[1].requests]
    assert first["byte_hit_rate"] > spread["byte_hit_rate"]
