"""PullQueue: leases, their expiry, cancels reported to the next pull, progress from events."""

from __future__ import annotations

from typing import Any

import pytest

from app.deliver import PullQueue
from kvprefetch_client.events import Event, event_adapter
from kvprefetch_client.orders import Cancel
from tests.deliver.conftest import order

LEASE = 30.0


@pytest.fixture
def queue() -> PullQueue:
    return PullQueue(lease_seconds=LEASE)


def progress(order_id: str, status: str, **kw: Any) -> Event:
    return event_adapter.validate_python(
        {
            "type": "order_progress",
            "event_id": f"{order_id}-{status}",
            "ts": 1.0,
            "order_id": order_id,
            "status": status,
            **kw,
        }
    )


def leased(
    queue: PullQueue, now: float, instance: str = "gpu-0", limit: int = 100
) -> tuple[list[str], list[str]]:
    lease = queue.lease(instance, limit, now)
    return [o.order_id for o in lease.orders], lease.cancelled


def test_highest_priority_first_then_earliest_start_then_oldest(queue: PullQueue) -> None:
    queue.submit_nowait(
        [
            order("late", start_by_ts=11.5),
            order("low", priority=0.1, start_by_ts=10.0),
            order("early", start_by_ts=10.5),
            order("same", start_by_ts=10.5),
            order("high", priority=2.0, start_by_ts=11.9),
        ]
    )
    assert leased(queue, 0.0, limit=2) == (["high", "low"], [])
    assert leased(queue, 0.0) == (["early", "same", "late"], [])
    assert leased(queue, 0.0) == ([], [])


def test_instances_have_their_own_queues(queue: PullQueue) -> None:
    queue.submit_nowait([order("a", "gpu-0"), order("b", "gpu-1")])
    assert leased(queue, 0.0, "gpu-1") == (["b"], [])
    assert leased(queue, 0.0, "gpu-9") == ([], [])
    assert leased(queue, 0.0, "gpu-0") == (["a"], [])


def test_an_order_is_handed_out_again_when_its_lease_runs_out(queue: PullQueue) -> None:
    queue.submit_nowait([order("a", needed_by_ts=100.0)])
    assert leased(queue, 0.0) == (["a"], [])
    assert leased(queue, LEASE - 0.1) == ([], [])
    assert leased(queue, LEASE) == (["a"], [])


def test_an_accepted_order_is_never_handed_out_again_and_a_finished_one_is_forgotten(
    queue: PullQueue,
) -> None:
    queue.submit_nowait([order("a", needed_by_ts=100.0), order("b", needed_by_ts=100.0)])
    leased(queue, 0.0)
    queue.observe([progress("a", "accepted"), progress("b", "accepted")])
    assert leased(queue, 2 * LEASE) == ([], [])
    assert queue.held("gpu-0") == 2
    queue.observe(
        [
            progress("a", "completed", bytes=2048, seconds=0.1),
            progress("b", "failed", reason="no room"),
        ]
    )
    assert queue.held() == 0
    assert queue.submit_nowait([order("a")]) == []  # its id is still in the dedupe window
    assert queue.stats["started"] == 2 and queue.stats["done"] == 2


def test_progress_for_an_unknown_order_and_other_events_change_nothing(queue: PullQueue) -> None:
    queue.submit_nowait([order("a")])
    queue.observe(
        [
            progress("elsewhere", "accepted"),
            progress("elsewhere", "completed", bytes=1, seconds=1.0),
            event_adapter.validate_python(
                {"type": "session_closed", "event_id": "x", "ts": 1.0, "session_id": "s1"}
            ),
        ]
    )
    assert leased(queue, 0.0) == (["a"], [])


def test_a_cancel_removes_an_unstarted_order_and_reaches_its_instances_next_pull_once(
    queue: PullQueue,
) -> None:
    queue.submit_nowait([order("a"), order("b"), order("c", "gpu-1")])
    assert leased(queue, 0.0) == (["a", "b"], [])
    assert queue.cancel_nowait([Cancel(order_id="a"), Cancel(order_id="never-submitted")]) == ["a"]
    assert queue.held("gpu-0") == 1
    assert leased(queue, 0.0, "gpu-1") == (["c"], [])  # not gpu-1's cancel
    assert leased(queue, LEASE) == (["b"], ["a"])
    assert leased(queue, LEASE) == ([], [])


def test_a_started_order_is_cancelled_in_word_only(queue: PullQueue) -> None:
    queue.submit_nowait([order("a")])
    leased(queue, 0.0)
    queue.observe([progress("a", "accepted")])
    assert queue.cancel_nowait([Cancel(order_id="a")]) == ["a"]
    assert queue.cancel_nowait([Cancel(order_id="a")]) == []
    assert leased(queue, 0.0) == ([], ["a"])
    assert queue.held("gpu-0") == 1  # it is moving: it finishes
    queue.observe([progress("a", "completed", bytes=2048, seconds=0.1)])
    assert queue.held() == 0


def test_an_order_held_a_lease_past_its_need_expires(queue: PullQueue) -> None:
    queue.submit_nowait(
        [
            order("pending", needed_by_ts=12.0),
            order("started", needed_by_ts=12.0),
            order("later", needed_by_ts=50.0),
        ]
    )
    assert leased(queue, 20.0) == (["pending", "started", "later"], [])  # leased until 50
    queue.observe([progress("started", "accepted")])
    assert leased(queue, 12.0 + LEASE) == ([], [])
    assert queue.held() == 3
    assert leased(queue, 12.1 + LEASE) == ([], [])
    assert queue.held() == 1 and queue.stats["expired"] == 2


def test_the_lease_json_is_each_orders_own_json() -> None:
    queue = PullQueue()
    o = order("a", block_hashes=[2**64 - 1, "ff"], priority=1 / 3)
    queue.submit_nowait([o])
    queue.cancel_nowait([Cancel(order_id="a")])
    queue.submit_nowait([order("b")])
    expected = b'{"orders":[' + order("b").to_json() + b'],"cancelled":["a"],"lease_seconds":30.0}'
    assert queue.lease("gpu-0", 10, 0.0).to_json() == expected


def test_orders_nobody_leases_are_dropped_after_their_expiry_on_submit(queue: PullQueue) -> None:
    # No agent ever pulls for gpu-7: its orders must not pile up. Submits expire them by the newest
    # created_ts submitted (the scheduler's clock), a few per order submitted.
    for t in range(200):
        queue.submit_nowait(
            [
                order(
                    f"o{t}", "gpu-7", created_ts=float(t), start_by_ts=t + 1.0, needed_by_ts=t + 2.0
                )
            ]
        )
        # Held: those whose expiry (needed_by + lease) is not before the newest created_ts.
        assert queue.held("gpu-7") == min(t + 1, int(LEASE) + 3)
    assert queue.stats["expired"] == 200 - (int(LEASE) + 3)
    assert len(queue._expiries) <= 2 * queue.held() + 1024


def test_cancel_reports_nobody_collects_expire_with_their_orders(queue: PullQueue) -> None:
    queue.submit_nowait(
        [order("a", "gpu-7", needed_by_ts=12.0), order("b", "gpu-7", needed_by_ts=100.0)]
    )
    assert queue.cancel_nowait([Cancel(order_id="a"), Cancel(order_id="b")]) == ["a", "b"]
    queue.submit_nowait(
        [order("c", "gpu-1", created_ts=12.1 + LEASE, start_by_ts=50.0, needed_by_ts=60.0)]
    )
    assert leased(queue, 12.1 + LEASE, "gpu-7") == ([], ["b"])  # a's report expired with a
    assert queue.held() == 1


def test_the_expiry_heap_stays_small_when_orders_finish_long_before_their_expiry(
    queue: PullQueue,
) -> None:
    for t in range(5000):
        queue.submit_nowait(
            [order(f"o{t}", created_ts=float(t), start_by_ts=t + 1.0, needed_by_ts=t + 10**6)]
        )
        queue.observe([progress(f"o{t}", "completed", bytes=1, seconds=0.1)])
    assert queue.held() == 0 and len(queue._expiries) <= 1024 + 1
