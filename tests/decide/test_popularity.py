"""Prefix popularity: a context's head that other sessions use is shared, and advice leaves it."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from app.decide.advisor import Advisor
from app.decide.popularity import PrefixPopularity
from tests.decide.test_advisor import Fixed, view


def test_a_block_is_shared_only_once_another_session_uses_it_within_the_window() -> None:
    pop = PrefixPopularity(window_seconds=60.0)
    pop.routed("a", [1, 2, 3], 0.0)
    pop.routed("a", [1, 2, 3, 4], 10.0)  # the same session again: still its own
    assert pop.shared_prefix([1, 2, 3, 4], 10.0) == 0
    pop.routed("b", [1, 2, 9], 20.0)
    assert pop.shared_prefix([1, 2, 3, 4], 20.0) == 2  # stops at the first block not shared
    assert pop.shared_prefix([1, 2, 3, 4], 80.0) == 2
    assert pop.shared_prefix([1, 2, 3, 4], 80.1) == 0  # nobody else since: private again


def test_a_second_session_long_after_the_first_does_not_make_a_block_shared() -> None:
    pop = PrefixPopularity(window_seconds=60.0)
    pop.routed("a", [1], 0.0)
    pop.routed("b", [1], 100.0)
    assert pop.shared_prefix([1], 100.0) == 0
    pop.routed("c", [1], 110.0)
    assert pop.shared_prefix([1], 110.0) == 1


def test_only_the_prefix_is_tracked_and_memory_is_bounded() -> None:
    pop = PrefixPopularity(prefix_blocks=2, max_blocks=3)
    pop.routed("a", [1, 2, 3, 4], 0.0)
    assert len(pop) == 2
    pop.routed("b", [1, 2, 3, 4], 1.0)
    assert pop.shared_prefix([1, 2, 3, 4], 1.0) == 2  # blocks past the prefix are not asked
    pop.routed("c", [7, 8], 2.0)
    assert len(pop) == 3  # the least recently used went
    assert pop.shared_prefix([1, 2], 2.0) == 0
    with pytest.raises(ValueError):
        PrefixPopularity(window_seconds=0.0)


def test_a_demotion_leaves_the_shared_head_alone() -> None:
    pop = PrefixPopularity()
    pop.routed("other", [1, 2, 50], 90.0)
    pop.routed("quiet", [1, 2, 3, 4], 95.0)
    planner = Advisor(Fixed({"quiet": (0.0, 0.0)}), popularity=pop)
    (advice,) = planner.advise([view("quiet", blocks=[1, 2, 3, 4])], 100.0)
    assert advice.retention == "demote"
    assert advice.shared_blocks == 2
    assert advice.demotable_blocks == (3, 4)
    (alone,) = Advisor(Fixed({"quiet": (0.0, 0.0)})).advise(
        [view("quiet", blocks=[1, 2, 3, 4])], 100.0
    )
    assert alone.demotable_blocks == (1, 2, 3, 4)


class _ReferencePopularity:
    """The rule as first written (an entry replaced per block): what PrefixPopularity must
    answer."""

    def __init__(self, window_seconds: float, prefix_blocks: int, max_blocks: int) -> None:
        self.window, self.prefix, self.max = window_seconds, prefix_blocks, max_blocks
        self.blocks: OrderedDict[int, tuple[str, float, float]] = OrderedDict()

    def routed(self, session_id: str, block_hashes: list[int], ts: float) -> None:
        for b in block_hashes[: self.prefix]:
            entry = self.blocks.pop(b, None)
            if entry is None:
                self.blocks[b] = (session_id, ts, -1.0)
                continue
            last_session, last_ts, shared_until = entry
            if last_session != session_id and ts - last_ts <= self.window:
                shared_until = max(shared_until, ts + self.window)
            self.blocks[b] = (session_id, max(ts, last_ts), shared_until)
        while len(self.blocks) > self.max:
            self.blocks.popitem(last=False)

    def shared_prefix(self, block_hashes: list[int], now: float) -> int:
        n = 0
        for b in block_hashes[: self.prefix]:
            entry = self.blocks.get(b)
            if entry is None or entry[2] < now:
                break
            n += 1
        return n


@pytest.mark.parametrize("seed", range(5))
def test_entries_changed_in_place_answer_as_entries_replaced(seed: int) -> None:
    """Blocks named twice, events out of time order, evictions: the same answers, and the same
    blocks in the same order, as the rule replacing each block's entry."""
    rng = random.Random(seed)
    pop = PrefixPopularity(window_seconds=5.0, prefix_blocks=6, max_blocks=40)
    ref = _ReferencePopularity(5.0, 6, 40)
    ts = 0.0
    for _ in range(2_000):
        ts += rng.uniform(-1.0, 1.5)  # now and then older than the last event
        blocks = [rng.randrange(60) for _ in range(rng.randint(0, 9))]
        session = f"s{rng.randrange(6)}"
        pop.routed(session, blocks, ts)
        ref.routed(session, blocks, ts)
        probe = [rng.randrange(60) for _ in range(rng.randint(1, 8))]
        now = ts + rng.uniform(-3.0, 8.0)
        assert pop.shared_prefix(probe, now) == ref.shared_prefix(probe, now)
    assert [(b, tuple(e)) for b, e in pop._blocks.items()] == list(ref.blocks.items())
