"""BlockCache: LRU with keep/demote advice, ranking by a key, and pins that are never evicted."""

from __future__ import annotations

import pytest

from sim.blockcache import BlockCache


def filled(blocks: list[int], capacity: int | None = None, **kw: object) -> BlockCache:
    size = capacity if capacity is not None else len(blocks)
    cache = BlockCache(size, **kw)  # type: ignore[arg-type]
    for b in blocks:
        cache.insert(b)
    return cache


def test_slots_and_free() -> None:
    cache = filled([1, 2, 3], capacity=5)
    assert len(cache) == 3 and cache.free == 2
    assert 2 in cache and 9 not in cache
    cache.insert(2)  # already there: takes no slot
    assert len(cache) == 3
    assert cache.remove(2) is not None and cache.remove(2) is None
    assert cache.free == 3


def test_lru_order_and_touch() -> None:
    cache = filled([1, 2, 3, 4])
    assert cache.choose_victims(2, now=0.0) == [1, 2]
    cache.touch(1)
    assert cache.choose_victims(2, now=0.0) == [2, 3]
    assert cache.choose_victims(4, now=0.0) == [2, 3, 4, 1]
    assert cache.choose_victims(0, now=0.0) == []


def test_demoted_first_kept_last_until_the_advice_expires() -> None:
    cache = filled([1, 2, 3, 4])
    cache.keep(1, 10.0)
    cache.demote(4)
    assert cache.choose_victims(4, now=5.0) == [4, 2, 3, 1]
    assert cache.choose_victims(4, now=10.0) == [4, 1, 2, 3]  # expired: plain LRU again


def test_exclude_is_never_chosen() -> None:
    cache = filled([1, 2, 3])
    assert cache.choose_victims(2, now=0.0, exclude={1}) == [2, 3]
    assert cache.choose_victims(3, now=0.0, exclude={1}) is None


@pytest.mark.parametrize("keyed", [False, True])
def test_pinned_blocks_are_never_victims(keyed: bool) -> None:
    key = {1: 100.0, 2: 50.0, 3: 10.0, 4: 5.0}
    cache = filled([1, 2, 3, 4], evict_key=key.get if keyed else None)
    cache.entries[1].pins = 1
    cache.entries[3].pins = 2
    cache.demote(1)  # advice never overrides a pin
    assert cache.pinned_blocks() == 2
    assert cache.evictable(2) and not cache.evictable(1) and not cache.evictable(99)
    victims = cache.choose_victims(2, now=0.0)
    assert victims is not None and set(victims) == {2, 4}
    if keyed:
        assert victims == [2, 4]  # furthest key first
    # More than the unpinned blocks: no partial answer.
    assert cache.choose_victims(3, now=0.0) is None


def test_keyed_furthest_first_and_rekey() -> None:
    key = {1: 5.0, 2: 50.0, 3: 20.0}
    cache = filled([1, 2, 3], evict_key=key.get)
    key[1] = 99.0
    cache.rekey(1)  # the key changed: the block is ranked by the new one
    assert cache.choose_victims(3, now=0.0) == [1, 2, 3]


def test_keyed_failure_keeps_the_candidates() -> None:
    key = {1: 5.0, 2: 50.0, 3: 20.0}
    cache = filled([1, 2, 3], evict_key=key.get)
    cache.entries[2].pins = 1
    assert cache.choose_victims(3, now=0.0) is None
    assert cache.choose_victims(2, now=0.0) == [3, 1]  # nothing was lost from the ranking
    cache.unpin(2)  # evictable again, and ranked again
    assert cache.choose_victims(1, now=0.0) == [2]


def test_keyed_excludes_and_reinserted_blocks() -> None:
    key = {1: 5.0, 2: 50.0, 3: 20.0}
    cache = filled([1, 2, 3], evict_key=key.get)
    assert cache.choose_victims(1, now=0.0, exclude={2}) == [3]
    victims = cache.choose_victims(1, now=0.0)
    assert victims == [2]
    for b in victims:
        cache.remove(b)
    cache.insert(2)  # back again: ranked once, by its key
    assert cache.choose_victims(3, now=0.0) == [2, 3, 1]


def test_keyed_choosing_is_a_query() -> None:
    key = {1: 5.0, 2: 50.0, 3: 20.0}
    cache = filled([1, 2, 3], evict_key=key.get)
    assert cache.choose_victims(2, now=0.0) == [2, 3]
    assert cache.choose_victims(2, now=0.0) == [2, 3]  # nothing removed: same answer


def test_keyed_a_block_back_after_eviction_is_ranked_by_its_new_key_only() -> None:
    key = {1: 100.0, 2: 50.0}
    cache = filled([1, 2], evict_key=key.get)
    cache.remove(1)
    key[1] = 1.0  # next use much sooner now
    cache.insert(1)
    assert cache.choose_victims(1, now=0.0) == [2]


def test_a_use_clears_a_demotion() -> None:
    # A demotion is advice about one session; a block another session uses is no longer a
    # first victim (block 0 of every Mooncake conversation is such a shared system prompt).
    cache = filled([1, 2, 3])
    cache.demote(1)
    assert cache.choose_victims(1, now=0.0) == [1]
    cache.touch(1)
    assert not cache.entries[1].demoted
    assert cache.choose_victims(1, now=0.0) == [2]


def test_demoted_blocks_go_in_lru_order_not_the_order_they_were_demoted() -> None:
    cache = filled([1, 2, 3, 4])
    cache.demote(3)
    cache.demote(1)
    assert cache.choose_victims(2, now=0.0) == [1, 3]
    assert cache.choose_victims(3, now=0.0, exclude={1}) == [3, 2, 4]
    cache.remove(1)
    assert cache.choose_victims(1, now=0.0) == [3]
    cache.keep(3, 10.0)  # kept: no longer demoted, and last
    assert cache.choose_victims(3, now=0.0) == [2, 4, 3]


def test_clearing_the_advice_leaves_plain_lru() -> None:
    cache = filled([1, 2, 3, 4])
    cache.keep(1, 100.0)
    cache.demote(4)
    assert cache.choose_victims(4, now=0.0) == [4, 2, 3, 1]
    cache.clear_advice()
    assert cache.choose_victims(4, now=0.0) == [1, 2, 3, 4]
    assert not any(e.demoted for e in cache.entries.values())


def test_a_withdrawn_keep_or_demotion_leaves_those_blocks_in_lru_order() -> None:
    cache = filled([1, 2, 3, 4])
    cache.keep(1, 100.0)
    cache.keep(2, 100.0)
    cache.demote(4)
    cache.demote(3)
    cache.unkeep(1)
    cache.undemote(4)
    assert not cache.is_demoted(4) and cache.is_demoted(3) and cache.demoted == 1
    assert cache.choose_victims(4, now=0.0) == [3, 1, 4, 2]  # 2 still kept, 3 still demoted
    cache.unkeep(9)  # not held: nothing to withdraw
    cache.undemote(9)
