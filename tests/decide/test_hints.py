"""Route hints: per-candidate bytes and seconds, in-flight orders, host before pool, the recompute
cap, the ranking and its tie-break, and a session with no context."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest

from app.decide.hints import HintConfig, InstanceLoad, prefix_lookups, route_hint
from app.state import MemoryStore
from kvprefetch_client.events import InstanceStatus, KvBlocksStored, RequestFinished, RequestRouted
from kvprefetch_client.orders import Order

BLOCK_TOKENS = 100
BYTES_PER_TOKEN = 1000
BLOCK = BLOCK_TOKENS * BYTES_PER_TOKEN  # 1e5 bytes
# Pool: 0.1 s a block; host: 0.025 s a block; recompute: 0.2 s a block.
CONFIG = HintConfig(
    bytes_per_token=BYTES_PER_TOKEN,
    pool_link_bytes_per_second=1e6,
    host_link_bytes_per_second=4e6,
    prefill_tokens_per_second=500.0,
    request_seconds=8.0,
)
_ids = itertools.count()


def store_with(
    blocks: Sequence[int] = (0, 1, 2, 3),
    *,
    hbm: dict[str, Sequence[int]] | None = None,
    host: dict[str, Sequence[int]] | None = None,
    pool: Sequence[int] = (0, 1, 2, 3),
) -> MemoryStore:
    """Session s, last on gpu-0, idle with context `blocks`; residency as given."""
    store = MemoryStore(bytes_per_token=BYTES_PER_TOKEN, block_tokens=BLOCK_TOKENS)
    events: list = [
        RequestRouted(
            event_id=f"e{next(_ids)}",
            ts=1.0,
            session_id="s",
            request_id="r1",
            instance_id="gpu-0",
            prompt_tokens=len(blocks) * BLOCK_TOKENS,
            block_hashes=list(blocks),
        ),
        RequestFinished(
            event_id=f"e{next(_ids)}",
            ts=2.0,
            session_id="s",
            request_id="r1",
            instance_id="gpu-0",
            output_tokens=0,
            block_hashes=list(blocks),
        ),
    ]
    if pool:
        events.append(
            KvBlocksStored(event_id=f"e{next(_ids)}", ts=2.0, tier="pool", block_hashes=list(pool))
        )
    for tier, where in (("hbm", hbm or {}), ("host", host or {})):
        for inst, held in where.items():
            events.append(
                KvBlocksStored(
                    event_id=f"e{next(_ids)}",
                    ts=2.0,
                    tier=tier,
                    instance_id=inst,
                    block_hashes=list(held),
                )
            )
    store.apply(events)
    return store


def status(store: MemoryStore, instance_id: str, queue: int, running: int) -> None:
    store.apply(
        [
            InstanceStatus(
                event_id=f"e{next(_ids)}",
                ts=3.0,
                instance_id=instance_id,
                free_kv_bytes=10**9,
                queue_depth=queue,
                running_requests=running,
            )
        ]
    )


def prefetch(
    instance_id: str, blocks: Sequence[int], needed_by: float, kind: str = "prefetch"
) -> Order:
    return Order(
        order_id=f"o{next(_ids)}",
        kind=kind,  # type: ignore[arg-type]
        instance_id=instance_id,
        source_tier="pool",
        block_hashes=list(blocks),
        size_bytes=len(blocks) * BLOCK,
        created_ts=0.0,
        start_by_ts=0.0,
        needed_by_ts=needed_by,
        ttl_seconds=60.0 if kind == "pin" else None,
    )


def test_resident_and_missing_bytes_and_the_pool_load() -> None:
    store = store_with(hbm={"gpu-0": [0, 1, 2], "gpu-1": [0]})
    hint = route_hint(store, "s", ["gpu-1", "gpu-0"], 10.0, config=CONFIG)
    one, zero = hint.candidates  # in the order asked for
    assert (zero.instance_id, zero.resident_bytes, zero.missing_bytes, zero.source) == (
        "gpu-0",
        3 * BLOCK,
        BLOCK,
        "pool",
    )
    assert zero.expected_load_seconds == pytest.approx(0.1)
    assert (one.resident_bytes, one.missing_bytes) == (BLOCK, 3 * BLOCK)
    assert one.expected_load_seconds == pytest.approx(0.3)
    assert hint.recommended == "gpu-0" and zero.recommended and not one.recommended
    assert hint.context_known and hint.context_bytes == 4 * BLOCK_TOKENS * BYTES_PER_TOKEN
    assert hint.reason == "gpu-0: 0.100 s to start against 0.300 s on gpu-1"
    assert zero.reason == "3/4 blocks in HBM, rest by pool, ready in 0.100 s; load unknown"


def test_all_resident_needs_nothing() -> None:
    hint = route_hint(store_with(hbm={"gpu-0": [0, 1, 2, 3]}), "s", ["gpu-0"], 10.0, config=CONFIG)
    (c,) = hint.candidates
    assert (c.source, c.missing_bytes, c.expected_load_seconds, c.recommended) == (
        "none",
        0,
        0.0,
        True,
    )
    assert hint.reason == "gpu-0: the only candidate"


def test_host_blocks_come_over_the_faster_host_link_beside_the_pool() -> None:
    store = store_with(host={"gpu-0": [0, 1], "gpu-1": [0, 1, 2, 3]})
    zero, one = route_hint(store, "s", ["gpu-0", "gpu-1"], 10.0, config=CONFIG).candidates
    # gpu-0: 2 blocks from host (0.05 s) beside 2 from the pool (0.2 s): the slower link counts.
    assert (zero.source, zero.expected_load_seconds) == ("host+pool", pytest.approx(0.2))
    assert (one.source, one.expected_load_seconds, one.recommended) == (
        "host",
        pytest.approx(0.1),
        True,
    )


def test_recompute_caps_the_load_and_blocks_held_nowhere_are_recomputed() -> None:
    slow_pool = HintConfig(
        bytes_per_token=BYTES_PER_TOKEN,
        pool_link_bytes_per_second=1e5,  # 1 s a block
        prefill_tokens_per_second=500.0,
    )
    (c,) = route_hint(store_with(), "s", ["gpu-0"], 10.0, config=slow_pool).candidates
    assert (c.source, c.expected_load_seconds) == (
        "recompute",
        pytest.approx(0.8),
    )  # not 4 s over the link
    (c,) = route_hint(store_with(pool=()), "s", ["gpu-0"], 10.0, config=CONFIG).candidates
    assert (c.source, c.missing_bytes, c.expected_load_seconds) == (
        "recompute",
        4 * BLOCK,
        pytest.approx(0.8),
    )


def test_blocks_on_their_way_count_and_are_due_when_their_order_is() -> None:
    store = store_with(hbm={"gpu-0": [0]})
    orders = [
        prefetch("gpu-1", [0, 1, 2, 3, 99], needed_by=10.5),
        prefetch("gpu-0", [1, 2], needed_by=10.25),
        prefetch("gpu-0", [3], needed_by=99.0, kind="pin"),
    ]  # not a move: does not count
    zero, one = route_hint(
        store, "s", ["gpu-0", "gpu-1"], 10.0, config=CONFIG, inflight=orders
    ).candidates
    assert (zero.resident_bytes, zero.inflight_bytes, zero.missing_bytes) == (
        BLOCK,
        2 * BLOCK,
        BLOCK,
    )
    assert zero.expected_load_seconds == pytest.approx(
        0.25
    )  # the order lands after the 0.1 s pool load
    assert (one.resident_bytes, one.inflight_bytes, one.missing_bytes, one.source) == (
        0,
        4 * BLOCK,
        0,
        "none",
    )
    assert one.expected_load_seconds == pytest.approx(0.5)
    assert zero.recommended
    assert zero.reason.startswith(
        "1/4 blocks in HBM, 2 on their way, rest by pool, ready in 0.250 s"
    )
    # An order past due is taken as landing now.
    (late,) = route_hint(store, "s", ["gpu-1"], 20.0, config=CONFIG, inflight=orders[:1]).candidates
    assert late.expected_load_seconds == 0.0


def test_a_queue_outweighs_a_short_load_and_ties_go_to_the_less_loaded() -> None:
    store = store_with(hbm={"gpu-0": [0, 1, 2, 3]})
    status(store, "gpu-0", queue=2, running=16)  # wait 2 x 8 s / 16 = 1 s
    status(store, "gpu-1", queue=0, running=3)
    status(store, "gpu-2", queue=0, running=1)
    hint = route_hint(store, "s", ["gpu-0", "gpu-1", "gpu-2"], 10.0, config=CONFIG)
    zero, one, two = hint.candidates
    assert (zero.queue_depth, zero.running_requests, zero.expected_wait_seconds) == (
        2,
        16,
        pytest.approx(1.0),
    )
    assert one.expected_seconds == two.expected_seconds == pytest.approx(0.4)
    assert hint.recommended == "gpu-2"  # same 0.4 s as gpu-1, fewer requests
    assert hint.reason == "gpu-2: ties gpu-1 at 0.400 s, less loaded"
    # A short queue is worth less than reloading the context elsewhere.
    store.apply(
        [
            InstanceStatus(
                event_id="later",
                ts=4.0,
                instance_id="gpu-0",
                free_kv_bytes=1,
                queue_depth=1,
                running_requests=32,
            )
        ]
    )  # wait 0.25 s
    assert (
        route_hint(store, "s", ["gpu-0", "gpu-1", "gpu-2"], 10.0, config=CONFIG).recommended
        == "gpu-0"
    )


def test_a_tie_goes_to_the_sessions_last_instance_before_the_less_loaded() -> None:
    store = store_with(hbm={"gpu-1": [9]})  # the context is nowhere: every candidate loads it all
    status(store, "gpu-0", queue=0, running=12)  # gpu-0 is where its last turn ran
    status(store, "gpu-1", queue=0, running=1)
    hint = route_hint(store, "s", ["gpu-1", "gpu-0"], 10.0, config=CONFIG)
    assert hint.recommended == "gpu-0"
    assert hint.reason == "gpu-0: ties gpu-1 at 0.400 s, its last instance"


def test_loads_given_by_the_caller_replace_the_stores() -> None:
    store = store_with(hbm={"gpu-0": [0, 1, 2, 3]})
    status(store, "gpu-0", queue=0, running=0)
    loads = {"gpu-0": InstanceLoad(queue_depth=4, running_requests=4), "gpu-1": InstanceLoad(0, 0)}
    hint = route_hint(store, "s", ["gpu-0", "gpu-1"], 10.0, config=CONFIG, loads=loads)
    assert hint.candidates[0].expected_wait_seconds == pytest.approx(8.0)
    assert hint.recommended == "gpu-1"


def test_an_unknown_session_ranks_by_load_alone() -> None:
    store = store_with()
    status(store, "gpu-0", queue=0, running=5)
    status(store, "gpu-1", queue=0, running=2)
    hint = route_hint(store, "nobody", ["gpu-0", "gpu-1", "gpu-9"], 10.0, config=CONFIG)
    assert (hint.context_known, hint.context_bytes) == (False, 0)
    assert [c.expected_load_seconds for c in hint.candidates] == [0.0, 0.0, 0.0]
    assert hint.recommended == "gpu-9"  # never reported: counted as idle
    assert hint.reason == "gpu-9: no context known; ties gpu-1 at 0.000 s, less loaded"
    assert hint.candidates[2].reason == "no context known; load unknown"
    assert hint.candidates[1].reason == "no context known; 0 queued, 2 running, wait 0.000 s"


def test_a_session_without_blocks_has_no_context_to_place() -> None:
    store = MemoryStore(bytes_per_token=BYTES_PER_TOKEN, block_tokens=BLOCK_TOKENS)
    store.apply(
        [
            RequestRouted(
                event_id="r",
                ts=1.0,
                session_id="s",
                request_id="r1",
                instance_id="gpu-0",
                prompt_tokens=300,
            )
        ]
    )
    hint = route_hint(store, "s", ["gpu-0"], 10.0, config=CONFIG)
    assert (hint.context_known, hint.context_bytes) == (False, 300 * BYTES_PER_TOKEN)


def test_bad_candidates_and_config() -> None:
    store = store_with()
    with pytest.raises(ValueError, match="empty"):
        route_hint(store, "s", [], 0.0, config=CONFIG)
    with pytest.raises(ValueError, match="duplicates"):
        route_hint(store, "s", ["gpu-0", "gpu-0"], 0.0, config=CONFIG)
    with pytest.raises(ValueError, match="request_seconds must be positive"):
        HintConfig(bytes_per_token=1, request_seconds=0.0)


class _CountingPresence(dict):  # type: ignore[type-arg]
    """A location's residency that counts the blocks asked about (its `in`, as the store's
    search calls it, in C or in Python)."""

    lookups = 0

    def __contains__(self, h: object) -> bool:
        _CountingPresence.lookups += 1
        return dict.__contains__(self, h)


def test_the_worst_hint_costs_log_n_lookups_per_location_not_the_context() -> None:
    """65,536 blocks over 64 candidates: bounded by counting the blocks looked up, not by time:
    the context's blocks read (any store) and the memory store's own residency lookups."""
    from bench.hints import CountingStore, build

    store = MemoryStore(bytes_per_token=BYTES_PER_TOKEN, block_tokens=BLOCK_TOKENS)
    n, candidates = 65_536, build(store, 65_536, 64)
    locations = 1 + 2 * len(candidates)  # the pool, and each candidate's HBM and host
    bound = locations * prefix_lookups(n)
    assert bound == locations * 17
    counting = CountingStore(store)
    hint = route_hint(counting, "s", candidates, 10.0, config=CONFIG)  # type: ignore[arg-type]
    print(
        f"\n{counting.blocks_looked_up} blocks read in {counting.calls} calls "
        f"(bound {bound}; the whole context per location: {locations * n})"
    )
    assert counting.blocks_looked_up <= bound and counting.calls == 2
    # The store's fast path (its own packed context, searched in C), counted inside it.
    for loc in store._locations.values():
        loc.present = _CountingPresence(loc.present)
    _CountingPresence.lookups = 0
    assert route_hint(store, "s", candidates, 10.0, config=CONFIG) == hint
    print(f"{_CountingPresence.lookups} residency lookups in the store")
    assert 0 < _CountingPresence.lookups <= bound
    # Every candidate holds the first half in HBM and the next quarter on host.
    first = hint.candidates[0]
    assert (first.resident_bytes, first.source) == (n // 2 * BLOCK, "host+pool")
    assert first.missing_bytes == n // 2 * BLOCK


def test_only_the_held_prefix_counts() -> None:
    # Block 2 is missing from gpu-0's HBM: blocks 3 and after are of no use there (a prefix cache
    # stops at the first miss), so they load like the rest.
    store = store_with(hbm={"gpu-0": [0, 1, 3]})
    (zero,) = route_hint(store, "s", ["gpu-0"], 10.0, config=CONFIG).candidates
    assert (zero.resident_bytes, zero.missing_bytes) == (2 * BLOCK, 2 * BLOCK)


def test_orders_with_a_gap_count_only_the_run_up_to_it() -> None:
    """An order moves what was missing when it was planned, so the blocks on their way need not
    be contiguous: with block 1 not coming, blocks 2 and 3 on their way are past the first miss
    (nothing counts as on its way) and the rest loads."""
    store = store_with(hbm={"gpu-0": [0]})
    orders = [prefetch("gpu-0", [2, 3], needed_by=10.25)]
    (c,) = route_hint(store, "s", ["gpu-0"], 10.0, config=CONFIG, inflight=orders).candidates
    assert (c.resident_bytes, c.inflight_bytes, c.missing_bytes) == (BLOCK, 0, 3 * BLOCK)
    orders = [prefetch("gpu-0", [1, 3], needed_by=10.25)]  # 1 coming, 2 not: a run of one
    (c,) = route_hint(store, "s", ["gpu-0"], 10.0, config=CONFIG, inflight=orders).candidates
    assert (c.resident_bytes, c.inflight_bytes, c.missing_bytes) == (BLOCK, BLOCK, 2 * BLOCK)
