"""The agent's tiers: the pool directory and the bounded in-memory buffer."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvprefetch_client.agent.buffer import BufferFull, HbmBuffer, PoolDir, block_file_name


def test_block_file_names_keep_ints_and_strings_apart_and_stay_inside_the_pool() -> None:
    assert block_file_name(46) == "46.kv"
    assert block_file_name(-7) == "-7.kv"
    assert block_file_name("46") == "s-46.kv"
    assert block_file_name("ab_12-x") == "s-ab_12-x.kv"
    for weird in ("../etc/passwd", "a/b", "é", "x" * 129, ""):
        if weird:
            name = block_file_name(weird)
            assert name.startswith("h-") and "/" not in name and len(name) < 64
    assert block_file_name("../a") != block_file_name("../b")


def test_pool_dir_writes_and_reads_real_bytes(tmp_path: Path) -> None:
    pool = PoolDir(tmp_path / "pool")
    assert not pool.has(1)
    pool.write(1, b"x" * 10_000)
    pool.write("ab", b"yz")
    assert pool.has(1) and pool.has("ab") and not pool.has("1")
    assert pool.read(1) == b"x" * 10_000
    assert pool.path_for("ab").read_bytes() == b"yz"
    with pytest.raises(FileNotFoundError):
        pool.read(2)


def test_buffer_evicts_least_recently_used_first() -> None:
    buf = HbmBuffer(30)
    assert buf.put(1, b"a" * 10, now=0) == []
    assert buf.put(2, b"b" * 10, now=0) == []
    assert buf.put(3, b"c" * 10, now=0) == []
    assert buf.get(1) == b"a" * 10  # 1 is used: 2 is now the oldest
    assert buf.put(4, b"d" * 10, now=0) == [2]
    assert buf.hashes() == [3, 1, 4]
    assert buf.used_bytes == 30
    # A bigger block makes room by evicting as many as needed.
    assert buf.put(5, b"e" * 20, now=0) == [3, 1]
    assert buf.used_bytes == 30


def test_replacing_a_block_accounts_its_new_size() -> None:
    buf = HbmBuffer(30)
    buf.put(1, b"a" * 10, now=0)
    buf.put(1, b"a" * 25, now=0)
    assert buf.used_bytes == 25 and len(buf) == 1


def test_pin_holds_until_its_ttl_then_the_block_is_evictable() -> None:
    buf = HbmBuffer(20)
    buf.put(1, b"a" * 10, now=0)
    buf.put(2, b"b" * 10, now=0)
    assert buf.pin([1], until_ts=100) == 10
    assert buf.put(3, b"c" * 10, now=50) == [2]  # 1 is the oldest but pinned
    assert buf.is_pinned(1, now=50) and not buf.is_pinned(1, now=100)
    assert buf.put(4, b"d" * 10, now=100) == [1]  # the pin has run out


def test_demote_puts_blocks_first_in_line_and_unpins_them() -> None:
    buf = HbmBuffer(30)
    for h in (1, 2, 3):
        buf.put(h, b"x" * 10, now=0)
    buf.pin([3], until_ts=100)
    assert buf.demote([3, 2, 99]) == 20  # 99 is absent: nothing to do for it
    assert buf.hashes() == [3, 2, 1]
    assert buf.put(4, b"y" * 10, now=0) == [3]


def test_a_put_that_cannot_make_room_changes_nothing() -> None:
    buf = HbmBuffer(20)
    buf.put(1, b"a" * 10, now=0)
    buf.put(2, b"b" * 10, now=0)
    buf.pin([1], until_ts=100)
    with pytest.raises(BufferFull, match="10 of them pinned"):
        buf.put(3, b"c" * 15, now=0, protect={2})
    assert buf.hashes() == [1, 2] and buf.used_bytes == 20
    with pytest.raises(BufferFull):
        buf.put(9, b"z" * 21, now=0)


def test_a_withdrawn_demotion_goes_back_to_its_lru_place_behind_those_still_demoted() -> None:
    buf = HbmBuffer(5 * 10)
    for h in (1, 2, 3, 4, 5):
        buf.put(h, b"x" * 10, now=0.0)
    buf.get(2)
    buf.demote([4, 5])
    assert buf.hashes() == [4, 5, 1, 3, 2]
    buf.undemote([4, 9])
    assert buf.hashes() == [5, 1, 3, 4, 2]
    buf.pin([1], until_ts=100.0)
    buf.unpin([1])
    assert not buf.is_pinned(1, 0.0)
