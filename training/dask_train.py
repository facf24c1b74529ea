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

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pandas as pd

from app.predict.features import FEATURES
from training.fleet import FleetRows
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
    rows: pd.DataFrame | FleetRows,
    client: Any,
    params: dict[str, Any] | None = None,
    *,
    valid_fraction: float = 0.2,
    seed: int = 0,
    num_boost_round: int = 1000,
    early_stopping_rounds: int = 50,
    stage: Callable[[str], None] | None = None,
) -> TrainedModel:
    """training.train on the cluster behind `client`; the card's metrics are computed here.

    `rows`: a DataFrame (sent to the workers), or FleetRows, the shards' Parquet files that the
    workers read themselves: then only the validation part comes to this process."""
    import dask.dataframe as dd
    import lightgbm as lgb

    features = list(FEATURES)
    workers = max(len(client.scheduler_info().get("workers", {})), 1)
    cut = 1.0 - valid_fraction
    valid_table = None
    if isinstance(rows, FleetRows):
        if not rows.files:
            raise ValueError("no training rows")
        files = [str(p) for p in rows.files]
        # Each file's rows on either side of the cut, counted here from one column: the
        # arrays' chunk sizes, so that nothing is read twice to learn them.
        sides = [_sides(f, cut) for f in files]
        # One partition per shard file, read by a worker. Not read_parquet: it fuses small
        # partitions by the projected columns' size, so the labels' partitions stop matching the
        # features' and lightgbm.dask refuses them.
        table = dd.from_map(_read_rows, files)
        train_part = table[table.time_fraction < cut]
        valid_table = table[table.time_fraction >= cut]
        rows_train = sum(n for n, _ in sides)
        rows_valid = sum(n for _, n in sides)
        x_train, y_train = _arrays(train_part, [n for n, _ in sides], features)
        x_valid, y_valid = _arrays(valid_table, [n for _, n in sides], features)
        logs, signals = sorted(rows.log_names), _signals(rows.signals)
    else:
        if rows.empty:
            raise ValueError("no training rows")
        train_df, valid_df = split_by_time(rows, valid_fraction)
        rows_train, rows_valid = len(train_df), len(valid_df)
        train_part = dd.from_pandas(train_df[[*features, "label"]], npartitions=workers)
        valid_part = dd.from_pandas(valid_df[[*features, "label"]], npartitions=workers)
        x_train, y_train = train_part[features], train_part["label"]
        x_valid, y_valid = valid_part[features], valid_part["label"]
        logs, signals = sorted(rows.log.unique().tolist()), train_signals(rows)
    if rows_train == 0 or rows_valid == 0:
        raise ValueError(f"splitting the rows at {cut:.0%} of the time span leaves a side empty")
    merged = {**DEFAULT_PARAMS, **(params or {}), "seed": seed}
    # One thread per worker: the workers share the machine's cores between them.
    merged["num_threads"] = 1
    kwargs = {k: v for k, v in merged.items() if k not in ("objective", "verbose")}
    model = lgb.DaskLGBMClassifier(
        client=client,
        objective="binary",
        n_estimators=num_boost_round,
        verbose=-1,
        **kwargs,
    )
    if stage is not None:
        stage("fit")
    model.fit(
        x_train,
        y_train,
        eval_set=[(x_valid, y_valid)],
        eval_names=["valid"],
        eval_metric="binary_logloss",
        feature_name=features,
    )
    booster: lgb.Booster = model.booster_
    losses = model.evals_result_["valid"]["binary_logloss"]
    booster.best_iteration = stopping_iteration(list(losses), early_stopping_rounds)
    if stage is not None:
        stage("evaluate")
    if valid_table is not None:
        # Here only now: while the workers trained, their rows were theirs alone.
        valid_df = valid_table.compute()
    metrics, calibration = evaluate_rows(booster, valid_df)
    metrics["best_iteration"] = int(booster.best_iteration)
    gain = booster.feature_importance(importance_type="gain", iteration=booster.best_iteration)
    total = float(gain.sum()) or 1.0
    importance = {
        f: round(float(g) / total, 4) for f, g in sorted(zip(features, gain), key=lambda kv: -kv[1])
    }
    data = {
        "rows_train": rows_train,
        "rows_valid": rows_valid,
        "logs": logs,
        "valid_fraction": valid_fraction,
        "signals": signals,
        "dask_workers": workers,
    }
    return TrainedModel(booster, metrics, calibration, importance, merged, data)


def _read_rows(path: str) -> pd.DataFrame:
    """A shard's training columns, the features as float32: half the memory of the workers'
    copies, and LightGBM bins float32 as it bins float64 (to its bins' float edges)."""
    rows = pd.read_parquet(path, columns=[*FEATURES, "label", "time_fraction"])
    return rows.astype(dict.fromkeys(FEATURES, np.float32))


def _sides(path: str, cut: float) -> tuple[int, int]:
    """A shard's rows before and after `cut` of the time span."""
    fraction = pd.read_parquet(path, columns=["time_fraction"]).time_fraction
    before = int((fraction < cut).sum())
    return before, int((fraction >= cut).sum())


def _arrays(table: Any, lengths: list[int], features: list[str]) -> tuple[Any, Any]:
    """The features and labels as Dask arrays with known chunks: lightgbm.dask then stacks
    numpy arrays on each worker, one copy of its rows (a DataFrame's would be two)."""
    x = table[features].to_dask_array(lengths=lengths)
    y = table["label"].to_dask_array(lengths=lengths)
    return x, y


def _signals(counts: dict[str, dict[str, int]]) -> dict[str, dict[str, float]]:
    """train_signals' card entry from FleetRows' counts."""
    frame = pd.DataFrame()
    frame.attrs["signals"] = counts
    return train_signals(frame)


__all__ = ["dask_client", "stopping_iteration", "train_dask"]
