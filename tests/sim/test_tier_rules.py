"""The cluster model and the service's scheduler follow one set of tier rules
(app/decide/room_and_links.py): for the same blocks and the same residency they split them by
source the same way, and the cluster's prefetches move them so. The residency is the same: the
cluster reports its host tier as an engine would, and a prefetch reads the tier its order names."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.decide.scheduler import Scheduler, SchedulerConfig
from app.state import MemoryStore
from kvprefetch_client.events import KvBlocksStored, event_adapter
from sim.cluster import Cluster
from sim.policies import Policy
from tests.sim.test_cluster import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    BYTES_PER_TOKEN,
    CheckedCluster,
    Placed,
    request,
    scenario,
)

_ids = itertools.count()
BLOCK_IDS = st.integers(0, 40)


def scheduler_split(
    blocks: list[int], host: set[int], pool: set[int]
) -> list[tuple[str, list[int]]]:
    """The scheduler's sources for `blocks` at gpu-0, its store told what gpu-0's host tier and
    the pool hold, as the engine's events would tell it."""
    store = MemoryStore(bytes_per_token=BYTES_PER_TOKEN, block_tokens=BLOCK_TOKENS)
    store.apply(
        [
            KvBlocksStored(
                event_id=f"e{next(_ids)}",
                ts=0.0,
                tier=tier,
                instance_id=instance,
                block_hashes=sorted(held),
            )
            for tier, instance, held in (("host", "gpu-0", host), ("pool", None, pool))
            if held
        ]
    )
    room = Scheduler(store, SchedulerConfig(bytes_per_block=BLOCK_BYTES)).room
    return [(tier, list(part)) for tier, part in room.sources("gpu-0", list(blocks))]


def cluster_holding(host: set[int], pool: set[int]) -> Cluster:
    """A one-instance cluster whose host tier holds `host` and whose pool holds `pool`."""
    cluster = Cluster(
        scenario(prefill=100.0, instances=1, hbm_blocks=64, host_blocks=64),
        [],
        Placed([]),
        Policy(),
    )
    for b in host:
        cluster.instances[0].host.insert(b)  # type: ignore[union-attr]
    cluster.written.update(pool)
    return cluster


@settings(max_examples=300, deadline=None)
@given(
    blocks=st.lists(BLOCK_IDS, max_size=20, unique=True),
    host=st.sets(BLOCK_IDS, max_size=30),
    pool=st.sets(BLOCK_IDS, max_size=30),
)
def test_the_cluster_and_the_scheduler_split_the_same_blocks_the_same_way(
    blocks: list[int], host: set[int], pool: set[int]
) -> None:
    cluster = cluster_holding(host, pool)
    assert cluster.by_source(cluster.instances[0], blocks) == scheduler_split(blocks, host, pool)


@settings(max_examples=200, deadline=None)
@given(
    blocks=st.lists(BLOCK_IDS, min_size=1, max_size=20, unique=True),
    host=st.sets(BLOCK_IDS, max_size=30),
    pool=st.sets(BLOCK_IDS, max_size=30),
)
def test_a_prefetch_moves_each_part_over_the_link_the_scheduler_booked(
    blocks: list[int], host: set[int], pool: set[int]
) -> None:
    pool |= host  # the host tier holds what HBM evicted: blocks computed, so in the pool too
    cluster = cluster_holding(host, pool)
    inst = cluster.instances[0]
    cluster.prefetch(0, blocks)
    started = sorted(
        (t.transfer_id, tier, t.blocks)
        for tier, link in (("host", inst.host_link), ("pool", inst.pool_link))
        for t in link.active.values()
    )
    assert [(tier, part) for _, tier, part in started] == scheduler_split(blocks, host, pool)


# -- the host tier's residency, reported ---------------------------------------------------------


def run_reporting(
    contexts: list[list[int]], *, hbm_blocks: int, host_blocks: int
) -> tuple[Cluster, MemoryStore, list[tuple[str, dict[str, Any]]]]:
    """One instance serving `contexts` one at a time, 10 s apart; its events applied to a store
    as the engine's ingest would."""
    store = MemoryStore(bytes_per_token=BYTES_PER_TOKEN, block_tokens=BLOCK_TOKENS)
    emitted: list[tuple[str, dict[str, Any]]] = []

    def emit(kind: str, ts: float, fields: dict[str, Any]) -> None:
        emitted.append((kind, fields))
        event = {"type": kind, "event_id": f"e{next(_ids)}", "ts": ts, **fields}
        store.apply([event_adapter.validate_python(event)])

    scen = scenario(
        prefill=100.0, instances=1, hbm_blocks=hbm_blocks, host_blocks=host_blocks, max_running=1
    )
    requests = [request(i, 10.0 * i, blocks) for i, blocks in enumerate(contexts)]
    cluster = CheckedCluster(scen, requests, Placed([0] * len(requests)), Policy(), emit=emit)
    cluster.run()
    return cluster, store, emitted


def host_events(emitted: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, set[int]]]:
    return [
        (kind, set(fields["block_hashes"]))
        for kind, fields in emitted
        if fields.get("tier") == "host"
    ]


def test_the_host_tier_reports_what_hbm_evicts_into_it_and_what_it_evicts() -> None:
    # HBM and host DRAM of 4 blocks each: the second context pushes the first into the host, the
    # third pushes the second there, evicting the first from it.
    _, store, emitted = run_reporting(
        [[0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23]], hbm_blocks=4, host_blocks=4
    )
    assert host_events(emitted) == [
        ("kv_blocks_stored", {0, 1, 2, 3}),
        ("kv_blocks_removed", {0, 1, 2, 3}),
        ("kv_blocks_stored", {10, 11, 12, 13}),
    ]
    blocks = [0, 1, 2, 3, 10, 11, 12, 13, 20]
    assert store.holds("host", "gpu-0", blocks) == [b in {10, 11, 12, 13} for b in blocks]


@settings(max_examples=100, deadline=None)
@given(contexts=st.lists(st.lists(st.integers(0, 15), min_size=1, max_size=4), max_size=12))
def test_the_store_sees_what_the_host_tier_holds(contexts: list[list[int]]) -> None:
    cluster, store, _ = run_reporting(contexts, hbm_blocks=4, host_blocks=3)
    host = cluster.instances[0].host
    blocks = list(range(16))
    assert store.holds("host", "gpu-0", blocks) == [b in host for b in blocks]  # type: ignore[operator]


def test_no_host_tier_reports_nothing_of_one() -> None:
    _, _, emitted = run_reporting(
        [[0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23]], hbm_blocks=4, host_blocks=0
    )
    assert host_events(emitted) == []


# -- a prefetch reads the tier its order names ---------------------------------------------------


@pytest.mark.parametrize(
    ("source", "host_part", "pool_part"),
    [
        (None, [1, 2], [3]),  # a policy's own prefetch: the rule
        ("host", [1, 2], [3]),  # what the host no longer holds comes from the pool
        ("pool", [], [1, 2, 3]),  # over the link the scheduler booked, host copy or not
    ],
)
def test_a_prefetch_reads_the_tier_its_order_names(
    source: str | None, host_part: list[int], pool_part: list[int]
) -> None:
    cluster = cluster_holding({1, 2}, {1, 2, 3})
    inst = cluster.instances[0]
    assert cluster.prefetch(0, [1, 2, 3], source) == 3
    moved = {
        tier: [b for t in link.active.values() for b in t.blocks]
        for tier, link in (("host", inst.host_link), ("pool", inst.pool_link))
    }
    assert moved == {"host": host_part, "pool": pool_part}
