"""SameInstanceEstimate: how often returns land where their context is, learned from routing."""

from __future__ import annotations

import pytest

from app.engine.routing import RouteTracker, SameInstanceEstimate


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
    tracker = RouteTracker(SameInstanceEstimate(prior=0.0, prior_weight=1.0, half_life_returns=1e9), max_sessions=2)
    tracker.routed("a", "gpu-0")  # a first turn: no return yet
    assert tracker.estimate.p_same == 0.0
    tracker.routed("a", "gpu-0")
    assert tracker.estimate.p_same == pytest.approx(1 / 2)
    tracker.routed("b", "gpu-1")
    tracker.routed("c", "gpu-1")  # a is the oldest of three: forgotten
    tracker.routed("a", "gpu-0")  # so this is a first turn again
    assert tracker.estimate.p_same == pytest.approx(1 / 2)
    tracker.closed("c")
    tracker.routed("c", "gpu-1")
    assert tracker.estimate.p_same == pytest.approx(1 / 2)
