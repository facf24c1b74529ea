"""Clocks. The engine reads time only through one of these, so the replay simulator can drive it."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the epoch (or since a trace's start, for a simulated clock)."""
        ...


class SystemClock:
    def now(self) -> float:
        return time.time()


class ManualClock:
    """A clock that moves only when told: the simulator's and the tests'."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def set(self, t: float) -> None:
        if t < self._now:
            raise ValueError(f"a clock does not go back: {t} < {self._now}")
        self._now = t

    def advance(self, seconds: float) -> None:
        self.set(self._now + seconds)


class ScaledClock:
    """The system clock running `speed` times faster from the moment it is made (KVP_CLOCK_SPEED):
    for a service that takes a trace replayed at `speed` times its pace (`kvprefetch replay --via
    URL --speed X`), so that every duration it reads (idle times, leads, TTLs, link time) is the
    trace's, as it would be on live traffic."""

    def __init__(self, speed: float, origin: float | None = None) -> None:
        if not 0 < speed < float("inf"):
            raise ValueError(f"speed {speed!r}: a positive number of times real time")
        self.speed = speed
        self.origin = time.time() if origin is None else origin

    def now(self) -> float:
        return self.origin + (time.time() - self.origin) * self.speed
