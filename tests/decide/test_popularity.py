"""Prefix popularity: a context's head that other sessions use is shared, and advice leaves it."""

from __future__ import annotations

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
