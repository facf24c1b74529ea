"""MemoryStore's own bounds: the dedupe ring's generations, and what expiry frees (not only
hides). The semantics are the contract suite's (test_store_contract.py)."""

from __future__ import annotations

from app.state import MemoryStore
from tests.state.test_store_contract import BLOCK, BPT, removed, routed, stored


def _ids(store: MemoryStore, ids: list[str]) -> list[bool]:
    return store.seen(ids)


def test_the_dedupe_ring_remembers_the_last_half_at_least_and_max_at_most() -> None:
    store = MemoryStore(bytes_per_token=BPT, block_tokens=BLOCK, dedupe_max_ids=10)
    events = [routed(f"s{i % 7}", f"r{i}", float(i)) for i in range(103)]
    applied: list[str] = []
    for start, size in [(0, 1), (1, 3), (4, 23), (27, 1), (28, 50), (78, 25)]:
        batch = events[start : start + size]
        assert store.apply(batch) == [True] * len(batch)
        applied += [e.event_id for e in batch]
        n = store.stats()["remembered_event_ids"]
        assert min(len(applied), 5) <= n <= 10
        # What is remembered is exactly the last n ids, in order: the newest are never the ones
        # forgotten.
        assert _ids(store, applied) == [False] * (len(applied) - n) + [True] * n
        assert store.apply(batch[-min(len(batch), 5) :]) == [False] * min(len(batch), 5)


def test_an_odd_or_tiny_ring_keeps_its_bounds() -> None:
    for max_ids, least in [(1, 1), (2, 1), (5, 3)]:
        store = MemoryStore(bytes_per_token=BPT, block_tokens=BLOCK, dedupe_max_ids=max_ids)
        for i in range(20):
            store.apply([routed("s", f"r{i}", float(i))])
            assert min(i + 1, least) <= store.stats()["remembered_event_ids"] <= max_ids


def test_a_replaced_generation_is_freed_a_little_per_apply() -> None:
    store = MemoryStore(bytes_per_token=BPT, block_tokens=BLOCK, dedupe_max_ids=1000)
    for i in range(1000):  # the second rotation (at 1000 ids) replaces the first 500
        store.apply([routed("s", f"r{i}", float(i))])
    assert len(store._dying) == 498  # two per event applied
    for i in range(249):
        store.apply([routed("s", f"x{i}", 2000.0 + i)])
    assert len(store._dying) == 0 and store.stats()["remembered_event_ids"] == 749


def test_dead_tombstones_are_freed_not_only_hidden() -> None:
    store = MemoryStore(bytes_per_token=BPT, block_tokens=BLOCK, reorder_window_seconds=10.0)
    loc = None
    for t in range(200):
        store.apply([stored([t], float(t)), removed([t], t + 0.5)])
        loc = store._locations[("hbm", "gpu-0")]
        held = len(loc.removed) + len(loc.removed_old)
        # One removal a second: held between one window and about two windows of them.
        assert held <= 2 * 10 + 2, (t, held)
        if t >= 20:
            assert held >= 10
    assert loc is not None and loc.present == {}


def test_forgotten_sessions_are_freed_a_whole_second_at_a_time() -> None:
    store = MemoryStore(bytes_per_token=BPT, block_tokens=BLOCK, session_retention_seconds=100.0)
    for t in range(1000):
        store.apply([routed(f"s{t}", "r", float(t)), routed(f"t{t}", "r", t + 0.5)])
        assert len(store._sessions) <= 2 * 102
        assert len(store._seconds) <= 102
    assert store.stats()["sessions"] == 2 * 100 + 1  # from 899.5 on
