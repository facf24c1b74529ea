"""The `service` policy is built only over HTTP, paced: it carries out a running service's orders
(the closed loop itself runs in tests/e2e/test_service_replay_e2e.py)."""

from __future__ import annotations

from typing import Any

import pytest

from sim.policy_registry import make_policy
from sim.served import ServicePolicy


class FakeRemote:
    """What ServicePolicy asks of sim.remote.RemoteService before a run."""

    def __init__(self, speed: float | None) -> None:
        self.speed = speed
        self.listeners: list[Any] = []


def test_the_service_policy_needs_a_service() -> None:
    with pytest.raises(ValueError, match="--via"):
        make_policy("service")


def test_the_service_policy_needs_a_paced_run() -> None:
    with pytest.raises(ValueError, match="--speed"):
        make_policy("service", remote=FakeRemote(None))  # type: ignore[arg-type]


def test_the_service_policy_hears_the_clusters_events() -> None:
    remote = FakeRemote(20.0)
    policy = make_policy("service", remote=remote)  # type: ignore[arg-type]
    assert isinstance(policy, ServicePolicy)
    assert remote.listeners  # it hears the landings it reports orders completed by
    assert policy.tick_seconds is not None and policy.tick_seconds > 0


def test_an_unknown_policy_names_the_service_one_too() -> None:
    with pytest.raises(ValueError, match="service"):
        make_policy("nonesuch")
