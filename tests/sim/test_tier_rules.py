"""The cluster model and the service's scheduler follow one set of tier rules
(app/decide/room_and_links.py): for the same blocks and the same residency they split them by
source the same way, and the cluster's prefetches and demand loads move them so."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from app.decide.scheduler import Scheduler, SchedulerConfig
from app.state import MemoryStore
from kvprefetch_client.events import KvBlocksStored
from sim.cluster import Cluster
from sim.policies import Policy
from tests.sim.test_cluster import BLOCK_BYTES, BLOCK_TOKENS, BYTES_PER_TOKEN, Placed, scenario

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
