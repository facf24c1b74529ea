"""RedisStore against the real Redis: same views as MemoryStore, idempotent across replicas.

The contract suite (test_store_contract.py) checks the rules case by case; here random event
streams are applied to both stores and every view is compared.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis as redis_lib

from app.core.errors import StoreUnavailable
from app.state import LogPosition, MemoryStore, cursor_of
from app.state.redis import RedisStore
from kvprefetch_client.events import Event, event_adapter

pytestmark = pytest.mark.redis

BPT = 327_680
BLOCK = 512

# Odd ids: a key separator, non-ASCII, a space, quotes and glob characters (clear() scans by glob).
SESSIONS = [f"s{i}" for i in range(5)] + ["s:sa:x", 'ünï cödé*?["q"]']
INSTANCES = ["g0", "g1", "g2", "g:3"]
ORDERS = ["o0", "o1", "o2", "o3"]
# 5 and "5" are different blocks; big and negative ints as vLLM sends them.
BLOCKS: list[Any] = [*range(12), "5", "a1", "b2", "ÿ", 2**63 + 7, -(2**40), 2**64 - 1]
MEDIA = [None, "GPU", "gpu", "CPU", "DISK", "weird"]
TIERS = ["hbm", "host", "disk", "pool"]


@pytest.fixture
def rstore(redis_url: str, clean_redis: str) -> Iterator[RedisStore]:
    s = RedisStore.from_url(redis_url, prefix=clean_redis, bytes_per_token=BPT, block_tokens=BLOCK)
    yield s
    s.close()


def _ev(**fields: Any) -> Event:
    return event_adapter.validate_python(fields)


class _Gen:
    """Random valid events.

    set_function=True: a stream whose views MemoryStore computes the same in any order: at most
    RECENT_REQUESTS request ids per session, distinct timestamps for every event outside the
    residency registers (whose tie rule is order-free), one block_tokens value per location.
    set_function=False: ties everywhere, more requests than the cap, block_tokens varying:
    only the same order is comparable.
    """

    def __init__(self, seed: int, *, set_function: bool) -> None:
        self.rng = random.Random(seed)
        self.set_function = set_function
        self.n = 0
        self.used_ts: set[float] = set()
        rng = self.rng
        self.epoch = rng.choice([0.0, 1.7e9])
        # Residency timestamps: a small grid, so stores, removals and clears tie.
        self.kv_grid = [self._weird_ts() for _ in range(10)]
        self.inst_bt = {i: rng.choice([16, 32, 64, 512]) for i in INSTANCES}
        self.pool_bt = 128
        self.requests = {s: [f"r{j}" for j in range(3 if set_function else 6)] for s in SESSIONS}
        self.any_grid = [self._weird_ts() for _ in range(12)]

    def _weird_ts(self) -> float:
        rng = self.rng
        kind = rng.randrange(4)
        if kind == 0:
            t = float(rng.randrange(0, 1000))
        elif kind == 1:
            t = round(rng.uniform(0, 1000), 1)  # 0.1-ish values: not exact in binary
        elif kind == 2:
            t = rng.uniform(0, 1000)  # all 17 digits matter
        else:
            t = rng.randrange(0, 10**8) * 1e-05
        return self.epoch + t

    def ts(self) -> float:
        """A timestamp for an LWW field: distinct in set_function mode."""
        if not self.set_function:
            return self.rng.choice(self.any_grid)
        while True:
            t = self._weird_ts()
            if t not in self.used_ts:
                self.used_ts.add(t)
                return t

    def kv_ts(self) -> float:
        return self.rng.choice(self.kv_grid)

    def eid(self) -> str:
        self.n += 1
        return f"ev-{self.n}"

    def blocks(self, lo: int = 1, hi: int = 6) -> list[Any]:
        return [self.rng.choice(BLOCKS) for _ in range(self.rng.randint(lo, hi))]

    def bt_for(self, tier: str, instance: str | None) -> int | None:
        rng = self.rng
        if not self.set_function:
            return rng.choice([None, 16, 32, 256])
        if rng.random() < 0.4:
            return None
        return self.pool_bt if instance is None else self.inst_bt[instance]

    def where(self) -> tuple[str, str | None]:
        tier = self.rng.choice(TIERS)
        return tier, None if tier == "pool" else self.rng.choice(INSTANCES)

    def event(self) -> Event:
        rng = self.rng
        kind = rng.choices(
            [
                "routed",
                "started",
                "finished",
                "closed",
                "stored",
                "removed",
                "cleared",
                "vllm",
                "status",
                "order",
            ],
            weights=[14, 8, 10, 3, 10, 6, 1, 5, 5, 5],
        )[0]
        base = {"event_id": self.eid()}
        if kind in ("routed", "started", "finished"):
            sid = rng.choice(SESSIONS)
            base.update(
                session_id=sid,
                request_id=rng.choice(self.requests[sid]),
                instance_id=rng.choice(INSTANCES),
                ts=self.ts(),
            )
            extra: dict[str, Any] = {}
            if kind != "started" and rng.random() < 0.6:
                extra["block_hashes"] = self.blocks(0, 8)
                if rng.random() < 0.5:
                    extra["block_tokens"] = rng.choice([16, 512, 1024])
            if kind == "routed":
                return _ev(
                    type="request_routed", prompt_tokens=rng.randrange(0, 20_000), **base, **extra
                )
            if kind == "started":
                return _ev(type="request_started", **base)
            if rng.random() < 0.5:
                extra["context_tokens"] = rng.randrange(0, 30_000)
            return _ev(
                type="request_finished", output_tokens=rng.randrange(0, 2000), **base, **extra
            )
        if kind == "closed":
            return _ev(type="session_closed", session_id=rng.choice(SESSIONS), ts=self.ts(), **base)
        if kind in ("stored", "removed", "cleared"):
            tier, inst = self.where()
            base.update(tier=tier, instance_id=inst, ts=self.kv_ts())
            if kind == "stored":
                bt = self.bt_for(tier, inst)
                return _ev(
                    type="kv_blocks_stored",
                    block_hashes=self.blocks(),
                    parent_block_hash=rng.choice([None, 3]),
                    block_tokens=bt,
                    **base,
                )
            if kind == "removed":
                return _ev(type="kv_blocks_removed", block_hashes=self.blocks(1, 4), **base)
            return _ev(type="kv_blocks_cleared", **base)
        if kind == "vllm":
            inst = rng.choice(INSTANCES)
            subs: list[Any] = []
            for _ in range(rng.randint(1, 4)):
                r = rng.random()
                size = self.inst_bt[inst] if self.set_function else rng.choice([16, 32])
                if r < 0.55:
                    if rng.random() < 0.5:
                        subs.append(
                            {
                                "type": "BlockStored",
                                "block_hashes": self.blocks(),
                                "parent_block_hash": None,
                                "token_ids": [1, 2],
                                "block_size": size,
                                "lora_id": None,
                                "medium": rng.choice(MEDIA),
                                "group_idx": 0,
                            }
                        )
                    else:  # the older array encoding
                        subs.append(
                            ["BlockStored", self.blocks(), None, [], size, None, rng.choice(MEDIA)]
                        )
                elif r < 0.9:
                    subs.append(
                        {
                            "type": "BlockRemoved",
                            "block_hashes": self.blocks(1, 3),
                            "medium": rng.choice(MEDIA),
                        }
                    )
                else:
                    subs.append({"type": "AllBlocksCleared"})
            return _ev(
                type="vllm_kv_events",
                instance_id=inst,
                events=subs,
                ts=self.kv_ts(),
                data_parallel_rank=rng.choice([None, 0]),
                **base,
            )
        if kind == "status":
            total = rng.choice([None, 10**12, 2**53])
            free = rng.randrange(0, total if total else 10**9)
            return _ev(
                type="instance_status",
                instance_id=rng.choice(INSTANCES),
                ts=self.ts(),
                free_kv_bytes=free,
                total_kv_bytes=total,
                queue_depth=rng.randrange(0, 50),
                running_requests=rng.randrange(0, 50),
                **base,
            )
        status = rng.choice(["accepted", "completed", "failed"])
        fields: dict[str, Any] = {}
        if status == "completed" or rng.random() < 0.3:
            fields.update(bytes=rng.randrange(0, 2**40), seconds=rng.uniform(0, 30))
        if status == "failed":
            fields["reason"] = rng.choice(["link down", "  padded  ", 'ü/"x"'])
        elif rng.random() < 0.2:
            fields["reason"] = rng.choice(["", "  ", "note"])
        return _ev(
            type="order_progress",
            order_id=rng.choice(ORDERS),
            status=status,
            ts=self.ts(),
            **fields,
            **base,
        )

    def stream(self, n: int) -> list[Event]:
        events = [self.event() for _ in range(n)]
        # Resends: the same events (same ids) again, later in the stream.
        for _ in range(n // 8):
            e = self.rng.choice(events)
            events.insert(self.rng.randrange(len(events) + 1), e)
        return events


def _apply_in_batches(
    stores: list[Any], events: list[Event], rng: random.Random, *, compare_views: bool = False
) -> None:
    """Apply in random batch sizes; apply() results (and views, if asked) must agree throughout."""
    i = 0
    while i < len(events):
        k = rng.randint(1, 60)
        batch = events[i : i + k]
        results = [s.apply(batch) for s in stores]
        assert all(r == results[0] for r in results), (batch, results)
        if compare_views:
            want = _views(stores[0])
            for s in stores[1:]:
                _assert_same(_views(s), want)
        i += k


def _views(store: Any) -> dict[str, Any]:
    locs = store.locations()
    holds = {
        loc.location: store.holds(loc.tier, loc.instance_id, BLOCKS)  # type: ignore[arg-type]
        for loc in locs
    }
    return {
        "sessions": {s: store.session(s) for s in [*SESSIONS, "never-seen"]},
        "instances": store.instances(),
        "locations": locs,
        "holds": holds,
        "holds_unknown": store.holds("disk", "nowhere", BLOCKS),
        "orders": {o: store.order(o) for o in [*ORDERS, "never-seen"]},
        "stats": store.stats(),
        "live": store.live_sessions(len(SESSIONS) + 1),
        "live_pages": _live_pages(store, 2),
    }


def _live_pages(store: Any, size: int) -> list[list[str]]:
    """The live listing walked page by page: ids in the same order, cut at the same places."""
    pages, cursor = [], None
    while page := store.live_sessions(size, before=cursor):
        pages.append([v.session_id for v in page])
        cursor = cursor_of(page[-1])
    return pages


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for part in want:
        if part in ("sessions", "orders"):
            for key in want[part]:
                assert got[part][key] == want[part][key], (part, key)
        else:
            assert got[part] == want[part], part


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_random_streams_give_memory_views_in_any_order(
    redis_url: str, clean_redis: str, seed: int
) -> None:
    rng = random.Random(seed * 7919)
    events = _Gen(seed, set_function=True).stream(400)
    memory = MemoryStore(bytes_per_token=BPT, block_tokens=BLOCK)
    first = RedisStore.from_url(
        redis_url, prefix=f"{clean_redis}:a", bytes_per_token=BPT, block_tokens=BLOCK
    )
    second = RedisStore.from_url(
        redis_url, prefix=f"{clean_redis}:b", bytes_per_token=BPT, block_tokens=BLOCK
    )
    try:
        _apply_in_batches([memory, first], events, rng, compare_views=True)
        want = _views(memory)
        assert want["stats"]["sessions"] >= 5 and want["stats"]["resident_blocks"] > 0
        _assert_same(_views(first), want)

        shuffled = events[:]
        rng.shuffle(shuffled)
        _apply_in_batches([second], shuffled, rng)
        memory_shuffled = MemoryStore(bytes_per_token=BPT, block_tokens=BLOCK)
        memory_shuffled.apply(shuffled)
        _assert_same(_views(memory_shuffled), want)  # the generator keeps to order-free streams
        _assert_same(_views(second), want)
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_tie_heavy_streams_match_memory_in_the_same_order(rstore: RedisStore, seed: int) -> None:
    # Timestamp ties and more requests than the cap: MemoryStore's result depends on the order
    # here (later-applied wins a tie, the request cap drops by rank); RedisStore matches it.
    rng = random.Random(seed)
    events = _Gen(seed, set_function=False).stream(500)
    memory = MemoryStore(bytes_per_token=BPT, block_tokens=BLOCK)
    _apply_in_batches([memory, rstore], events, rng, compare_views=True)
    _assert_same(_views(rstore), _views(memory))


@pytest.mark.parametrize(
    ("seed", "set_function"), [(31, True), (32, True), (33, False), (34, False)]
)
def test_short_windows_expire_exactly_as_in_memory(
    redis_url: str, clean_redis: str, seed: int, set_function: bool
) -> None:
    # Events arriving up to 40 s late against a 5 s reorder window and a 20 s retention: tombstones
    # die, sessions are forgotten and restarted, late events ignored, all the time. Expiry is exact
    # in both stores, so the views agree after every batch.
    windows: dict[str, Any] = dict(reorder_window_seconds=5.0, session_retention_seconds=20.0)
    rng = random.Random(seed)
    events = _Gen(seed, set_function=set_function).stream(600)
    events.sort(key=lambda e: e.ts + rng.uniform(0.0, 40.0))
    memory = MemoryStore(bytes_per_token=BPT, block_tokens=BLOCK, **windows)
    redis_store = RedisStore.from_url(
        redis_url, prefix=clean_redis, bytes_per_token=BPT, block_tokens=BLOCK, **windows
    )
    forgotten = restarted = 0
    first_seen: dict[str, float] = {}
    try:
        for i in range(0, len(events), 50):
            _apply_in_batches([memory, redis_store], events[i : i + 50], rng, compare_views=True)
            for s in SESSIONS:
                v = memory.session(s)
                if v is None:
                    forgotten += s in first_seen
                    continue
                restarted += v.first_seen_ts > first_seen.get(s, v.first_seen_ts)
                first_seen[s] = v.first_seen_ts
        assert forgotten and restarted  # the stream exercised both
    finally:
        redis_store.close()


@pytest.mark.parametrize("seed", [41, 42, 43])
def test_a_capped_fleet_forgets_and_refuses_instances_exactly_as_in_memory(
    redis_url: str, clean_redis: str, seed: int
) -> None:
    # Four instances, at most two held, each forgotten 15 s after it was last named, events up to
    # 30 s late: instances are refused, forgotten with their locations and started afresh all the
    # time, and the views agree after every batch.
    bounds: dict[str, Any] = dict(
        reorder_window_seconds=5.0,
        session_retention_seconds=20.0,
        max_instances=2,
        instance_retention_seconds=15.0,
    )
    rng = random.Random(seed)
    events = _Gen(seed, set_function=True).stream(600)
    events.sort(key=lambda e: e.ts + rng.uniform(0.0, 30.0))
    memory = MemoryStore(bytes_per_token=BPT, block_tokens=BLOCK, **bounds)
    redis_store = RedisStore.from_url(
        redis_url, prefix=clean_redis, bytes_per_token=BPT, block_tokens=BLOCK, **bounds
    )
    held: set[frozenset[str]] = set()
    try:
        for i in range(0, len(events), 50):
            _apply_in_batches([memory, redis_store], events[i : i + 50], rng, compare_views=True)
            assert memory.stats()["instances"] <= 2
            held.add(frozenset(v.instance_id for v in memory.instances()))
        assert len(held) > 2  # the stream moved the fleet around
    finally:
        redis_store.close()


def test_expiry_deletes_keys_a_bounded_number_per_call(redis_url: str, clean_redis: str) -> None:
    store = RedisStore.from_url(
        redis_url,
        prefix=clean_redis,
        bytes_per_token=BPT,
        block_tokens=BLOCK,
        reorder_window_seconds=10.0,
        session_retention_seconds=100.0,
    )
    client = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    p = clean_redis
    try:
        store.apply(
            [
                _ev(
                    type="request_routed",
                    event_id=f"r{i}",
                    ts=1.0 + i / 1000,
                    session_id=f"s{i}",
                    request_id="r",
                    instance_id="g",
                    prompt_tokens=1,
                )
                for i in range(100)
            ]
        )
        store.apply(
            [
                _ev(
                    type="kv_blocks_removed",
                    event_id=f"x{i}",
                    ts=float(i),
                    instance_id="g",
                    block_hashes=[i],
                )
                for i in range(50)
            ]
        )
        assert (
            client.zcard(f"{p}:tomb:hbm@g") == 11
        )  # 39..49: the others died as the location moved
        # One event moves the cutoff past all 100 sessions; the call deletes 2 * 1 + 16 of them.
        store.apply(
            [_ev(type="instance_status", event_id="i", ts=500.0, instance_id="g", free_kv_bytes=1)]
        )
        assert client.zcard(f"{p}:sessions") == 100 - 18
        assert client.exists(f"{p}:s:s0") == 0 and client.exists(f"{p}:s:s99") == 1
        assert (
            store.stats()["sessions"] == 0
            and store.session("s99") is None
            and store.live_sessions(10) == []
        )
        for n in range(5):
            store.apply(
                [
                    _ev(
                        type="instance_status",
                        event_id=f"i{n}",
                        ts=500.0,
                        instance_id="g",
                        free_kv_bytes=1,
                    )
                ]
            )
        assert client.zcard(f"{p}:sessions") == 0
        assert not list(client.scan_iter(match=f"{p}:s:*"))
    finally:
        client.close()
        store.close()


def test_timestamps_and_block_types_round_trip_exactly(rstore: RedisStore) -> None:
    ts = [0.1 + 0.2, 1e-05, 1_700_000_000.123456789, 5e-324, 99_999_999_999.99998]
    events = [
        _ev(
            type="request_routed",
            event_id=f"e{i}",
            ts=t,
            session_id="s",
            request_id=f"r{i % 3}",
            instance_id="g",
            prompt_tokens=i,
            block_hashes=[5, "5", 2**64 - 1, -(2**63), '"5"'],
        )
        for i, t in enumerate(ts)
    ]
    events.append(
        _ev(
            type="order_progress",
            event_id="o",
            ts=0.1 + 0.2,
            order_id="o",
            status="completed",
            bytes=2**53,
            seconds=1 / 3,
        )
    )
    memory = MemoryStore(bytes_per_token=BPT, block_tokens=BLOCK)
    memory.apply(events)
    rstore.apply(events)
    v = rstore.session("s")
    assert v == memory.session("s")
    assert v.recent_arrivals_ts == sorted(ts)
    assert v.block_hashes == [5, "5", 2**64 - 1, -(2**63), '"5"']
    assert [type(h) for h in v.block_hashes] == [int, str, int, int, str]
    assert rstore.order("o") == memory.order("o")
    assert rstore.order("o").seconds == 1 / 3


def test_replicas_apply_each_event_once(redis_url: str, clean_redis: str) -> None:
    events = _Gen(21, set_function=True).stream(300)
    unique_ids = {e.event_id for e in events}
    a = RedisStore.from_url(redis_url, prefix=clean_redis, bytes_per_token=BPT, block_tokens=BLOCK)
    b = RedisStore.from_url(redis_url, prefix=clean_redis, bytes_per_token=BPT, block_tokens=BLOCK)
    try:
        applied: Counter[str] = Counter()
        for store, batch in [(a, events[:150]), (b, events), (a, events), (b, events[100:])]:
            for e, ok in zip(batch, store.apply(batch)):
                applied[e.event_id] += ok
        assert set(applied) == unique_ids
        assert all(n == 1 for n in applied.values())
        assert a.seen(sorted(unique_ids)) == [True] * len(unique_ids)
        assert b.seen(["nope"]) == [False]

        memory = MemoryStore(bytes_per_token=BPT, block_tokens=BLOCK)
        memory.apply(events)
        _assert_same(_views(a), _views(memory))
        _assert_same(_views(b), _views(memory))
    finally:
        a.close()
        b.close()


def test_concurrent_replicas_apply_each_event_once(redis_url: str, clean_redis: str) -> None:
    events = _Gen(22, set_function=True).stream(400)
    stores = [
        RedisStore.from_url(redis_url, prefix=clean_redis, bytes_per_token=BPT, block_tokens=BLOCK)
        for _ in range(4)
    ]
    applied: Counter[str] = Counter()
    lock = threading.Lock()

    def replica(store: RedisStore, seed: int) -> None:
        mine = events[:]
        random.Random(seed).shuffle(mine)
        for i in range(0, len(mine), 37):
            batch = mine[i : i + 37]
            result = store.apply(batch)
            with lock:
                for e, ok in zip(batch, result):
                    applied[e.event_id] += ok

    threads = [threading.Thread(target=replica, args=(s, n)) for n, s in enumerate(stores)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert set(applied) == {e.event_id for e in events}
        assert all(n == 1 for n in applied.values())
        memory = MemoryStore(bytes_per_token=BPT, block_tokens=BLOCK)
        memory.apply(events)
        _assert_same(_views(stores[0]), _views(memory))
    finally:
        for s in stores:
            s.close()


def test_a_vllm_batch_is_applied_once_under_its_own_id(rstore: RedisStore) -> None:
    batch = _ev(
        type="vllm_kv_events",
        event_id="b1",
        ts=3.0,
        instance_id="g",
        events=[
            {"type": "BlockStored", "block_hashes": [1, 2], "block_size": 16},
            {"type": "BlockRemoved", "block_hashes": [1]},
        ],
    )
    assert rstore.apply([batch, batch]) == [True, False]
    assert rstore.seen(["b1", "b1#0", "b1#1"]) == [True, False, False]
    assert rstore.holds("hbm", "g", [1, 2]) == [False, True]
    # A later store of block 1 is not undone by resending the batch.
    rstore.apply(
        [_ev(type="kv_blocks_stored", event_id="s", ts=4.0, instance_id="g", block_hashes=[1])]
    )
    assert rstore.apply([batch]) == [False]
    assert rstore.holds("hbm", "g", [1, 2]) == [True, True]
    assert rstore.stats()["remembered_event_ids"] == 2


def test_a_batch_split_into_many_script_calls_gives_the_same_result(
    rstore: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    import app.state.redis as redis_store

    monkeypatch.setattr(redis_store, "_CHUNK_EVENTS", 7)
    monkeypatch.setattr(redis_store, "_CHUNK_ARGS", 60)
    events = _Gen(41, set_function=False).stream(300)
    memory = MemoryStore(bytes_per_token=BPT, block_tokens=BLOCK)
    assert rstore.apply(events) == memory.apply(events)  # one pipeline of ~50 calls
    _assert_same(_views(rstore), _views(memory))


def test_a_call_that_fails_half_way_marks_nothing(rstore: RedisStore) -> None:
    # Sessions are written back and ids marked at the end of a call: if the call fails, a retry
    # applies the events again without counting a turn twice.
    good = _ev(
        type="request_routed",
        event_id="a",
        ts=1.0,
        session_id="s",
        request_id="r",
        instance_id="g",
        prompt_tokens=10,
    )
    stored = _ev(type="kv_blocks_stored", event_id="b", ts=1.0, instance_id="g", block_hashes=[1])
    args = rstore._head()
    for e in (good, stored):
        ops: list[str] = []
        rstore._encode[e.type](e, ops)
        args += [e.event_id, str(len(ops)), *ops]
    args += ["bad", "1", "no-such-operation"]
    with pytest.raises(redis_lib.ResponseError, match="unknown operation"):
        rstore._apply_script(args=args)
    assert rstore.seen(["a", "b", "bad"]) == [False, False, False]
    assert rstore.session("s") is None
    assert rstore.apply([good, stored, good]) == [True, True, False]
    memory = MemoryStore(bytes_per_token=BPT, block_tokens=BLOCK)
    memory.apply([good, stored])
    assert rstore.session("s") == memory.session("s")
    assert rstore.session("s").turns == 1
    assert rstore.stats() == memory.stats()


def test_a_flushed_script_cache_is_reloaded(rstore: RedisStore, redis_url: str) -> None:
    client = redis_lib.Redis.from_url(redis_url)
    try:
        client.script_flush()
    finally:
        client.close()
    events = _Gen(5, set_function=True).stream(50)
    memory = MemoryStore(bytes_per_token=BPT, block_tokens=BLOCK)
    assert rstore.apply(events) == memory.apply(events)
    assert rstore.stats() == memory.stats()


def test_unreachable_redis_raises_store_unavailable() -> None:
    store = RedisStore.from_url(
        "redis://127.0.0.1:1/0",
        prefix="kvptest-down",
        bytes_per_token=BPT,
        block_tokens=BLOCK,
        timeout_seconds=0.2,
    )
    e = _ev(type="session_closed", event_id="x", ts=1.0, session_id="s")
    try:
        with pytest.raises(StoreUnavailable):
            store.ping()
        with pytest.raises(StoreUnavailable):
            store.apply([e])
        with pytest.raises(StoreUnavailable):
            store.seen(["x"])
        with pytest.raises(StoreUnavailable):
            store.session("s")
        with pytest.raises(StoreUnavailable):
            store.stats()
    finally:
        store.close()


def test_checkpoint_round_trip(rstore: RedisStore, redis_url: str, clean_redis: str) -> None:
    assert rstore.checkpoint("replica-a") is None
    rstore.set_checkpoint("replica-a", LogPosition(3, 4096))
    rstore.set_checkpoint("replica:b", LogPosition(0, 0))
    assert rstore.checkpoint("replica-a") == LogPosition(3, 4096)
    assert rstore.checkpoint("replica:b") == LogPosition(0, 0)
    rstore.set_checkpoint("replica-a", LogPosition(2**40, 2**62))
    other = RedisStore.from_url(
        redis_url, prefix=clean_redis, bytes_per_token=BPT, block_tokens=BLOCK
    )
    try:
        assert other.checkpoint("replica-a") == LogPosition(2**40, 2**62)
    finally:
        other.close()


def test_clear_deletes_only_its_own_prefix(redis_url: str, clean_redis: str) -> None:
    # Prefixes with glob characters, and neighbours a careless MATCH pattern would catch.
    prefixes = {
        "mine": f"{clean_redis}:g*",
        "neighbour": f"{clean_redis}:gother",
        "longer": f"{clean_redis}:g*x",
        "bracket": f"{clean_redis}:[g]*",
    }
    stores = {
        name: RedisStore.from_url(redis_url, prefix=p, bytes_per_token=BPT, block_tokens=BLOCK)
        for name, p in prefixes.items()
    }
    client = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    try:
        events = _Gen(31, set_function=True).stream(60)
        for s in stores.values():
            s.apply(events)
            s.set_checkpoint("r", LogPosition(1, 2))
        before = {
            name: sorted(client.scan_iter(match=_escape(p) + ":*")) for name, p in prefixes.items()
        }
        assert all(before.values())

        stores["mine"].clear()
        assert list(client.scan_iter(match=_escape(prefixes["mine"]) + ":*")) == []
        for name in ("neighbour", "longer", "bracket"):
            assert sorted(client.scan_iter(match=_escape(prefixes[name]) + ":*")) == before[name]
            assert stores[name].checkpoint("r") == LogPosition(1, 2)
        mine = stores["mine"]
        assert mine.session("s0") is None and mine.locations() == [] and mine.instances() == []
        assert mine.checkpoint("r") is None
        assert mine.seen([e.event_id for e in events]) == [False] * len(events)
        assert mine.stats() == dict.fromkeys(mine.stats(), 0)
        # Applying again after a clear starts from scratch.
        memory = MemoryStore(bytes_per_token=BPT, block_tokens=BLOCK)
        assert mine.apply(events) == memory.apply(events)
        _assert_same(_views(mine), _views(memory))
    finally:
        client.close()
        for s in stores.values():
            s.close()


def _escape(s: str) -> str:
    return "".join("\\" + ch if ch in "\\*?[]" else ch for ch in s)


def test_a_store_an_older_version_wrote_is_indexed_by_the_first_batch(
    redis_url: str, clean_redis: str
) -> None:
    bounds: dict[str, Any] = dict(max_instances=3, instance_retention_seconds=50.0)
    store = RedisStore.from_url(
        redis_url, prefix=clean_redis, bytes_per_token=BPT, block_tokens=BLOCK, **bounds
    )
    memory = MemoryStore(bytes_per_token=BPT, block_tokens=BLOCK, **bounds)
    first = [
        _ev(
            type="kv_blocks_stored",
            event_id=f"k{i}",
            ts=10.0 * i,
            instance_id=f"g{i}",
            block_hashes=[i, 100 + i],
        )
        for i in range(3)
    ] + [_ev(type="kv_blocks_stored", event_id="p", ts=1.0, tier="pool", block_hashes=[7])]
    for s in (store, memory):
        s.apply(first)
    # What an older version kept: no activity index, no location names, no block count.
    r = redis_lib.Redis.from_url(redis_url)
    r.delete(
        f"{clean_redis}:instance-activity", f"{clean_redis}:loc-names", f"{clean_redis}:nblocks"
    )
    r.close()
    # At the cap; the next batch moves the cutoff past g0 (heard of at 0), which makes room.
    later = [_ev(type="instance_status", event_id="s", ts=55.0, instance_id="g9", free_kv_bytes=1)]
    for s in (store, memory):
        s.apply(later)
    assert _views(store) == _views(memory)
    assert [i.instance_id for i in store.instances()] == ["g1", "g2", "g9"]
    try:
        assert store.stats()["resident_blocks"] == 5
    finally:
        store.close()
