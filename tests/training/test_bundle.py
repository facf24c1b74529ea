"""`make model`'s mixed logs: the signal settings each trace is replayed with, and row weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from app.core.bundle import DEFAULT_MODEL_DIR
from app.predict.features import FEATURES
from app.predict.predictors import LearnedPredictor
from training.bundle import (
    BUNDLE_LOGS,
    COVERAGES,
    FALSE_ALARMS,
    LEAD_MEDIANS_SECONDS,
    SIGNAL_SETTINGS_PER_TRACE,
    repo_relative,
    signal_settings,
)
from training.dataset import HORIZONS
from training.train import WEIGHT_COLUMN, _best, save_model, train, train_split


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


def test_a_split_model_is_each_part_on_its_own_side(tmp_path: Path) -> None:
    df = rows(6000, 1)
    # 0 where no signals come, a spread of rates where they do; the label follows other
    # features on each side, so the two parts differ.
    signalled = np.arange(len(df)) % 2 == 0
    df["deployment_signals_per_arrival"] = np.where(
        signalled, np.random.default_rng(2).uniform(0.1, 3.0, len(df)), 0.0
    )
    df["label"] = np.where(signalled, df.turns > 0, df.idle_seconds > 0).astype(int)
    model = train_split(df, "deployment_signals_per_arrival", 1e-9)
    below = train(df[~signalled], num_boost_round=1000)
    above = train(df[signalled], num_boost_round=1000)
    x = df[list(FEATURES)].to_numpy()
    p = model.booster.predict(x)
    np.testing.assert_allclose(p[~signalled], _best(below.booster).predict(x[~signalled]))
    np.testing.assert_allclose(p[signalled], _best(above.booster).predict(x[signalled]))
    # A missing deployment feature reads as "no signals here".
    missing = x[~signalled].copy()
    missing[:, FEATURES.index("deployment_signals_per_arrival")] = np.nan
    np.testing.assert_allclose(model.booster.predict(missing), p[~signalled])
    assert model.params["split_by"]["feature"] == "deployment_signals_per_arrival"
    # It serves as any model: the Booster, and compiled to machine code (lleaves) alike.
    save_model(model, tmp_path / "m")
    served = LearnedPredictor(tmp_path / "m", backend="compiled", cache_dir=tmp_path / "cache")
    np.testing.assert_allclose(served.p_from_matrix(x), p, rtol=1e-6, atol=1e-9)


def test_the_bundled_card_names_its_data_and_code() -> None:
    card = json.loads((DEFAULT_MODEL_DIR / "card.json").read_text())
    files = card["data"]["log_files"]
    # Every log `make model` replayed, by a path any clone finds (under var/bundle-logs/).
    assert {Path(f["path"]).name for f in files} == set(card["data"]["logs"])
    for f in files:
        assert not Path(f["path"]).is_absolute() and f["path"].startswith("var/bundle-logs/")
        assert len(f["sha256"]) == 64 and f["events"] > 0
        assert f["first_event_ts"] <= f["last_event_ts"]
    span = card["data"]["span"]
    assert span["first_event_ts"] == min(f["first_event_ts"] for f in files)
    assert set(card["data"]["rows_per_horizon"]) == {str(int(h)) for h in HORIZONS}
    assert card["command"].startswith("python -m training.bundle")
    assert card["code_version"]["git_commit"]


def test_log_paths_inside_the_checkout_are_named_relative_to_it() -> None:
    inside = {"path": str(BUNDLE_LOGS / "a.jsonl"), "sha256": "0" * 64}
    assert repo_relative(inside)["path"] == "var/bundle-logs/a.jsonl"
    outside = {"path": "/elsewhere/a.jsonl"}
    assert repo_relative(outside) == outside
