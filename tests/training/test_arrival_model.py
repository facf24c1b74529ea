"""The public load_model and predict: the bundled model or a saved one, scored on a frame as
training.build_dataset makes it, by column name; a frame without a feature column is refused by
name."""

from __future__ import annotations

from pathlib import Path

import lightgbm as lgb
import numpy as np
import pandas as pd
import pytest

import training
from app.core.bundle import DEFAULT_MODEL_DIR
from app.predict.features import FEATURES
from app.predict.predictors import ModelError
from training import load_model, save_model, train


def _booster_p(model_dir: Path, frame: pd.DataFrame) -> np.ndarray:
    """LightGBM's own answer, reading the model file and the frame's columns by the model's
    feature names: the reference predict must match."""
    booster = lgb.Booster(model_file=str(model_dir / "model.txt"))
    return np.asarray(booster.predict(frame[booster.feature_name()].to_numpy(dtype=np.float64)))


def test_the_public_api_exports_load_model() -> None:
    assert {"load_model", "ArrivalModel"} <= set(training.__all__)
    namespace: dict[str, object] = {}
    exec("from training import *", namespace)
    assert namespace["load_model"] is load_model


def test_the_bundled_model_scores_a_dataset_frame(tiny_rows: pd.DataFrame) -> None:
    model = load_model()
    assert model.dir == DEFAULT_MODEL_DIR
    assert model.card, "the bundled model's card.json is read"
    assert set(model.feature_names) <= set(FEATURES)
    p = model.predict(tiny_rows)
    assert p.shape == (len(tiny_rows),) and p.dtype == np.float64
    assert ((p >= 0) & (p <= 1)).all()
    np.testing.assert_allclose(p, _booster_p(DEFAULT_MODEL_DIR, tiny_rows), rtol=0, atol=1e-12)
    # Not one answer for every row: the features reach the trees.
    assert p.std() > 0.01


def test_columns_are_read_by_name_and_others_ignored(tiny_rows: pd.DataFrame) -> None:
    model = load_model()
    expected = model.predict(tiny_rows)
    shuffled = tiny_rows[list(reversed(tiny_rows.columns))].copy()
    shuffled["unrelated"] = 1.0
    np.testing.assert_array_equal(model.predict(shuffled), expected)
    # The frame's row order, not its index.
    reordered = tiny_rows.iloc[::-1].reset_index(drop=True)
    np.testing.assert_array_equal(model.predict(reordered), expected[::-1])
    assert model.predict(tiny_rows.iloc[:0]).shape == (0,)


def test_a_frame_without_feature_columns_is_refused_by_name(tiny_rows: pd.DataFrame) -> None:
    dropped = ["horizon_seconds", FEATURES[0]]
    with pytest.raises(ValueError) as raised:
        load_model().predict(tiny_rows.drop(columns=dropped))
    message = str(raised.value)
    for name in dropped:
        assert name in message
    others = [name for name in FEATURES if name not in dropped]
    assert not any(f"{name}," in message or message.endswith(name) for name in others)


def test_a_saved_model_loads_from_its_directory(tiny_rows: pd.DataFrame, tmp_path: Path) -> None:
    trained = train(tiny_rows, {"num_threads": 1}, num_boost_round=5, seed=0)
    out = save_model(trained, tmp_path / "mine")
    model = load_model(str(out))
    assert model.dir == out
    p = model.predict(tiny_rows)
    np.testing.assert_allclose(p, _booster_p(out, tiny_rows), rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        p, trained.booster.predict(tiny_rows[list(FEATURES)].to_numpy()), rtol=0, atol=1e-12
    )
    # Another model than the bundled one: the directory is the one read.
    assert not np.allclose(p, load_model().predict(tiny_rows))


def test_a_directory_without_a_model_is_a_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no model at"):
        load_model(tmp_path)
