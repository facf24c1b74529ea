"""The processor-sharing link: exact completion times alone and shared."""

from __future__ import annotations

import pytest

from sim.links import Link, Transfer

BW = 1e9  # bytes per second
EXACT = 1e-9  # seconds: float rounding only


def transfer(tid: int, nbytes: float, at: float = 0.0) -> Transfer:
    return Transfer(
        transfer_id=tid, instance=0, blocks=[tid], nbytes=nbytes, prefetch=False, started_at=at
    )


def drain(link: Link, until: float = float("inf")) -> dict[int, float]:
    """Land every transfer the way the cluster does (at each predicted completion);
    id -> done_at."""
    done: dict[int, float] = {}
    while (at := link.next_completion()) is not None and at <= until:
        for t in link.complete_due(at):
            done[t.transfer_id] = t.done_at  # type: ignore[assignment]
    return done


def test_alone_x_bytes_take_x_over_y_seconds() -> None:
    link = Link(BW)
    t = transfer(1, 3e9)
    link.add(t, 0.0)
    assert link.next_completion() == pytest.approx(3.0, abs=EXACT)
    assert link.complete_due(2.9) == []  # not yet
    assert drain(link) == {1: pytest.approx(3.0, abs=EXACT)}
    assert link.active == {}
    assert link.bytes_moved == 3e9
    assert link.busy_seconds == pytest.approx(3.0, abs=EXACT)


def test_alone_started_late_ends_x_over_y_after_its_start() -> None:
    link = Link(BW)
    link.add(transfer(1, 5e8), 10.0)
    assert drain(link) == {1: pytest.approx(10.5, abs=EXACT)}


def test_two_equal_transfers_started_together_finish_together_at_2x_over_y() -> None:
    link = Link(BW)
    link.add(transfer(1, 2e9), 0.0)
    link.add(transfer(2, 2e9), 0.0)
    done = drain(link)
    assert done == {1: pytest.approx(4.0, abs=EXACT), 2: pytest.approx(4.0, abs=EXACT)}
    # Both finish later than either would alone (2 s).
    assert min(done.values()) > 2.0 + 1e-3


def test_a_small_transfer_joining_a_big_one() -> None:
    """Big B from t=0; small S joins at t0 while B is still going.

    From t0 each gets Y/2: S lands at t0 + 2S/Y; B then runs alone and, the link being work
    conserving, lands at (B + S)/Y.
    """
    big, small, t0 = 4e9, 1e9, 1.0
    link = Link(BW)
    link.add(transfer(1, big), 0.0)
    link.add(transfer(2, small), t0)
    done = drain(link)
    assert done[2] == pytest.approx(t0 + 2 * small / BW, abs=EXACT)  # 3.0, not 2.0 as alone
    assert done[1] == pytest.approx((big + small) / BW, abs=EXACT)  # 5.0, not 4.0 as alone
    assert done[2] > t0 + small / BW and done[1] > big / BW


def test_three_sizes_together() -> None:
    a, b, c = 1e9, 2e9, 4e9
    link = Link(BW)
    for i, n in enumerate((a, b, c), start=1):
        link.add(transfer(i, n), 0.0)
    done = drain(link)
    assert done[1] == pytest.approx(3 * a / BW, abs=EXACT)
    assert done[2] == pytest.approx((3 * a + 2 * (b - a)) / BW, abs=EXACT)
    assert done[3] == pytest.approx((a + b + c) / BW, abs=EXACT)


@pytest.mark.parametrize("active", [[], [3e9], [5e8], [1e9, 4e9], [2e9, 2e9, 1e8]])
def test_estimate_seconds_is_the_actual_completion_when_nothing_else_joins(
    active: list[float],
) -> None:
    link = Link(BW)
    for i, n in enumerate(active, start=10):
        link.add(transfer(i, n), 0.0)
    now, nbytes = 0.5, 1.5e9
    estimate = link.estimate_seconds(nbytes, now)
    link.add(transfer(1, nbytes, now), now)
    done = drain(link)
    assert done[1] == pytest.approx(now + estimate, abs=EXACT)


def test_estimate_alone_is_x_over_y() -> None:
    assert Link(BW).estimate_seconds(7e8, 3.0) == pytest.approx(0.7, abs=EXACT)


def test_next_completion_is_recomputed_after_a_join() -> None:
    link = Link(BW)
    link.add(transfer(1, 2e9), 0.0)
    version = link.version
    assert link.next_completion() == pytest.approx(2.0, abs=EXACT)
    link.add(transfer(2, 2e9), 1.0)
    assert link.version != version  # the cluster drops completions predicted before the join
    # t=1: 1e9 left of the first, shared from now on: it lands at 1 + 2 * 1e9 / BW.
    assert link.next_completion() == pytest.approx(3.0, abs=EXACT)
