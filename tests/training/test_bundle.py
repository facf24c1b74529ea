"""`make model`'s mixed logs: the signal settings each trace is replayed with, and row weights."""

from __future__ import annotations

import numpy as np
import pandas as pd

from app.predict.features import FEATURES
from training.bundle import (
    COVERAGES,
    FALSE_ALARMS,
    LEAD_MEDIANS_SECONDS,
    SIGNAL_SETTINGS_PER_TRACE,
    signal_settings,
)
from training.train import WEIGHT_COLUMN, train


def test_each_trace_gets_every_level_once_in_its_own_order() -> None:
    first, second = signal_settings(0), signal_settings(1)
    assert signal_settings(0) == first  # deterministic
    for settings in (first, second):
        assert len(settings) == SIGNAL_SETTINGS_PER_TRACE
        assert sorted(s["coverage"] for s in settings) == list(COVERAGES)
        assert sorted(s["lead_median_seconds"] for s in settings) == list(LEAD_MEDIANS_SECONDS)
        assert sorted(s["false_alarms"] for s in settings) == list(FALSE_ALARMS)
    assert first != second  # another draw, other signal seeds
    assert {s["seed"] for s in first}.isdisjoint(s["seed"] for s in second)


def rows(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    df = pd.DataFrame(rng.normal(size=(n, len(FEATURES))), columns=list(FEATURES))
    df["horizon_seconds"] = 60.0
    df["label"] = rng.integers(0, 2, n)
    df["time_fraction"] = np.linspace(0, 1, n)
    df["log"] = "x"
    return df


def test_row_weights_count_in_training() -> None:
    df = rows(4000, 0)
    plain = train(df, num_boost_round=30, early_stopping_rounds=30)
    # The returns weigh (almost) nothing: the model learns they hardly happen.
    df[WEIGHT_COLUMN] = np.where(df.label == 1, 1e-3, 1.0)
    weighted = train(df, num_boost_round=30, early_stopping_rounds=30)
    x = df[list(FEATURES)].to_numpy()
    assert weighted.booster.predict(x).mean() < 0.2 < plain.booster.predict(x).mean()


def test_a_root_split_is_every_trees_first_question() -> None:
    df = rows(4000, 1)
    # 0 where no signals come, a spread of rates where they do (LightGBM 4.7 cannot force a
    # split on a feature of two values only: the bundle's has many)
    rate = np.random.default_rng(2).uniform(0.1, 3.0, len(df))
    df["deployment_signals_per_arrival"] = np.where(np.arange(len(df)) % 2, 0.0, rate)
    model = train(
        df,
        num_boost_round=10,
        early_stopping_rounds=10,
        root_split=("deployment_signals_per_arrival", 1e-6),
    )
    trees = model.booster.dump_model()["tree_info"]
    roots = {t["tree_structure"].get("split_feature") for t in trees}
    assert roots == {FEATURES.index("deployment_signals_per_arrival")}
    assert model.params["root_split"]["feature"] == "deployment_signals_per_arrival"
