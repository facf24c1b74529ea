"""ScaledClock (KVP_CLOCK_SPEED): the system clock running faster from the moment it is made."""

from __future__ import annotations

import math

import pytest

from app.core.clock import ScaledClock


def test_a_scaled_clock_runs_speed_times_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    wall = [1_000.0]
    monkeypatch.setattr("app.core.clock.time.time", lambda: wall[0])
    clock = ScaledClock(20.0)
    assert clock.now() == 1_000.0  # it starts at the wall clock's time
    wall[0] = 1_002.5
    assert clock.now() == pytest.approx(1_000.0 + 2.5 * 20)


def test_a_scaled_clock_refuses_a_speed_that_is_not_positive_and_finite() -> None:
    for speed in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="speed"):
            ScaledClock(speed)
