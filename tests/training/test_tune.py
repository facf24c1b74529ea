"""--tune: seeded and deterministic, scored on an inner time split, never on the validation part."""

from __future__ import annotations

import sys

import pandas as pd
import pytest

from training.train import split_by_time
from training.tune import MissingExtraError, tune

ROUNDS = 30  # enough to tell trials apart; the full default would only make the test slower


def test_same_seed_same_trials_and_the_validation_part_is_never_read(
    tiny_rows: pd.DataFrame,
) -> None:
    first = tune(tiny_rows, 2, seed=3, num_boost_round=ROUNDS)
    assert set(first.best_params) == {
        "num_leaves",
        "min_data_in_leaf",
        "learning_rate",
        "feature_fraction",
        "lambda_l2",
    }
    assert len(first.trials) == 2 and first.card()["n_trials"] == 2
    # The validation part's labels turned upside down change nothing: no trial looked at them.
    _, valid = split_by_time(tiny_rows, 0.2)
    flipped = tiny_rows.copy()
    flipped.loc[valid.index, "label"] = 1 - flipped.loc[valid.index, "label"]
    again = tune(flipped, 2, seed=3, num_boost_round=ROUNDS)
    assert again == first


def test_missing_optuna_names_the_extra(
    tiny_rows: pd.DataFrame, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "optuna", None)  # what an import of an absent package sees
    with pytest.raises(MissingExtraError, match=r"kvprefetch\[tune\]"):
        tune(tiny_rows, 2)
