"""What an arriving request found: hit, partial or miss on its reused blocks, bytes and stall
estimates."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from app.observe.outcomes import OutcomeConfig, RequestOutcome, judge, outcome_observer
from app.state.memory import MemoryStore
from kvprefetch_client.events import Event, event_adapter

BYTES_PER_TOKEN, BLOCK_TOKENS = 1000, 100
BLOCK_BYTES = BYTES_PER_TOKEN * BLOCK_TOKENS
# Round numbers: a block takes 0.1 s over the pool link, 0.025 s over the host link, 0.01 s to
# recompute.
CONFIG = OutcomeConfig(
    bytes_per_token=BYTES_PER_TOKEN,
    block_tokens=BLOCK_TOKENS,
    pool_link_bytes_per_second=1e6,
    host_link_bytes_per_second=4e6,
    prefill_tokens_per_second=10_000.0,
)


def ev(**fields: Any) -> Event:
    return event_adapter.validate_python(fields)


def stored(event_id: str, tier: str, blocks: list[int], instance_id: str = "gpu-0") -> Event:
    where = (
        {} if tier == "pool" else {"instance_id": instance_id}
    )  # the pool is shared: no instance
    return ev(
        type="kv_blocks_stored", event_id=event_id, ts=1.0, tier=tier, block_hashes=blocks, **where
    )


def routed(
    request_id: str, blocks: list[int] | None, instance_id: str = "gpu-0", **kw: Any
) -> Event:
    return ev(
        type="request_routed",
        event_id=f"q-{request_id}",
        ts=2.0,
        session_id=f"s-{request_id}",
        request_id=request_id,
        instance_id=instance_id,
        prompt_tokens=1000,
        block_hashes=blocks,
        **kw,
    )


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore(bytes_per_token=BYTES_PER_TOKEN, block_tokens=BLOCK_TOKENS)


def outcome_of(
    store: MemoryStore, request: Event, config: OutcomeConfig = CONFIG
) -> RequestOutcome | None:
    store.apply([request])
    found = judge(store, [request], config)
    return found[0] if found else None


def test_every_reused_block_in_hbm_is_a_hit_and_the_new_tail_does_not_count(
    store: MemoryStore,
) -> None:
    store.apply([stored("h", "hbm", [1, 2, 3])])
    o = outcome_of(store, routed("r", [1, 2, 3, 4, 5]))  # 4, 5: this turn's new blocks
    assert o == RequestOutcome(
        request_id="r",
        instance_id="gpu-0",
        outcome="hit",
        reused_blocks=3,
        resident_blocks=3,
        resident_bytes=3 * BLOCK_BYTES,
        missing_bytes=0,
        stall_seconds=0.0,
        stall_avoided_seconds=pytest.approx(0.03),
    )


def test_some_in_hbm_and_the_rest_in_the_pool_is_partial(store: MemoryStore) -> None:
    store.apply([stored("h", "hbm", [1, 2]), stored("p", "pool", [1, 2, 3, 4, 5])])
    o = outcome_of(store, routed("r", [1, 2, 3, 4, 5, 6]))
    assert o is not None
    assert (o.outcome, o.reused_blocks, o.resident_blocks) == ("partial", 5, 2)
    assert (o.resident_bytes, o.missing_bytes) == (2 * BLOCK_BYTES, 3 * BLOCK_BYTES)
    assert o.missing_blocks == {3, 4, 5}  # which ones (the LRU guard prices demotes by them)
    # Three blocks: 0.3 s over the pool link, 0.03 s to recompute: the engine recomputes.
    assert o.stall_seconds == pytest.approx(0.03)
    assert o.stall_avoided_seconds == pytest.approx(0.02)


def test_none_in_hbm_is_a_miss(store: MemoryStore) -> None:
    store.apply([stored("p", "pool", [1, 2]), stored("elsewhere", "hbm", [1, 2], "gpu-1")])
    o = outcome_of(store, routed("r", [1, 2, 3]))
    assert o is not None and (
        o.outcome,
        o.reused_blocks,
        o.resident_blocks,
        o.stall_avoided_seconds,
    ) == ("miss", 2, 0, 0.0)


def test_the_stall_is_the_slower_link_when_loading_beats_recomputing(store: MemoryStore) -> None:
    slow_prefill = OutcomeConfig(
        bytes_per_token=BYTES_PER_TOKEN,
        block_tokens=BLOCK_TOKENS,
        pool_link_bytes_per_second=1e6,
        host_link_bytes_per_second=4e6,
        prefill_tokens_per_second=100.0,
    )  # 1 s a block
    store.apply([stored("host", "host", [1, 2, 3, 4]), stored("p", "pool", [5])])
    o = outcome_of(store, routed("r", [1, 2, 3, 4, 5]), slow_prefill)
    assert o is not None and o.outcome == "miss"
    # Host (4 blocks, 0.1 s) and pool (1 block, 0.1 s) side by side, not 5 s of recompute.
    assert o.stall_seconds == pytest.approx(0.1)
    # Blocks held nowhere before a held one were computed once and are gone: recomputed, 1 s each.
    store.apply([stored("tail", "hbm", [7])])
    gap = outcome_of(store, routed("g", [6, 7]), slow_prefill)
    assert gap is not None and (gap.outcome, gap.reused_blocks, gap.resident_blocks) == (
        "partial",
        2,
        1,
    )
    assert gap.stall_seconds == pytest.approx(1.0)


def test_no_reused_block_means_no_outcome(store: MemoryStore) -> None:
    assert outcome_of(store, routed("first-turn", [1, 2])) is None
    assert outcome_of(store, routed("no-blocks", None)) is None
    assert outcome_of(store, routed("empty", [])) is None


def test_the_requests_own_block_size_counts(store: MemoryStore) -> None:
    store.apply([stored("h", "hbm", [1, 2])])
    o = outcome_of(store, routed("r", [1, 2], block_tokens=16))
    assert o is not None and o.resident_bytes == 2 * 16 * BYTES_PER_TOKEN


class CountingStore:
    """A store that counts its residency reads and what each asked."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.calls: list[list[tuple[str, str | None, int]]] = []

    def present_many(self, queries: Sequence[Any]) -> list[set[Any]]:
        queries = [(tier, instance, list(blocks)) for tier, instance, blocks in queries]
        # Distinct blocks: a query may name one twice (the store reads it once).
        self.calls.append([(tier, inst, len(set(blocks))) for tier, inst, blocks in queries])
        return self.store.present_many(queries)


def test_a_batch_costs_one_read_not_one_per_request_or_instance(store: MemoryStore) -> None:
    store.apply(
        [stored("h0", "hbm", [1, 2]), stored("h1", "hbm", [1], "gpu-1"), stored("p", "pool", [2])]
    )
    batch = [routed(f"r{i}", [1, 2, 3], instance_id=f"gpu-{i % 2}") for i in range(100)]
    batch.append(ev(type="session_closed", event_id="c", ts=3.0, session_id="s-r0"))
    counting = CountingStore(store)
    found = judge(counting, batch, CONFIG)  # type: ignore[arg-type]
    assert [o.outcome for o in found] == ["hit", "partial"] * 50
    # One read: hbm and host per instance, then the pool, each about the blocks named there.
    assert counting.calls == [
        [
            ("hbm", "gpu-0", 3),
            ("host", "gpu-0", 3),
            ("hbm", "gpu-1", 3),
            ("host", "gpu-1", 3),
            ("pool", None, 3),
        ]
    ]


def test_with_the_redis_store_a_batch_is_judged_in_one_round_trip_and_the_same(
    store: MemoryStore, redis_url: str, clean_redis: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis

    from app.state.redis import RedisStore

    shared = RedisStore.from_url(
        redis_url, prefix=clean_redis, bytes_per_token=BYTES_PER_TOKEN, block_tokens=BLOCK_TOKENS
    )
    setup = [
        stored("h0", "hbm", [1, 2]),
        stored("h1", "hbm", [1], "gpu-1"),
        stored("o1", "host", [2, 3], "gpu-1"),
        stored("p", "pool", [2, 4]),
    ]
    batch = [routed(f"r{i}", [1, 2, 3, 4, 5][: 2 + i % 4], f"gpu-{i % 3}") for i in range(30)]
    batch.insert(10, stored("late", "hbm", [3, 4], "gpu-1"))
    for s in (store, shared):
        s.apply(setup)
        s.apply(batch)
    trips: list[str] = []
    single = redis.Redis.execute_command
    piped = redis.client.Pipeline.execute

    def one(self: redis.Redis, *args: Any, **options: Any) -> Any:
        trips.append(str(args[0]))
        return single(self, *args, **options)

    def many(self: redis.client.Pipeline, *args: Any, **kw: Any) -> Any:
        trips.append(f"pipeline of {len(self)}")
        return piped(self, *args, **kw)

    monkeypatch.setattr(redis.client.Pipeline, "execute", many)
    monkeypatch.setattr(redis.Redis, "execute_command", one)
    try:
        found = judge(shared, batch, CONFIG)
    finally:
        monkeypatch.undo()
        shared.close()
    assert trips == ["pipeline of 7"]  # 3 instances' hbm and host, and the pool
    assert found == judge(store, batch, CONFIG)
    assert {o.outcome for o in found} == {"hit", "partial", "miss"}


def test_the_observer_hands_over_a_batch_and_stays_quiet_without_one(store: MemoryStore) -> None:
    got: list[list[str]] = []
    observe = outcome_observer(
        store, CONFIG, lambda outcomes: got.append([o.outcome for o in outcomes])
    )
    store.apply([stored("h", "hbm", [1])])
    observe(
        [
            routed("a", [1]),
            routed("b", [9]),
            ev(type="session_closed", event_id="c", ts=3.0, session_id="x"),
        ]
    )
    observe([routed("c", [9])])
    assert got == [["hit"]]


def test_blocks_stored_later_in_the_same_batch_were_not_there_when_the_request_came(
    store: MemoryStore,
) -> None:
    # The engine loads the context from the pool for the request and reports it, in one batch.
    store.apply([stored("p", "pool", [1, 2])])
    batch = [
        stored("before", "hbm", [7]),
        routed("r", [1, 2, 3]),
        routed("s", [7, 8]),
        ev(
            type="kv_blocks_stored",
            event_id="after",
            ts=5.0,
            tier="hbm",
            instance_id="gpu-0",
            block_hashes=[1, 2, 3],
        ),
        ev(
            type="vllm_kv_events",
            event_id="vllm",
            ts=6.0,
            instance_id="gpu-0",
            events=[
                {"type": "BlockStored", "block_hashes": [8], "block_size": 100, "medium": "GPU"}
            ],
        ),
    ]
    store.apply(batch)
    found = {o.request_id: o for o in judge(store, batch, CONFIG)}
    # r: 1 and 2 came from the pool after it arrived (3 is its new block); s: 7 was there before it.
    assert (found["r"].outcome, found["r"].reused_blocks, found["r"].resident_blocks) == (
        "miss",
        2,
        0,
    )
    assert (found["s"].outcome, found["s"].reused_blocks) == ("hit", 1)


def test_blocks_stored_at_the_same_ts_after_the_request_in_the_batch_were_not_there(
    store: MemoryStore,
) -> None:
    # An engine that stores a request's blocks at the very ts it was routed (the replay's does):
    # later in the batch, not earlier in time, so not there when the request came.
    store.apply([stored("p", "pool", [1, 2])])
    same_ts = ev(
        type="kv_blocks_stored",
        event_id="same",
        ts=2.0,
        tier="hbm",
        instance_id="gpu-0",
        block_hashes=[1, 2, 3],
    )
    batch = [routed("r", [1, 2, 3]), same_ts]
    store.apply(batch)
    (found,) = judge(store, batch, CONFIG)
    assert (found.outcome, found.reused_blocks, found.resident_blocks) == ("miss", 2, 0)
    # Before the request in the batch, at that ts or earlier: there when it came.
    early = MemoryStore(bytes_per_token=BYTES_PER_TOKEN, block_tokens=BLOCK_TOKENS)
    early.apply([stored("p", "pool", [1, 2])])
    batch = [same_ts, routed("r", [1, 2, 3])]
    early.apply(batch)
    (found,) = judge(early, batch, CONFIG)
    assert (found.outcome, found.reused_blocks, found.resident_blocks) == ("hit", 3, 3)
