"""SameInstanceEstimate: how often returns land where their context is, learned from routing."""

from __future__ import annotations

import pytest

from app.decide.routing import RouteTracker, SameInstanceEstimate


def test_starts_at_the_prior_and_follows_the_router() -> None:
    est = SameInstanceEstimate(prior=1.0, prior_weight=5.0, half_life_returns=1e9)
    assert est.p_same == 1.0
    for i in range(95):  # a router that spreads returns over four instances
        est.observe("gpu-0", f"gpu-{i % 4}")
    assert est.p_same == pytest.approx((5 + 24) / 100)


def test_first_turns_say_nothing() -> None:
    est = SameInstanceEstimate(prior=0.5)
    est.observe(None, "gpu-1")
    assert est.p_same == 0.5


def test_old_returns_fade() -> None:
    est = SameInstanceEstimate(prior=1.0, prior_weight=1.0, half_life_returns=10.0)
    for _ in range(200):
        est.observe("gpu-0", "gpu-1")
    for _ in range(200):
        est.observe("gpu-0", "gpu-0")
    assert est.p_same > 0.99


def test_prior_must_be_a_probability() -> None:
    with pytest.raises(ValueError, match="prior must be within"):
        SameInstanceEstimate(prior=1.5)


def test_the_tracker_remembers_where_each_session_was_and_forgets_the_oldest() -> None:
    tracker = RouteTracker(
        SameInstanceEstimate(prior=0.0, prior_weight=1.0, half_life_returns=1e9), max_sessions=2
    )
    tracker.routed("a", "gpu-0", 1.0)  # a first turn: no return yet
    assert tracker.estimate.p_same == 0.0
    tracker.routed("a", "gpu-0", 2.0)
    assert tracker.estimate.p_same == pytest.approx(1 / 2)
    tracker.routed("b", "gpu-1", 3.0)
    tracker.routed("c", "gpu-1", 4.0)  # a is the oldest of three: forgotten
    tracker.routed("a", "gpu-0", 5.0)  # so this is a first turn again
    assert tracker.estimate.p_same == pytest.approx(1 / 2)
    tracker.closed("c", 6.0)
    tracker.routed("c", "gpu-1", 7.0)
    assert tracker.estimate.p_same == pytest.approx(1 / 2)


def test_the_tracker_forgets_a_session_the_store_forgot_by_event_time() -> None:
    tracker = RouteTracker(
        SameInstanceEstimate(prior=0.0, prior_weight=1.0, half_life_returns=1e9),
        retention_seconds=100.0,
    )
    tracker.routed("a", "gpu-0", 10.0)
    tracker.touched("a", 12.0)  # finished at 12: active until then
    for i in range(1000):
        tracker.routed(f"s{i}", "gpu-1", 20.0 + i * 0.01)
    tracker.see(111.5)  # cutoff 11.5: a stays (as in the store)
    tracker.routed("a", "gpu-0", 111.6)
    assert tracker.estimate.p_same == pytest.approx(1 / 2)  # a return, landed home
    tracker.see(200.0)  # cutoff 100: every s* is forgotten, and let go
    assert len(tracker) == 1
    tracker.see(300.0)
    tracker.routed("a", "gpu-0", 300.0)  # a was forgotten: a first turn
    assert tracker.estimate.p_same == pytest.approx(1 / 2)
    tracker.routed("late", "gpu-0", 150.0)  # older than the cutoff: ignored, as the store does
    assert len(tracker) == 1


def test_the_last_instance_is_likeliest_unless_the_router_moves_sessions_away() -> None:
    estimate = SameInstanceEstimate(prior=1.0, prior_weight=1.0, half_life_returns=1e9)
    assert estimate.last_is_likeliest  # one instance known: nowhere else to go
    for i in range(300):
        estimate.observe("gpu-0", f"gpu-{i % 3}")  # one in three back: as likely as any other
    assert estimate.last_is_likeliest
    for i in range(3000):
        estimate.observe("gpu-0", f"gpu-{1 + i % 2}")  # never back
    assert not estimate.last_is_likeliest
