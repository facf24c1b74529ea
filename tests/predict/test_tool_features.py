"""The tool features (TOOL_FEATURES): what a session's tool call in flight says of its return,
read from the deployment's own run times (ToolDurations.features), by the reference and the
FeatureTable alike; a model trained before them still serves, reading its own columns."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np

from app.core.bundle import DEFAULT_MODEL_DIR
from app.core.clock import ManualClock
from app.core.config import Settings
from app.deliver import InProcessSink
from app.engine import Engine
from app.predict.feature_table import FeatureTable, feature_matrix
from app.predict.features import FEATURES, HORIZON_FEATURE, tool_features
from app.predict.predictors import LearnedPredictor
from app.predict.tool_durations import TOOL_FEATURES, ToolDurations
from app.state import MemoryStore
from tests.predict.test_signal_features import view
from tests.predict.test_tool_durations import finished, routed, runs, started


def named(rows: list[list[float]]) -> list[dict[str, float]]:
    return [dict(zip(TOOL_FEATURES, row)) for row in rows]


def test_a_call_in_flight_reads_its_tools_conditional_quantiles_and_count() -> None:
    """20 runs of 5 s: 2 s in, 3 s remain at p50 and p90; back within 1 s: no; within 10 s:
    surely."""
    t = ToolDurations()
    t.observe(runs("bash", [5.0] * 20))
    t.observe([started("agent", 100.0)])
    one, ten = named(tool_features(t, "agent", 102.0, (1.0, 10.0)))
    assert one == {
        "tool_running_seconds": 2.0,
        "tool_remaining_p50_seconds": 3.0,
        "tool_remaining_p90_seconds": 3.0,
        "tool_back_within_horizon_p": 0.0,
        "tool_runs_seen": 20.0,
    }
    assert ten["tool_back_within_horizon_p"] == 1.0 and ten["tool_runs_seen"] == 20.0


def test_the_remaining_time_is_conditioned_on_the_time_already_run() -> None:
    """Half the runs 2 s, half 20 s: at 1 s the median call is back soon, at 3 s it is a 20 s
    one."""
    t = ToolDurations()
    t.observe(runs("bash", [2.0] * 10 + [20.0] * 10))
    t.observe([started("agent", 100.0)])
    (early,) = named(tool_features(t, "agent", 101.0, (5.0,)))
    (late,) = named(tool_features(t, "agent", 103.0, (5.0,)))
    assert early["tool_remaining_p50_seconds"] < 2.0 < 14.0 < late["tool_remaining_p50_seconds"]
    assert late["tool_remaining_p50_seconds"] <= late["tool_remaining_p90_seconds"] <= 17.0
    assert early["tool_back_within_horizon_p"] > 0.0 == late["tool_back_within_horizon_p"]


def test_nan_without_a_call_in_flight_or_without_runs_to_go_by() -> None:
    t = ToolDurations()
    t.observe(runs("bash", [5.0] * 4))
    t.observe([started("new", 100.0, "never_seen"), started("long", 100.0)])
    assert sorted(t.features(110.0, (5.0,))) == ["long", "new"]
    (nobody,) = tool_features(t, "nobody", 110.0, (5.0,))
    (untold,) = tool_features(None, "new", 110.0, (5.0,))  # a caller that keeps no tools
    assert all(math.isnan(v) for v in [*nobody, *untold])
    # A tool with no run seen: how long it has run and that none was seen, nothing else.
    (new,) = named(tool_features(t, "new", 110.0, (5.0,)))
    assert new["tool_running_seconds"] == 10.0 and new["tool_runs_seen"] == 0.0
    assert math.isnan(new["tool_remaining_p50_seconds"])
    assert math.isnan(new["tool_back_within_horizon_p"])
    # Longer than every run of its tool: the same.
    (long,) = named(tool_features(t, "long", 110.0, (5.0,)))
    assert long["tool_running_seconds"] == 10.0 and long["tool_runs_seen"] == 4.0
    assert math.isnan(long["tool_remaining_p90_seconds"])
    # Once it returns (its finish, or the session's next request): no call in flight.
    t.observe([finished("long", 111.0), routed("new", 112.0)])
    assert t.features(113.0, (5.0,)) == {}


def test_of_several_calls_in_flight_the_one_expected_back_last_speaks() -> None:
    """An agent calls again once every parallel call returned: of a slow call started first and
    a fast one after it, the slow one speaks; a call its tool's runs say nothing of leaves the
    return unknown; once it and the fast one returned, the slow one still speaks."""
    t = ToolDurations()
    t.observe(runs("build", [100.0] * 10) + runs("grep", [10.0] * 10))
    t.observe([started("agent", 1001.0, "build"), started("agent", 1010.0, "grep")])
    (row,) = named(tool_features(t, "agent", 1010.5, (5.0,)))
    assert row["tool_running_seconds"] == 9.5 and row["tool_runs_seen"] == 10.0
    assert row["tool_remaining_p50_seconds"] == 90.5 and row["tool_back_within_horizon_p"] == 0.0
    t.observe([started("agent", 1011.0, "unknown_tool")])
    (row,) = named(tool_features(t, "agent", 1011.5, (5.0,)))
    assert row["tool_running_seconds"] == 0.5 and math.isnan(row["tool_remaining_p50_seconds"])
    t.observe([finished("agent", 1012.0, "unknown_tool"), finished("agent", 1020.0, "grep")])
    (row,) = named(tool_features(t, "agent", 1050.0, (5.0,)))
    assert row["tool_running_seconds"] == 49.0 and row["tool_remaining_p50_seconds"] == 51.0


def test_the_table_reads_the_same_for_every_row_and_subset() -> None:
    t = ToolDurations()
    t.observe(runs("bash", [2.0] * 10 + [20.0] * 10))
    sessions = [
        view([100.0, 200.0], []).model_copy(update={"session_id": f"s{i}"}) for i in range(60)
    ]
    t.observe([started(f"s{i}", 200.0 + i) for i in range(0, 60, 3)])
    now, horizons = 215.0, (5.0, 30.0)
    reference = feature_matrix(sessions[:5], now, horizons, tools=t)  # the per-session path
    table = FeatureTable.from_views(sessions)
    full = table.matrix(now, horizons, tools=t)
    np.testing.assert_array_equal(full[:10], reference)
    assert np.array_equal(feature_matrix(sessions, now, horizons, tools=t), full, equal_nan=True)
    tool_cols = [FEATURES.index(n) for n in TOOL_FEATURES]
    with_call = ~np.isnan(full[:, tool_cols[0]])
    assert with_call.sum() == 2 * 20  # each session with a call, at each horizon
    rows = np.array([9, 0, 9, 4])
    picked = full.reshape(60, 2, -1)[rows].reshape(-1, len(FEATURES))
    assert np.array_equal(table.matrix(now, horizons, rows, tools=t), picked, equal_nan=True)
    assert np.isnan(table.matrix(now, horizons)[:, tool_cols]).all()  # no tools: NaN


def test_a_model_trained_before_the_tool_features_still_serves(tmp_path: Path) -> None:
    """The bundled model of before (every feature but the tool ones) reads its own columns, by
    name, whatever the tool features say."""
    import lightgbm as lgb

    old = [n for n in FEATURES if n not in TOOL_FEATURES]
    assert old[-1] == HORIZON_FEATURE
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 100, (500, len(old)))
    y = ((x[:, 0] < 50) | (x[:, -1] > 50)).astype(int)  # the horizon, last, matters too
    booster = lgb.train(
        {"objective": "binary", "verbose": -1, "min_data_in_leaf": 5},
        lgb.Dataset(x, y, feature_name=old),
        num_boost_round=3,
    )
    (tmp_path / "old").mkdir()
    booster.save_model(str(tmp_path / "old" / "model.txt"))
    t = ToolDurations()
    t.observe(runs("bash", [5.0] * 20))
    t.observe([started("s", 250.0)])
    model = LearnedPredictor(tmp_path / "old", backend="booster", tools=t)
    assert model.feature_names == tuple(old)
    sessions = [view([100.0, 200.0], [])]
    full = feature_matrix(sessions, 252.0, (30.0, 300.0), tools=t)
    assert not np.isnan(full[:, FEATURES.index("tool_remaining_p50_seconds")]).any()
    expected = booster.predict(full[:, [FEATURES.index(n) for n in old]]).reshape(1, 2)
    np.testing.assert_allclose(model.p_within(sessions, 252.0, (30.0, 300.0)), expected)
    table = FeatureTable.from_views(sessions)
    np.testing.assert_allclose(model.p_within_table(table, 252.0, (30.0, 300.0)), expected)


def test_the_services_models_read_the_engines_tool_durations(tmp_path: Path) -> None:
    """The serving model and the shadow read the ToolDurations the engine's ingest feeds."""
    settings = Settings(
        data_dir=tmp_path, log_fsync=False, shadow_model_dir=DEFAULT_MODEL_DIR, tools_tracked=4
    )
    engine = Engine(
        settings,
        store=MemoryStore(bytes_per_token=1024, block_tokens=512),
        clock=ManualClock(0.0),
        order_sink=InProcessSink(),
        recover=False,
    )
    try:
        assert engine.tools.tracked == 4
        serving, shadow = engine.models.serving.predictor, engine.models.shadow
        assert isinstance(serving, LearnedPredictor) and shadow is not None
        assert serving.tools is engine.tools and shadow.predictor.tools is engine.tools  # type: ignore[attr-defined]
    finally:
        asyncio.run(engine.close())
