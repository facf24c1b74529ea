"""Train the arrival model: LightGBM, P(next request within horizon | session features, horizon).

Split by time, never at random: the last `valid_fraction` of each log's time span validates (early
stopping, calibration, metrics), the rest trains. Deterministic for a given seed and data.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightgbm as lgb
import numpy as np
import pandas as pd
from sklearn.metrics import brier_score_loss, log_loss, roc_auc_score

from app.predict.features import FEATURES
from training.progress import Progress

DEFAULT_PARAMS: dict[str, Any] = {
    "objective": "binary",
    "learning_rate": 0.05,
    "num_leaves": 31,
    "min_data_in_leaf": 50,
    "feature_fraction": 0.9,
    "bagging_fraction": 0.8,
    "bagging_freq": 1,
    "lambda_l2": 1.0,
    # The chance must rise with the horizon: asking about a longer wait can only add returns.
    "monotone_constraints": [1 if f == "horizon_seconds" else 0 for f in FEATURES],
    "monotone_constraints_method": "advanced",
    "num_threads": 2,
    "verbose": -1,
    "deterministic": True,
    "force_row_wise": True,
}


# An optional column of training rows: each row's weight.
WEIGHT_COLUMN = "weight"


@dataclass
class TrainedModel:
    booster: lgb.Booster
    metrics: dict[str, Any]
    calibration: list[dict[str, float]]
    importance: dict[str, float]
    params: dict[str, Any]
    data: dict[str, Any] = field(default_factory=dict)


def split_by_time(df: pd.DataFrame, valid_fraction: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    cut = 1.0 - valid_fraction
    return df[df.time_fraction < cut], df[df.time_fraction >= cut]


def split_inner(
    train_df: pd.DataFrame, valid_fraction: float, inner_valid_fraction: float
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The training part of split_by_time(df, valid_fraction), split again by time: its last
    `inner_valid_fraction` scores tuning trials, so the validation part stays unseen."""
    cut = (1.0 - valid_fraction) * (1.0 - inner_valid_fraction)
    return train_df[train_df.time_fraction < cut], train_df[train_df.time_fraction >= cut]


def fit_booster(
    params: dict[str, Any],
    train_df: pd.DataFrame,
    valid_df: pd.DataFrame,
    *,
    num_boost_round: int = 1000,
    early_stopping_rounds: int = 50,
    progress: Progress | None = None,
    task: str = "boosting rounds",
) -> lgb.Booster:
    """LightGBM on `train_df`, stopped early on `valid_df` (binary log loss). A `weight` column,
    when the rows have one, weighs them (training/bundle.py: plain logs against signalled ones)."""
    features = list(FEATURES)
    weighted = WEIGHT_COLUMN in train_df.columns
    dtrain = lgb.Dataset(
        train_df[features].to_numpy(),
        label=train_df.label.to_numpy(),
        weight=train_df[WEIGHT_COLUMN].to_numpy() if weighted else None,
        feature_name=features,
        free_raw_data=False,
    )
    dvalid = lgb.Dataset(
        valid_df[features].to_numpy(),
        label=valid_df.label.to_numpy(),
        weight=valid_df[WEIGHT_COLUMN].to_numpy() if weighted else None,
        reference=dtrain,
    )
    callbacks: list[Callable[..., Any]] = [lgb.early_stopping(early_stopping_rounds, verbose=False)]
    if progress is not None:
        callbacks.append(_rounds_reporter(progress, task, num_boost_round))
    booster = lgb.train(
        params,
        dtrain,
        num_boost_round=num_boost_round,
        valid_sets=[dvalid],
        valid_names=["valid"],
        callbacks=callbacks,
    )
    if progress is not None:
        # Early stopping ends the bar short of num_boost_round: close it where training stopped.
        progress(task, booster.current_iteration(), booster.current_iteration())
    return booster


def _rounds_reporter(progress: Progress, task: str, total: int) -> Any:
    def report(env: Any) -> None:
        progress(task, env.iteration + 1, total)

    # After early stopping (30), which may end the run.
    report.order = 40  # type: ignore[attr-defined]
    return report


def calibration_table(y: np.ndarray, p: np.ndarray, bins: int = 10) -> list[dict[str, float]]:
    edges = np.linspace(0.0, 1.0, bins + 1)
    table = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        mask = (p >= lo) & ((p < hi) if hi < 1.0 else (p <= hi))
        if mask.any():
            table.append(
                {
                    "bin_low": round(float(lo), 2),
                    "bin_high": round(float(hi), 2),
                    "rows": int(mask.sum()),
                    "mean_predicted": round(float(p[mask].mean()), 4),
                    "observed_rate": round(float(y[mask].mean()), 4),
                }
            )
    return table


def evaluate_rows(
    booster: lgb.Booster, df: pd.DataFrame
) -> tuple[dict[str, Any], list[dict[str, float]]]:
    y = df.label.to_numpy()
    p = booster.predict(df[list(FEATURES)].to_numpy(), num_iteration=booster.best_iteration or None)
    metrics: dict[str, Any] = {
        "rows": len(df),
        "positive_rate": round(float(y.mean()), 4),
        "brier": round(float(brier_score_loss(y, p)), 5),
        "brier_of_base_rate": round(float(brier_score_loss(y, np.full_like(p, y.mean()))), 5),
        "log_loss": round(float(log_loss(y, p, labels=[0, 1])), 5),
        "auc": round(float(roc_auc_score(y, p)), 4) if 0 < y.sum() < len(y) else None,
    }
    per_horizon = {}
    for h, part in df.groupby("horizon_seconds"):
        yp = booster.predict(
            part[list(FEATURES)].to_numpy(), num_iteration=booster.best_iteration or None
        )
        yh = part.label.to_numpy()
        per_horizon[str(int(h))] = {
            "rows": len(part),
            "positive_rate": round(float(yh.mean()), 4),
            "brier": round(float(brier_score_loss(yh, yp)), 5),
            "auc": round(float(roc_auc_score(yh, yp)), 4) if 0 < yh.sum() < len(yh) else None,
        }
    metrics["per_horizon"] = per_horizon
    return metrics, calibration_table(y, np.asarray(p))


def train(
    df: pd.DataFrame,
    params: dict[str, Any] | None = None,
    *,
    valid_fraction: float = 0.2,
    seed: int = 0,
    num_boost_round: int = 1000,
    early_stopping_rounds: int = 50,
    progress: Progress | None = None,
    root_split: tuple[str, float] | None = None,
) -> TrainedModel:
    """Fit on the earlier part of each log, stop early on the later part. `progress`, when given,
    hears of each boosting round (training/progress.py); without it nothing is printed.
    `root_split` (feature, threshold): every tree first splits there (LightGBM's forced splits),
    so the rows on each side are fitted apart (training/bundle.py: deployments without signals
    and with them)."""
    if df.empty:
        raise ValueError("no training rows")
    merged = {**DEFAULT_PARAMS, **(params or {}), "seed": seed}
    train_df, valid_df = split_by_time(df, valid_fraction)
    if train_df.empty or valid_df.empty:
        raise ValueError(
            f"splitting {len(df)} rows at {1 - valid_fraction:.0%} of the time span leaves a "
            "side empty"
        )
    features = list(FEATURES)
    with tempfile.TemporaryDirectory() as tmp:
        fit_params = merged
        if root_split is not None:
            name, threshold = root_split
            forced = Path(tmp) / "forced_splits.json"
            forced.write_text(json.dumps({"feature": FEATURES.index(name), "threshold": threshold}))
            fit_params = {**merged, "forcedsplits_filename": str(forced)}
            merged = {**merged, "root_split": {"feature": name, "threshold": threshold}}
        booster = fit_booster(
            fit_params,
            train_df,
            valid_df,
            num_boost_round=num_boost_round,
            early_stopping_rounds=early_stopping_rounds,
            progress=progress,
        )
    metrics, calibration = evaluate_rows(booster, valid_df)
    metrics["best_iteration"] = int(booster.best_iteration)
    gain = booster.feature_importance(importance_type="gain")
    total = float(gain.sum()) or 1.0
    importance = {
        f: round(float(g) / total, 4) for f, g in sorted(zip(features, gain), key=lambda kv: -kv[1])
    }
    data = {
        "rows_train": len(train_df),
        "rows_valid": len(valid_df),
        "logs": sorted(df.log.unique().tolist()),
        "valid_fraction": valid_fraction,
        # The signal kinds the logs held and how often each was followed by a request within
        # 60 s (training/dataset.py); {} when the logs had none.
        "signals": {
            kind: {**counts, "followed_share": round(counts["followed"] / counts["signals"], 4)}
            for kind, counts in sorted(df.attrs.get("signals", {}).items())
            if counts["signals"]
        },
    }
    return TrainedModel(booster, metrics, calibration, importance, merged, data)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def save_model(model: TrainedModel, out_dir: Path, *, extra: dict[str, Any] | None = None) -> Path:
    """Write model.txt (LightGBM's text format) and card.json beside it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.booster.save_model(
        str(out_dir / "model.txt"), num_iteration=model.booster.best_iteration or None
    )
    card = {
        "name": out_dir.name,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "task": "P(next request of a session within horizon_seconds)",
        "features": list(model.booster.feature_name()),
        "data": model.data,
        "metrics_valid": model.metrics,
        "calibration_valid": model.calibration,
        "feature_importance_gain": model.importance,
        "params": dict(model.params.items()),
        "versions": {
            "lightgbm": lgb.__version__,
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
        "git_commit": _git_commit(),
        **(extra or {}),
    }
    (out_dir / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    return out_dir
