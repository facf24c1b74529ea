"""The token index: block hashes back to the token sequence LMCache keys content by."""

from __future__ import annotations

import pytest

from app.deliver.token_index import TokenIndex, UnknownTokens
from kvprefetch_client.events import KvBlocksStored, VllmKvEvents


def stored(
    hashes: list[int | str], tokens: list[int], parent: int | str | None = None, size: int = 4
) -> KvBlocksStored:
    return KvBlocksStored(
        event_id=f"e-{hashes[0]}",
        ts=1.0,
        instance_id="gpu-0",
        block_hashes=hashes,
        parent_block_hash=parent,
        block_tokens=size,
        token_ids=tokens,
    )


def test_a_chain_is_rebuilt_from_the_root_across_events() -> None:
    index = TokenIndex(1000)
    index.observe([stored([1, 2], list(range(8)))])
    index.observe([stored([3], [8, 9, 10, 11], parent=2)])
    assert index.tokens_for([3]) == [list(range(12))]
    # An order lists the blocks it moves, oldest first: the tail alone still means the prefix.
    assert index.tokens_for([2, 3]) == [list(range(12))]
    assert index.tokens_for([1]) == [[0, 1, 2, 3]]


def test_two_branches_give_two_sequences_deepest_first() -> None:
    index = TokenIndex(1000)
    index.observe([stored([1, 2], list(range(8)))])
    index.observe([stored(["a"], [20, 21, 22, 23], parent=1)])
    index.observe([stored([3], [8, 9, 10, 11], parent=2)])
    assert index.tokens_for([3, "a", 1]) == [list(range(12)), [0, 1, 2, 3, 20, 21, 22, 23]]
    # Listed out of order, an ancestor is still not a sequence of its own.
    assert index.tokens_for([1, 3, 2]) == [list(range(12))]


def test_an_unknown_block_or_ancestor_is_named() -> None:
    index = TokenIndex(1000)
    index.observe([stored([3], [8, 9, 10, 11], parent=2)])
    with pytest.raises(UnknownTokens, match="block 7"):
        index.tokens_for([7])
    with pytest.raises(UnknownTokens, match="block 2, an ancestor of block 3"):
        index.tokens_for([3])


def test_the_least_recently_used_blocks_go_first_past_the_bound() -> None:
    index = TokenIndex(12)  # three blocks of four tokens
    index.observe([stored([1], [0, 1, 2, 3])])
    index.observe([stored([2], [4, 5, 6, 7])])
    index.observe([stored([3], [8, 9, 10, 11])])
    index.tokens_for([1])  # used: 2 is now the oldest
    index.observe([stored([4], [12, 13, 14, 15])])
    assert (len(index), index.tokens, index.forgotten_blocks) == (3, 12, 1)
    with pytest.raises(UnknownTokens):
        index.tokens_for([2])
    assert index.tokens_for([1]) == [[0, 1, 2, 3]]


def test_storing_a_child_keeps_its_parent() -> None:
    index = TokenIndex(12)
    index.observe([stored([1], [0, 1, 2, 3])])
    index.observe([stored([2], [4, 5, 6, 7])])
    index.observe([stored([3], [8, 9, 10, 11], parent=1)])  # touches 1: 2 is the oldest
    index.observe([stored([4], [12, 13, 14, 15], parent=3)])
    assert index.tokens_for([4]) == [list(range(4)) + list(range(8, 16))]


def test_tokens_that_do_not_fit_the_blocks_are_counted_not_indexed() -> None:
    index = TokenIndex(1000)
    index.observe([stored([1, 2], list(range(7)))])
    index.observe([KvBlocksStored(event_id="no-tokens", ts=1.0, instance_id="g", block_hashes=[5])])
    assert (len(index), index.malformed_events) == (0, 1)


def test_vllm_batches_feed_it_too() -> None:
    batch = VllmKvEvents(
        event_id="v-1",
        ts=1.0,
        instance_id="gpu-0",
        events=[
            {
                "type": "BlockStored",
                "block_hashes": [10, 11],
                "parent_block_hash": None,
                "token_ids": list(range(32)),
                "block_size": 16,
            },
            ["BlockStored", [12], 11, list(range(32, 48)), 16],
        ],
    )
    index = TokenIndex(1000)
    index.observe([batch])
    assert index.tokens_for([12]) == [list(range(48))]
