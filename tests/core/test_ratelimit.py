from __future__ import annotations

import pytest

from app.core.ratelimit import RateLimiter, retry_after


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_client_gets_its_burst_then_waits_for_the_refill() -> None:
    clock = Clock()
    limiter = RateLimiter(10.0, 0.5, monotonic=clock)  # 5 at once, 10 a second
    assert [limiter.take("a") for _ in range(5)] == [0.0] * 5
    assert limiter.take("a") == pytest.approx(0.1)
    clock.t += 0.1001
    assert limiter.take("a") == 0.0
    assert limiter.take("a") > 0


def test_a_refused_take_spends_nothing() -> None:
    clock = Clock()
    limiter = RateLimiter(1.0, 2.0, monotonic=clock)
    assert limiter.take("a", 2) == 0.0
    for _ in range(5):
        assert limiter.take("a") == 1.0
    clock.t += 1.0
    assert limiter.take("a") == 0.0


def test_clients_have_their_own_buckets() -> None:
    limiter = RateLimiter(1.0, 1.0, monotonic=Clock())
    assert limiter.take("a") == 0.0
    assert limiter.take("a") > 0
    assert limiter.take("b") == 0.0


def test_a_cost_over_the_bucket_is_charged_against_a_full_one() -> None:
    clock = Clock()
    limiter = RateLimiter(10.0, 1.0, monotonic=clock)
    assert limiter.take("a", 25) == 0.0  # allowed when full, and overdraws
    assert limiter.take("a", 1) == pytest.approx(1.6)  # 15 owed + 1
    clock.t += 1.6001
    assert limiter.take("a", 1) == 0.0


def test_off_when_the_rate_is_zero() -> None:
    limiter = RateLimiter(0.0, 1.0)
    assert not limiter.enabled
    assert all(limiter.take("a", 1e9) == 0.0 for _ in range(10))


def test_forgotten_clients_start_again_full() -> None:
    limiter = RateLimiter(1.0, 1.0, monotonic=Clock(), max_clients=2)
    for client in ("a", "b", "c"):
        assert limiter.take(client) == 0.0
    assert limiter.take("a") == 0.0  # "a" was dropped as the least recently seen
    assert limiter.take("c") > 0


def test_retry_after_is_whole_seconds_and_never_zero() -> None:
    assert retry_after(0.01) == "1"
    assert retry_after(1.0) == "1"
    assert retry_after(1.01) == "2"
