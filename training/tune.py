"""Optional hyper-parameter search (`kvprefetch train --tune N`; needs the `tune` extra: Optuna).

Every trial trains on the earlier part of the training rows and is scored on the later part (an
inner time split): the validation part that the model card reports on is never looked at, so its
metrics stay an honest estimate. TPE is seeded, and LightGBM is deterministic, so the same rows
and seed give the same trials and the same best parameters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd

from app.core.errors import MissingExtraError
from training.progress import Progress
from training.train import DEFAULT_PARAMS, fit_booster, split_by_time, split_inner

# The last share of the training part's time span that scores the trials.
INNER_VALID_FRACTION = 0.2


@dataclass(frozen=True)
class TuningResult:
    best_params: dict[str, Any]
    best_inner_log_loss: float
    trials: list[dict[str, Any]]
    seed: int
    inner_valid_fraction: float

    def card(self) -> dict[str, Any]:
        """What card.json records under "tuning"."""
        return {
            "sampler": "optuna TPE",
            "metric": "binary log loss on the inner time split",
            "n_trials": len(self.trials),
            **asdict(self),
        }


def require_optuna() -> Any:
    """The optuna module, or MissingExtraError naming the extra that brings it."""
    try:
        import optuna
    except ImportError:
        raise MissingExtraError(
            "tuning needs Optuna, which is in the 'tune' extra: pip install 'kvprefetch[tune]'"
        ) from None
    return optuna


def search_space(trial: Any) -> dict[str, Any]:
    """Small on purpose: the parameters that matter most for a few hundred thousand rows."""
    return {
        "num_leaves": trial.suggest_int("num_leaves", 7, 127, log=True),
        "min_data_in_leaf": trial.suggest_int("min_data_in_leaf", 10, 400, log=True),
        "learning_rate": trial.suggest_float("learning_rate", 0.01, 0.2, log=True),
        "feature_fraction": trial.suggest_float("feature_fraction", 0.5, 1.0),
        "lambda_l2": trial.suggest_float("lambda_l2", 1e-3, 30.0, log=True),
    }


def tune(
    df: pd.DataFrame,
    n_trials: int,
    *,
    valid_fraction: float = 0.2,
    seed: int = 0,
    inner_valid_fraction: float = INNER_VALID_FRACTION,
    num_boost_round: int = 1000,
    early_stopping_rounds: int = 50,
    progress: Progress | None = None,
) -> TuningResult:
    """Run `n_trials` Optuna trials on the training part of `df`; returns the best parameters
    (to pass to training.train) and every trial's score."""
    if n_trials < 1:
        raise ValueError("tuning needs at least one trial")
    optuna = require_optuna()
    train_df, _ = split_by_time(df, valid_fraction)  # the validation part is never looked at here
    fit_df, score_df = split_inner(train_df, valid_fraction, inner_valid_fraction)
    if fit_df.empty or score_df.empty or score_df.label.nunique() < 2:
        raise ValueError(
            f"the inner time split of {len(train_df)} training rows leaves too little to score "
            "trials on: use longer logs or no --tune"
        )
    history: list[dict[str, Any]] = []

    def objective(trial: Any) -> float:
        params = {**DEFAULT_PARAMS, **search_space(trial), "seed": seed}
        booster = fit_booster(
            params,
            fit_df,
            score_df,
            num_boost_round=num_boost_round,
            early_stopping_rounds=early_stopping_rounds,
        )
        loss = float(booster.best_score["valid"]["binary_logloss"])
        history.append(
            {
                "number": trial.number,
                "params": dict(trial.params),
                "inner_log_loss": round(loss, 6),
                "best_iteration": int(booster.best_iteration),
            }
        )
        if progress is not None:
            progress("tuning trials", trial.number + 1, n_trials)
        return loss

    # Optuna logs every trial at INFO through its own logger; the library stays quiet, and the
    # level is put back so a notebook's choice survives.
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.create_study(
            direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed)
        )
        study.optimize(objective, n_trials=n_trials)
    finally:
        optuna.logging.set_verbosity(verbosity)
    return TuningResult(
        best_params=dict(study.best_params),
        best_inner_log_loss=round(study.best_value, 6),
        trials=history,
        seed=seed,
        inner_valid_fraction=inner_valid_fraction,
    )


__all__ = [
    "INNER_VALID_FRACTION",
    "MissingExtraError",
    "TuningResult",
    "require_optuna",
    "search_space",
    "tune",
]
