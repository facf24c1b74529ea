"""The arrival model trained on a Dask cluster (lightgbm.dask), as training.train trains it.

The same model as `training.train`: a binary LightGBM classifier with DEFAULT_PARAMS on
FEATURES, the rows split by time (the last `valid_fraction` validates). lightgbm.dask has no
early stopping, so the cluster boosts `num_boost_round` rounds while scoring the validation part
each round, and the model is cut where early stopping (`early_stopping_rounds` without a better
log loss) would have stopped: the same rule, applied after the rounds instead of during them.

`dask_client("local:2")` starts a LocalCluster of 2 worker processes (one thread each);
any other address is a running scheduler's (`tcp://host:8786`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pandas as pd

from app.predict.features import FEATURES
from training.train import (
    DEFAULT_PARAMS,
    TrainedModel,
    evaluate_rows,
    split_by_time,
    train_signals,
)

LOCAL_PREFIX = "local:"


@contextmanager
def dask_client(address: str) -> Iterator[Any]:
    """A distributed Client: "local:N" starts (and stops) N local worker processes."""
    from dask.distributed import Client, LocalCluster

    if address.startswith(LOCAL_PREFIX):
        try:
            workers = int(address[len(LOCAL_PREFIX) :])
        except ValueError:
            raise ValueError(f"--dask {address!r}: expected local:N, N a number") from None
        if workers < 1:
            raise ValueError(f"--dask {address!r}: N must be at least 1")
        with (
            LocalCluster(
                n_workers=workers,
                threads_per_worker=1,
                processes=True,
                dashboard_address=None,
            ) as cluster,
            Client(cluster) as client,
        ):
            yield client
        return
    with Client(address) as client:
        yield client


def stopping_iteration(losses: list[float], early_stopping_rounds: int) -> int:
    """The 1-based round early stopping keeps: the best so far when `early_stopping_rounds`
    rounds in a row have not beaten it (or at the end)."""
    best, best_i = float("inf"), 0
    for i, loss in enumerate(losses):
        if loss < best:
            best, best_i = loss, i
        elif i - best_i >= early_stopping_rounds:
            break
    return best_i + 1


def train_dask(
    df: pd.DataFrame,
    client: Any,
    params: dict[str, Any] | None = None,
    *,
    valid_fraction: float = 0.2,
    seed: int = 0,
    num_boost_round: int = 1000,
    early_stopping_rounds: int = 50,
) -> TrainedModel:
    """training.train on the cluster behind `client`; the card's metrics are computed here."""
    import dask.dataframe as dd
    import lightgbm as lgb

    if df.empty:
        raise ValueError("no training rows")
    train_df, valid_df = split_by_time(df, valid_fraction)
    if train_df.empty or valid_df.empty:
        raise ValueError(
            f"splitting {len(df)} rows at {1 - valid_fraction:.0%} of the time span leaves a "
            "side empty"
        )
    workers = max(len(client.scheduler_info().get("workers", {})), 1)
    merged = {**DEFAULT_PARAMS, **(params or {}), "seed": seed}
    # One thread per worker: the workers share the machine's cores between them.
    merged["num_threads"] = 1
    features = list(FEATURES)

    def frame(part: pd.DataFrame) -> tuple[Any, Any]:
        x = dd.from_pandas(part[features], npartitions=workers)
        y = dd.from_pandas(part["label"], npartitions=workers)
        return x, y

    x_train, y_train = frame(train_df)
    x_valid, y_valid = frame(valid_df)
    kwargs = {k: v for k, v in merged.items() if k not in ("objective", "verbose")}
    model = lgb.DaskLGBMClassifier(
        client=client,
        objective="binary",
        n_estimators=num_boost_round,
        verbose=-1,
        **kwargs,
    )
    model.fit(
        x_train,
        y_train,
        eval_set=[(x_valid, y_valid)],
        eval_names=["valid"],
        eval_metric="binary_logloss",
    )
    booster: lgb.Booster = model.booster_
    losses = model.evals_result_["valid"]["binary_logloss"]
    booster.best_iteration = stopping_iteration(list(losses), early_stopping_rounds)
    metrics, calibration = evaluate_rows(booster, valid_df)
    metrics["best_iteration"] = int(booster.best_iteration)
    gain = booster.feature_importance(importance_type="gain", iteration=booster.best_iteration)
    total = float(gain.sum()) or 1.0
    importance = {
        f: round(float(g) / total, 4) for f, g in sorted(zip(features, gain), key=lambda kv: -kv[1])
    }
    data = {
        "rows_train": len(train_df),
        "rows_valid": len(valid_df),
        "logs": sorted(df.log.unique().tolist()),
        "valid_fraction": valid_fraction,
        "signals": train_signals(df),
        "dask_workers": workers,
    }
    return TrainedModel(booster, metrics, calibration, importance, merged, data)


__all__ = ["dask_client", "stopping_iteration", "train_dask"]
