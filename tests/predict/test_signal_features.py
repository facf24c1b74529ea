"""The signal features: what a session's signals say about its next request, by hand."""

from __future__ import annotations

import math

import pytest

from app.predict.feature_table import FeatureTable
from app.predict.features import (
    HISTORY_FEATURES,
    SESSION_FEATURES,
    SIGNAL_FEATURES,
    session_features,
)
from app.state.base import SessionView, SignalView


def view(arrivals: list[float], signals: list[SignalView]) -> SessionView:
    return SessionView(
        session_id="s",
        state="idle",
        turns=len(arrivals),
        first_seen_ts=arrivals[0] if arrivals else signals[0].ts,
        last_activity_ts=arrivals[-1] + 1.0 if arrivals else signals[0].ts,
        closed_ts=None,
        instance_id="gpu-0",
        context_tokens=1000,
        context_bytes=0,
        block_hashes=[],
        block_tokens=512,
        recent_arrivals_ts=arrivals,
        inter_turn_gaps_seconds=[b - a for a, b in zip(arrivals, arrivals[1:])],
        last_request=None,
        resident_blocks={},
        signals=signals,
    )


def signal_features(v: SessionView, now: float) -> dict[str, float]:
    row = dict(zip(SESSION_FEATURES, session_features(v, now)))
    table = dict(zip(SESSION_FEATURES, FeatureTable.from_views([v]).session_matrix(now)[0]))
    for name in SIGNAL_FEATURES:  # the table computes the same, NaN for NaN
        assert row[name] == table[name] or (math.isnan(row[name]) and math.isnan(table[name]))
    return {name: row[name] for name in SIGNAL_FEATURES}


def test_a_session_without_signals_has_none_this_spell_and_the_rest_unknown() -> None:
    f = signal_features(view([100.0, 200.0], []), now=300.0)
    assert f.pop("signals_this_spell") == 0.0
    assert all(math.isnan(value) for value in f.values()), f


def test_this_spell_ages_past_leads_follow_through_and_the_running_tools_lead() -> None:
    signals = [
        SignalView(ts=120.0, kind="tool_started", tool="search"),  # next arrival 200: lead 80
        SignalView(ts=150.0, kind="opened"),  # lead 50
        SignalView(ts=190.0, kind="typing"),  # lead 10
        SignalView(ts=250.0, kind="opened"),  # this spell, from here on
        SignalView(ts=255.0, kind="custom:reopened", expected_prompt_tokens=900),
        SignalView(ts=260.0, kind="tool_started", tool="search", expected_in_seconds=8.0),
    ]
    f = signal_features(view([100.0, 200.0], signals), now=265.0)
    assert f["since_opened_signal_seconds"] == 15.0
    assert f["since_other_signal_seconds"] == 10.0  # a deployment's own kind
    assert f["since_tool_started_signal_seconds"] == 5.0
    assert math.isnan(f["since_typing_signal_seconds"])  # typed before the last arrival only
    assert math.isnan(f["since_queued_signal_seconds"])
    assert f["signals_this_spell"] == 3.0
    assert f["signal_expected_in_seconds"] == 3.0  # 260 + 8, at 265
    assert f["signal_expected_prompt_tokens"] == 900.0
    assert f["signal_lead_median_seconds"] == 50.0
    assert f["signal_followed_share"] == pytest.approx(2 / 3)  # 80 s is past the 60 s window
    assert f["tool_lead_last_seconds"] == 80.0
    later = signal_features(view([100.0, 200.0], signals), now=280.0)
    assert later["signal_expected_in_seconds"] == -12.0  # overdue
    assert later["since_opened_signal_seconds"] == 30.0


def test_a_new_arrival_closes_the_spell() -> None:
    signals = [SignalView(ts=250.0, kind="opened"), SignalView(ts=252.0, kind="typing")]
    f = signal_features(view([100.0, 200.0, 258.0], signals), now=300.0)
    assert f["signals_this_spell"] == 0.0 and math.isnan(f["since_typing_signal_seconds"])
    assert f["signal_lead_median_seconds"] == 7.0  # 8 s and 6 s
    assert f["signal_followed_share"] == 1.0


def test_a_session_that_starts_with_a_signal() -> None:
    f = signal_features(view([], [SignalView(ts=50.0, kind="queued", instance_id="gpu-1")]), 52.0)
    assert f["since_queued_signal_seconds"] == 2.0 and f["signals_this_spell"] == 1.0
    assert math.isnan(f["signal_lead_median_seconds"])


def test_signal_features_come_after_the_history_features() -> None:
    assert (*HISTORY_FEATURES, *SIGNAL_FEATURES) == SESSION_FEATURES
