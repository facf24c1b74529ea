"""Train the arrival model: LightGBM, P(next request within horizon | session features, horizon).

Split by time, never at random: the last `valid_fraction` of each log's time span validates (early
stopping, calibration, metrics), the rest trains. Deterministic for a given seed and data.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightgbm as lgb
import numpy as np
import pandas as pd
from sklearn.metrics import brier_score_loss, log_loss, roc_auc_score

from app.predict.features import FEATURES
from training.lineage import code_version, command_line, data_span, rows_per_horizon
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
) -> TrainedModel:
    """Fit on the earlier part of each log, stop early on the later part. `progress`, when given,
    hears of each boosting round (training/progress.py); without it nothing is printed."""
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
    booster = fit_booster(
        merged,
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
        "signals": train_signals(df),
        **data_lineage(df, train_df, valid_df),
    }
    return TrainedModel(booster, metrics, calibration, importance, merged, data)


def data_lineage(
    df: pd.DataFrame, train_df: pd.DataFrame, valid_df: pd.DataFrame
) -> dict[str, Any]:
    """The card's lineage of the rows: each log's path, SHA-256 and span (`log_files`, from
    build_dataset's `df.attrs`; [] for rows made otherwise), the span of event time they cover,
    and the rows of every horizon on each side of the split."""
    records = list(df.attrs.get("logs", []))
    return {
        "log_files": records,
        "span": data_span(records),
        "rows_per_horizon": rows_per_horizon(train_df, valid_df),
    }


def train_signals(df: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Per signal kind the rows' logs held: how many, how many followed by a request within 60 s,
    and the share (training/dataset.py puts the counts in `df.attrs`); {} for logs without."""
    return {
        kind: {**counts, "followed_share": round(counts["followed"] / counts["signals"], 4)}
        for kind, counts in sorted(df.attrs.get("signals", {}).items())
        if counts["signals"]
    }


def save_model(
    model: TrainedModel,
    out_dir: Path,
    *,
    extra: dict[str, Any] | None = None,
    command: str | None = None,
) -> Path:
    """Write model.txt (LightGBM's text format) and card.json beside it. `command`: what ran
    (default: this process's arguments), for the card's lineage."""
    out_dir.mkdir(parents=True, exist_ok=True)
    code = code_version()
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
        # Kept for cards read before `code_version` (which holds it too).
        "git_commit": code.get("git_commit"),
        "code_version": code,
        "command": command if command is not None else command_line(),
        **(extra or {}),
    }
    (out_dir / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    return out_dir


def _tree_blocks(model_text: str) -> tuple[str, list[dict[str, str]], str]:
    """A LightGBM text model: its header (without tree_sizes), its trees (key -> value, in
    order), and what follows the trees."""
    head, rest = model_text.split("\nTree=", 1)
    body, tail = rest.split("\nend of trees", 1)
    header = "\n".join(line for line in head.splitlines() if not line.startswith("tree_sizes="))
    trees = []
    for block in ("Tree=" + body).split("\nTree="):
        lines = [line for line in block.strip().splitlines()[1:] if "=" in line]
        trees.append(dict(line.split("=", 1) for line in lines))
    return header, trees, "end of trees" + tail


def _gated(tree: dict[str, str], feature: int, threshold: float, left: bool) -> dict[str, str]:
    """`tree` behind a new root split `feature <= threshold`: on the `left` side (or the right)
    the tree as it was, on the other a leaf of 0 (the tree adds nothing there). Missing values
    read as 0 (missing type None), so they go left of a positive threshold."""
    n = int(tree["num_leaves"])
    leaves = [float(v) for v in tree["leaf_value"].split()]
    zero = f"{-(n + 1)}"  # the added leaf, after the tree's own
    old_root = "1" if n > 1 else "-1"  # a one-leaf tree's root is its leaf

    def shifted(key: str) -> list[str]:
        if n == 1:
            return []
        return [str(int(c) + 1) if int(c) >= 0 else c for c in tree[key].split()]

    def internal(key: str, root: str) -> str:
        return " ".join([root, *(tree[key].split() if n > 1 else [])])

    counts = [int(c) for c in tree.get("leaf_count", "0").split()]
    out = dict(tree)
    out["num_leaves"] = str(n + 1)
    out["split_feature"] = internal("split_feature", str(feature))
    out["split_gain"] = internal("split_gain", "0")
    out["threshold"] = internal("threshold", repr(float(threshold)))
    out["decision_type"] = internal("decision_type", "2")  # numerical, missing None
    out["left_child"] = " ".join([old_root if left else zero, *shifted("left_child")])
    out["right_child"] = " ".join([zero if left else old_root, *shifted("right_child")])
    out["leaf_value"] = " ".join([*(repr(v) for v in leaves), "0"])
    out["leaf_weight"] = " ".join([*tree.get("leaf_weight", "0").split(), "0"])
    out["leaf_count"] = " ".join([*map(str, counts), "0"])
    out["internal_value"] = internal("internal_value", "0")
    out["internal_weight"] = internal("internal_weight", "0")
    out["internal_count"] = internal("internal_count", str(sum(counts)))
    return out


def _merged_header(below: str, above: str) -> str:
    """`above`'s header, with each feature's range covering both models' (a feature constant in
    one part is "none" there; lleaves reads a "none" feature's splits as on integers)."""
    infos = []
    for a, b in zip(_feature_infos(below), _feature_infos(above)):
        if a == "none" or b == "none":
            infos.append(b if a == "none" else a)
        else:
            (a_low, a_high), (b_low, b_high) = (
                map(float, a.strip("[]").split(":")),
                map(float, b.strip("[]").split(":")),
            )
            infos.append(f"[{min(a_low, b_low)!r}:{max(a_high, b_high)!r}]")
    return "\n".join(
        f"feature_infos={' '.join(infos)}" if line.startswith("feature_infos=") else line
        for line in above.splitlines()
    )


def _feature_infos(header: str) -> list[str]:
    line = next(x for x in header.splitlines() if x.startswith("feature_infos="))
    return line.split("=", 1)[1].split()


def merge_by_feature(
    below: lgb.Booster, above: lgb.Booster, feature: str, threshold: float
) -> lgb.Booster:
    """One model that is `below` where `feature <= threshold` (or missing) and `above` elsewhere:
    each tree of each gated by a root split on `feature`, the other side a leaf of 0, so the raw
    scores add up to exactly one model's. Both must be trained on FEATURES, same objective."""
    index = FEATURES.index(feature)
    below_header, below_trees, _ = _tree_blocks(below.model_to_string(num_iteration=-1))
    above_header, above_trees, tail = _tree_blocks(above.model_to_string(num_iteration=-1))
    header = _merged_header(below_header, above_header)
    trees = [_gated(t, index, threshold, left=True) for t in below_trees] + [
        _gated(t, index, threshold, left=False) for t in above_trees
    ]
    blocks = [
        f"Tree={i}\n" + "\n".join(f"{k}={v}" for k, v in tree.items()) + "\n"
        for i, tree in enumerate(trees)
    ]
    # The feature importances after the trees are one model's: dropped (the card has the gain).
    parameters = tail[tail.find("parameters:") :] if "parameters:" in tail else ""
    text = header + "\n\n" + "\n".join(blocks) + "\nend of trees\n\n" + parameters
    return lgb.Booster(model_str=text)


def train_split(df: pd.DataFrame, feature: str, threshold: float, *, seed: int = 0) -> TrainedModel:
    """Two models in one: `train` on the rows with `feature <= threshold` and, apart, on the
    rest, joined by `merge_by_feature` (training/bundle.py: deployments that send no signals and
    ones that do, so the signalled logs cannot move what the model says where none come)."""
    below = train(df[~(df[feature] > threshold)], seed=seed)
    above = train(df[df[feature] > threshold], seed=seed)
    booster = merge_by_feature(_best(below.booster), _best(above.booster), feature, threshold)
    _, valid_df = split_by_time(df, 0.2)
    metrics, calibration = evaluate_rows(booster, valid_df)
    metrics["parts"] = {"below": below.metrics, "above": above.metrics}
    gain = booster.feature_importance(importance_type="gain")
    total = float(gain.sum()) or 1.0
    importance = {
        f: round(float(g) / total, 4) for f, g in sorted(zip(FEATURES, gain), key=lambda kv: -kv[1])
    }
    params = {**above.params, "split_by": {"feature": feature, "threshold": threshold}}
    data = {**above.data, "rows_train": below.data["rows_train"] + above.data["rows_train"]}
    data["rows_valid"] = below.data["rows_valid"] + above.data["rows_valid"]
    data["logs"] = sorted(set(below.data["logs"]) | set(above.data["logs"]))
    data["signals"] = train_signals(df)
    data.update(data_lineage(df, *split_by_time(df, 0.2)))
    return TrainedModel(booster, metrics, calibration, importance, params, data)


def _best(booster: lgb.Booster) -> lgb.Booster:
    """The booster cut at its best iteration (early stopping's)."""
    return lgb.Booster(model_str=booster.model_to_string(num_iteration=booster.best_iteration))
