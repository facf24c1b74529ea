"""The deployment's features (DeploymentSignals): whether this deployment sends signals at all."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from app.core.clock import ManualClock
from app.core.config import Settings
from app.deliver import InProcessSink
from app.engine import Engine
from app.ingest.base import NullEventLog
from app.predict.features import (
    DEPLOYMENT_FEATURES,
    SIGNAL_FOLLOW_SECONDS,
    DeploymentSignals,
)
from app.state import MemoryStore
from app.state.redis import RedisStore
from kvprefetch_client.events import Event, RequestFinished, RequestRouted, SessionSignal


def routed(n: int, session: str, ts: float) -> RequestRouted:
    return RequestRouted(
        event_id=f"r{n}",
        ts=ts,
        session_id=session,
        request_id=f"{session}-{n}",
        instance_id="gpu-0",
        prompt_tokens=1000,
    )


def signal(n: int, session: str, ts: float, kind: str = "typing") -> SessionSignal:
    return SessionSignal(event_id=f"s{n}", ts=ts, session_id=session, kind=kind)


def features(tracker: DeploymentSignals) -> dict[str, float]:
    return dict(zip(DEPLOYMENT_FEATURES, tracker.features()))


def test_unknown_before_any_arrival_and_zero_where_no_signals_are_sent() -> None:
    tracker = DeploymentSignals()
    assert all(math.isnan(v) for v in tracker.features())
    tracker.observe([routed(i, f"s{i % 7}", 10.0 * i) for i in range(50)])
    f = features(tracker)
    assert (f["deployment_signalled_arrival_share"], f["deployment_signals_per_arrival"]) == (
        0.0,
        0.0,
    )
    # No kind seen: how reliable each is, unknown.
    assert all(math.isnan(v) for k, v in f.items() if k.endswith("_followed_share"))


def test_each_kind_s_reliability_is_its_judged_signals_followed_share() -> None:
    tracker = DeploymentSignals(window_seconds=1e12)  # no decay: plain counts
    events: list[Event] = []
    for i in range(8):  # typing: 3 of 4 followed; opened: 1 of 4
        t = 1000.0 * i
        kind = "typing" if i % 2 else "opened"
        events.append(signal(i, f"s{i}", t, kind))
        if (kind == "typing" and i != 7) or i == 0:
            events.append(routed(i, f"s{i}", t + 5.0))
    events.append(signal(99, "late", 9000.0, "my_kind"))  # a deployment's own: "other"
    events.append(routed(100, "z", 20_000.0))  # closes every window
    tracker.observe(sorted(events, key=lambda e: e.ts))
    f = features(tracker)
    assert f["deployment_typing_followed_share"] == pytest.approx(3 / 4)
    assert f["deployment_opened_followed_share"] == pytest.approx(1 / 4)
    assert f["deployment_other_followed_share"] == 0.0
    assert math.isnan(f["deployment_queued_followed_share"])  # never seen


def test_a_signal_counts_for_the_next_arrival_of_its_session_within_the_window() -> None:
    tracker = DeploymentSignals(window_seconds=1e12)  # no decay: plain counts
    tracker.observe(
        [
            signal(1, "a", 0.0),
            routed(1, "a", 5.0),  # announced
            routed(2, "a", 6.0),  # the signal was spent on the arrival before
            signal(2, "b", 10.0),
            routed(3, "b", 10.0 + SIGNAL_FOLLOW_SECONDS + 1.0),  # too late to count
            signal(3, "c", 80.0),
            routed(4, "d", 81.0),  # another session's arrival
        ]
    )
    f = features(tracker)
    assert f["deployment_signalled_arrival_share"] == pytest.approx(1 / 4)
    assert f["deployment_signals_per_arrival"] == pytest.approx(3 / 4)


def test_weights_decay_with_event_time_and_the_clock_does_not_matter() -> None:
    old = DeploymentSignals(window_seconds=600.0)
    old.observe([signal(1, "a", 0.0), routed(1, "a", 1.0)])  # announced, long ago
    old.observe([routed(2, "b", 6001.0)])  # not announced, recent
    share = features(old)["deployment_signalled_arrival_share"]
    assert share == pytest.approx(math.exp(-10.0) / (1 + math.exp(-10.0)))
    # Read twice, at any wall time: only events move it.
    assert old.features() == old.features()
    # An event stamped out of order (within the follow window) weighs by its own age against
    # the newest, as it would have in order.
    in_order, late = DeploymentSignals(), DeploymentSignals()
    in_order.observe([signal(1, "a", 50.0), routed(1, "a", 60.0), routed(2, "b", 100.0)])
    late.observe([routed(2, "b", 100.0), signal(1, "a", 50.0), routed(1, "a", 60.0)])
    assert late.features() == pytest.approx(in_order.features(), nan_ok=True)
    assert 0 < late.features()[0] < 0.5


def test_a_flood_of_signals_costs_bounded_memory() -> None:
    tracker = DeploymentSignals(max_pending_sessions=100)
    tracker.observe(signal(i, f"s{i}", 1000.0 + i * 1e-3) for i in range(5000))
    assert len(tracker) == 100
    tracker.observe(signal(i, "one", 2000.0 + i) for i in range(5000, 6000))  # one session
    assert len(tracker) == 1  # the others' signals aged out of the follow window
    tracker.observe([routed(1, "x", 10_000.0)])
    assert len(tracker) == 0


def chat(with_signals: bool) -> list[Event]:
    events: list[Event] = []
    for s in range(20):
        t = 100.0 * s
        for turn in range(3):
            sid, n = f"s{s}", 10 * s + turn
            if with_signals and turn:
                events.append(signal(n, sid, t - 3.0))
            events.append(routed(n, sid, t))
            events.append(
                RequestFinished(
                    event_id=f"f{n}",
                    ts=t + 2.0,
                    session_id=sid,
                    request_id=f"{sid}-{n}",
                    instance_id="gpu-0",
                    output_tokens=100,
                )
            )
            t += 40.0
    return sorted(events, key=lambda e: e.ts)


@pytest.mark.parametrize("store_kind", ["memory", "redis"])
def test_the_engine_keeps_it_at_ingest_with_either_store(
    store_kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """What the engine's predictor reads after ingest equals the tracker told the same events."""
    settings = Settings(data_dir=tmp_path, log_fsync=False)
    for with_signals in (True, False):
        if store_kind == "memory":
            store = MemoryStore(bytes_per_token=1024, block_tokens=512)
        else:
            url = request.getfixturevalue("redis_url")
            prefix = request.getfixturevalue("clean_redis") + ("s" if with_signals else "n")
            store = RedisStore.from_url(url, prefix=prefix, bytes_per_token=1024, block_tokens=512)
        events = chat(with_signals)
        engine = Engine(
            settings,
            store=store,
            clock=ManualClock(events[-1].ts),
            order_sink=InProcessSink(),
            event_log=NullEventLog(),
            recover=False,
            load_model=False,
        )
        for k in range(0, len(events), 7):
            engine.ingest(events[k : k + 7])
        offline = DeploymentSignals()
        offline.observe(events)
        assert engine.deployment.features() == offline.features()
        share = engine.deployment.features()[0]
        assert share > 0.5 if with_signals else share == 0.0
        asyncio.run(engine.close())
        store.close()


def test_a_model_trained_before_the_deployment_features_still_serves(tmp_path: Path) -> None:
    """The bundled model of before (the history features and the horizon) reads its own columns."""
    import lightgbm as lgb
    import numpy as np

    from app.predict.feature_table import feature_matrix
    from app.predict.features import FEATURES, HISTORY_FEATURES, HORIZON_FEATURE
    from app.predict.predictors import LearnedPredictor
    from tests.predict.test_signal_features import view

    old = [*HISTORY_FEATURES, HORIZON_FEATURE]
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 100, (500, len(old)))
    y = (x[:, 0] < 50).astype(int)
    booster = lgb.train(
        {"objective": "binary", "verbose": -1, "min_data_in_leaf": 5},
        lgb.Dataset(x, y, feature_name=old),
        num_boost_round=3,
    )
    (tmp_path / "old").mkdir()
    booster.save_model(str(tmp_path / "old" / "model.txt"))
    tracker = DeploymentSignals()
    tracker.observe(chat(with_signals=True))
    model = LearnedPredictor(tmp_path / "old", backend="booster", deployment=tracker)
    assert model.feature_names == tuple(old)
    sessions = [view([100.0, 200.0], []), view([50.0, 90.0, 130.0], [])]
    full = feature_matrix(sessions, 260.0, (30.0, 300.0), tracker.features())
    assert full.shape[1] == len(FEATURES)
    expected = booster.predict(full[:, [FEATURES.index(n) for n in old]]).reshape(2, 2)
    np.testing.assert_allclose(model.p_within(sessions, 260.0, (30.0, 300.0)), expected)


def test_a_kind_s_lower_bound_needs_evidence_and_stays_below_its_share() -> None:
    tracker = DeploymentSignals(window_seconds=1e12)
    assert tracker.followed_lower_bound("opened") == 0.0  # nothing judged yet
    tracker.signal("a", 0.0, "opened")
    tracker.arrival("a", 1.0)
    one = tracker.followed_lower_bound("opened")
    assert 0.0 < one < 0.5  # one followed signal is no record
    for i in range(200):
        tracker.signal(f"s{i}", 10.0 * i, "opened")
        tracker.arrival(f"s{i}", 10.0 * i + 1.0)
    many = tracker.followed_lower_bound("opened")
    assert one < many < 1.0 and many > 0.95
    for i in range(200):  # typing: one in four followed
        tracker.signal(f"t{i}", 3000.0 + 10.0 * i, "typing")
        if i % 4 == 0:
            tracker.arrival(f"t{i}", 3000.0 + 10.0 * i + 1.0)
    tracker.arrival("late", 3000.0 + 10.0 * 200 + SIGNAL_FOLLOW_SECONDS + 1)  # judges the rest
    typing = tracker.followed_lower_bound("typing")
    assert 0.15 < typing < features(tracker)["deployment_typing_followed_share"] <= 0.26
