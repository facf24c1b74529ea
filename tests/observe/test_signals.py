"""Signals counted by kind, and followed by a request within the window, in bounded memory."""

from __future__ import annotations

from typing import Any

import pytest

from app.observe.signals import OTHER_KIND, SignalFollowups, SignalKinds
from kvprefetch_client.events import SIGNAL_KINDS, Event, event_adapter

_n = iter(range(10**9))


def signal(session: str, ts: float, kind: str = "typing") -> Event:
    return event_adapter.validate_python(
        {
            "type": "session_signal",
            "event_id": f"g{next(_n)}",
            "ts": ts,
            "session_id": session,
            "kind": kind,
        }
    )


def routed(session: str, ts: float) -> Event:
    return event_adapter.validate_python(
        {
            "type": "request_routed",
            "event_id": f"r{next(_n)}",
            "ts": ts,
            "session_id": session,
            "request_id": f"q{next(_n)}",
            "instance_id": "gpu-0",
            "prompt_tokens": 10,
        }
    )


def counts(f: SignalFollowups) -> dict[str, tuple[int, int]]:
    return {k.kind: (k.signals, k.followed) for k in f.totals() if k.signals}


def test_a_signal_is_followed_by_a_request_of_its_session_within_the_window() -> None:
    told: list[tuple[str, str]] = []
    f = SignalFollowups(
        on_signal=lambda k: told.append(("signal", k)),
        on_followed=lambda k: told.append(("followed", k)),
    )
    f.observe([signal("a", 10.0, "opened"), signal("a", 12.0), signal("b", 10.0, "queued")])
    f.observe([routed("a", 70.0)])  # 60 s after the first: followed; 58 s after the second too
    f.observe([routed("b", 70.5)])  # 60.5 s: too late
    f.observe([signal("c", 100.0, "tool_started"), routed("c", 99.0), routed("c", 101.0)])
    f.observe([routed("c", 102.0)])  # a signal counts once
    assert counts(f) == {
        "opened": (1, 1),
        "typing": (1, 1),
        "queued": (1, 0),
        "tool_started": (1, 1),
    }
    assert told.count(("followed", "opened")) == 1 and ("signal", "queued") in told
    assert [k.followed_share for k in f.totals()][: len(SIGNAL_KINDS)] == [1.0, 1.0, 1.0, None, 0.0]


def test_pending_signals_expire_by_event_time() -> None:
    f = SignalFollowups()
    f.observe([signal("a", 10.0)])
    assert f.pending == 1
    f.observe([routed("other", 70.5)])  # the newest event time moves past the window
    assert f.pending == 0
    f.observe([routed("a", 70.0)])  # in the window by event time, but forgotten: not counted
    assert counts(f) == {"typing": (1, 0)}


def test_a_flood_of_signals_costs_bounded_memory() -> None:
    f = SignalFollowups(max_pending=1000, max_pending_per_session=4)
    f.observe([signal("a", 1.0 + i * 1e-3) for i in range(5000)])
    assert len(f._pending["a"]) == 4 and f.pending <= 1000
    f.observe([signal(f"s{i}", 10.0) for i in range(5000)])
    assert f.pending == 1000 and len(f._pending) <= 1000
    f.observe([routed("a", 10.5)])
    assert counts(f)["typing"] == (10_000, 0)  # a's were pushed out by the other sessions


@pytest.mark.parametrize("extra", [0, 3])
def test_kinds_are_a_bounded_label_set(extra: int) -> None:
    kinds = SignalKinds(max_deployment_kinds=extra)
    labels = {kinds.label(f"custom-{i}") for i in range(1000)}
    labels |= {kinds.label(k) for k in SIGNAL_KINDS}
    assert labels == {*SIGNAL_KINDS, *(f"custom-{i}" for i in range(extra)), OTHER_KIND}
    assert kinds.labels() == [*SIGNAL_KINDS, *(f"custom-{i}" for i in range(extra)), OTHER_KIND]
    assert kinds.label("custom-0") == ("custom-0" if extra else OTHER_KIND)


def test_an_unknown_kind_named_other_is_other() -> None:
    kinds = SignalKinds(max_deployment_kinds=2)
    assert [kinds.label("other"), kinds.label("x")] == [OTHER_KIND, "x"]
    assert kinds.deployment_kinds == ["x"]


def test_bad_settings_are_refused() -> None:
    bad: list[dict[str, Any]] = [{"window_seconds": 0}, {"max_pending": 0}]
    for kw in bad:
        with pytest.raises(ValueError):
            SignalFollowups(**kw)
    with pytest.raises(ValueError):
        SignalKinds(-1)
