"""The arrival model trained on a Dask cluster, as training.train trains it.

The same model as `training.train`: a binary LightGBM classifier with DEFAULT_PARAMS on
FEATURES, the rows split by time (the last `valid_fraction` validates), trained by LightGBM's
data-parallel learner across the workers. From the shards' Parquet files (FleetRows:
`train_files`) each worker builds its Dataset from its share of the files in batches, so its
memory is its rows binned, not its rows as numbers twice (lightgbm.dask's estimators); from a
DataFrame, lightgbm.dask.DaskLGBMClassifier. The distributed learner has no early stopping, so
the cluster boosts `num_boost_round` rounds while scoring the validation part each round, and
the model is cut where early stopping (`early_stopping_rounds` without a better log loss) would
have stopped: the same rule, applied after the rounds instead of during them.

`dask_client("local:2")` starts a LocalCluster of 2 worker processes (one thread each);
any other address is a running scheduler's (`tcp://host:8786`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightgbm as lgb
import numpy as np
import pandas as pd

from app.predict.features import FEATURES
from training.fleet import FleetRows
from training.lineage import data_span, rows_per_horizon
from training.train import (
    DEFAULT_PARAMS,
    TrainedModel,
    data_lineage,
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

    `rows`: a DataFrame, sent to the workers and trained by lightgbm.dask; or FleetRows, the
    shards' Parquet files, which the workers read themselves in batches (train_files): then
    only the validation part comes to this process. `stage(name)` hears each step begin (fit,
    evaluate)."""
    merged = {**DEFAULT_PARAMS, **(params or {}), "seed": seed}
    # One thread per worker: the workers share the machine's cores between them.
    merged["num_threads"] = 1
    if isinstance(rows, FleetRows):
        return train_files(
            rows,
            client,
            merged,
            valid_fraction=valid_fraction,
            num_boost_round=num_boost_round,
            early_stopping_rounds=early_stopping_rounds,
            stage=stage,
        )
    import dask.dataframe as dd

    features = list(FEATURES)
    workers = max(len(client.scheduler_info().get("workers", {})), 1)
    if rows.empty:
        raise ValueError("no training rows")
    train_df, valid_df = split_by_time(rows, valid_fraction)
    if train_df.empty or valid_df.empty:
        raise ValueError(
            f"splitting the rows at {1 - valid_fraction:.0%} of the time span leaves a side empty"
        )
    train_part = dd.from_pandas(train_df[[*features, "label"]], npartitions=workers)
    valid_part = dd.from_pandas(valid_df[[*features, "label"]], npartitions=workers)
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
        train_part[features],
        train_part["label"],
        eval_set=[(valid_part[features], valid_part["label"])],
        eval_names=["valid"],
        eval_metric="binary_logloss",
    )
    booster: lgb.Booster = model.booster_
    losses = model.evals_result_["valid"]["binary_logloss"]
    booster.best_iteration = stopping_iteration(list(losses), early_stopping_rounds)
    if stage is not None:
        stage("evaluate")
    data = {
        "rows_train": len(train_df),
        "rows_valid": len(valid_df),
        "logs": sorted(rows.log.unique().tolist()),
        "valid_fraction": valid_fraction,
        "signals": train_signals(rows),
        "dask_workers": workers,
        **data_lineage(rows, train_df, valid_df),
    }
    return _trained(booster, valid_df, merged, data)


def _trained(
    booster: Any, valid_df: pd.DataFrame, params: dict[str, Any], data: dict[str, Any]
) -> TrainedModel:
    """The model card's parts, as training.train makes them."""
    metrics, calibration = evaluate_rows(booster, valid_df)
    metrics["best_iteration"] = int(booster.best_iteration)
    gain = booster.feature_importance(importance_type="gain", iteration=booster.best_iteration)
    total = float(gain.sum()) or 1.0
    importance = {
        f: round(float(g) / total, 4) for f, g in sorted(zip(FEATURES, gain), key=lambda kv: -kv[1])
    }
    return TrainedModel(booster, metrics, calibration, importance, params, data)


def train_files(
    rows: FleetRows,
    client: Any | None,
    params: dict[str, Any],
    *,
    valid_fraction: float = 0.2,
    num_boost_round: int = 1000,
    early_stopping_rounds: int = 50,
    stage: Callable[[str], None] | None = None,
) -> TrainedModel:
    """LightGBM's data-parallel learner (what lightgbm.dask runs) on the cluster, each worker
    building its Dataset from its share of the shards' files in batches (lgb.Sequence): a
    worker holds its rows binned (a byte a feature) and one file's rows as numbers, never its
    whole share as numbers, as lightgbm.dask's estimators do (its parts, then their
    concatenation). Workers agree on the bins (LightGBM finds them across the network) and
    merge histograms as lightgbm.dask's do; lightgbm.dask's port assignment is reused.

    Each worker scores its own part of the validation rows each round; the rounds' log loss
    over all of them (weighted by rows) decides the cut, as in train_dask. `client` None: the
    same in this process alone (LightGBM's serial learner, `params`' threads), bounded alike."""
    if not rows.files:
        raise ValueError("no training rows")
    cut = 1.0 - valid_fraction
    files = [str(p) for p in rows.files]
    if client is None:
        if stage is not None:
            stage("fit")
        results = [_train_share(files, cut, params, num_boost_round, None)]
        workers = 0
    else:
        results = _train_on_cluster(client, files, cut, params, num_boost_round, stage)
        workers = len(client.scheduler_info().get("workers", {}))
    rows_train = sum(r["rows_train"] for r in results)
    rows_valid = sum(r["rows_valid"] for r in results)
    if rows_train == 0 or rows_valid == 0:
        raise ValueError(f"splitting the rows at {cut:.0%} of the time span leaves a side empty")
    losses = [
        sum(r["rows_valid"] * r["losses"][i] for r in results if r["rows_valid"]) / rows_valid
        for i in range(num_boost_round)
    ]
    booster = lgb.Booster(model_str=results[0]["model"])
    booster.best_iteration = stopping_iteration(losses, early_stopping_rounds)
    if stage is not None:
        stage("evaluate")
    valid_df = pd.concat([_read_side(f, cut, valid=True) for f in files], ignore_index=True)
    data = {
        "rows_train": rows_train,
        "rows_valid": rows_valid,
        "logs": sorted(rows.log_names),
        "valid_fraction": valid_fraction,
        "signals": _signals(rows.signals),
        "dask_workers": workers,
        "log_files": rows.lineage,
        "span": data_span(rows.lineage),
        "rows_per_horizon": _rows_per_horizon(files, cut),
    }
    return _trained(booster, valid_df, params, data)


def _rows_per_horizon(files: list[str], cut: float) -> dict[str, dict[str, int]]:
    """The card's rows of each horizon on each side of `cut`, from the shards' files (two
    columns read: the rows themselves stay on the workers)."""
    sides = [pd.read_parquet(f, columns=["horizon_seconds", "time_fraction"]) for f in files]
    both = pd.concat(sides, ignore_index=True)
    early = both.time_fraction < cut
    return rows_per_horizon(both[early], both[~early])


def _train_on_cluster(
    client: Any,
    files: list[str],
    cut: float,
    params: dict[str, Any],
    rounds: int,
    stage: Callable[[str], None] | None,
) -> list[dict[str, Any]]:
    """_train_share on each worker, with its share of the files, networked."""
    from dask.distributed import wait
    from lightgbm.dask import _assign_open_ports_to_workers

    addresses = sorted(client.scheduler_info().get("workers", {}))
    if not addresses:
        raise ValueError("the Dask cluster has no workers")
    # The files dealt round robin: the shards are alike in size.
    shares = {a: files[i :: len(addresses)] for i, a in enumerate(addresses)}
    shares = {a: f for a, f in shares.items() if f}
    sockets, ports = _assign_open_ports_to_workers(client=client, workers=list(shares))
    machines = ",".join(f"{a.split('://')[-1].rsplit(':', 1)[0]}:{ports[a]}" for a in shares)
    if stage is not None:
        stage("fit")
    futures = [
        client.submit(
            _train_share,
            share,
            cut,
            {
                **params,
                "machines": machines,
                "local_listen_port": ports[a],
                "num_machines": len(shares),
                "time_out": 120,
                "tree_learner": "data",
            },
            rounds,
            sockets[a],
            workers=[a],
            allow_other_workers=False,
            pure=False,
        )
        for a, share in shares.items()
    ]
    wait(futures)
    results: list[dict[str, Any]] = client.gather(futures)
    return results


def _read_side(path: str, cut: float, *, valid: bool) -> pd.DataFrame:
    """A shard file's rows before `cut` of the time span (or from it on): the features as
    float32 (half the memory of the validation rows scored here; a value would have to lie
    within float32's rounding of a split to go the other way), and the label."""
    rows = pd.read_parquet(path, columns=[*FEATURES, "label", "time_fraction"])
    side = rows[(rows.time_fraction >= cut) if valid else (rows.time_fraction < cut)]
    out = side[list(FEATURES)].astype(np.float32)
    out["label"] = side["label"].to_numpy()
    return out.reset_index(drop=True)


class _FileRows(lgb.Sequence):
    """One file's rows on one side of the cut, for lgb.Dataset (an lgb.Sequence): read when
    LightGBM first asks for them. LightGBM reads its sequences one after another (a sorted
    sample, then batches), so one file is kept at a time (_LAST)."""

    batch_size = 65_536

    def __init__(self, path: str, cut: float, valid: bool, length: int) -> None:
        self.key = (path, cut, valid)
        self.length = length

    def _rows(self) -> np.ndarray:
        global _LAST
        if _LAST[0] != self.key:
            _LAST = (None, None)  # the one before goes first
            path, cut, valid = self.key
            side = _read_side(path, cut, valid=valid)
            # float64, as training.train gives LightGBM: only one file's rows are held.
            _LAST = (self.key, side[list(FEATURES)].to_numpy(np.float64))
        rows = _LAST[1]
        assert rows is not None
        return rows

    def __getitem__(self, idx: Any) -> np.ndarray:
        return self._rows()[idx]

    def __len__(self) -> int:
        return self.length


_LAST: tuple[Any, np.ndarray | None] = (None, None)


def _train_share(
    files: list[str], cut: float, params: dict[str, Any], rounds: int, socket: Any
) -> dict[str, Any]:
    """On a worker: its files' Datasets, then LightGBM's distributed training with the others."""
    global _LAST

    labels: dict[bool, list[np.ndarray]] = {False: [], True: []}
    seqs: dict[bool, list[Any]] = {False: [], True: []}
    for f in files:
        side = pd.read_parquet(f, columns=["label", "time_fraction"])
        for valid in (False, True):
            mask = (side.time_fraction >= cut) if valid else (side.time_fraction < cut)
            y = side.label.to_numpy()[mask.to_numpy()]
            if len(y):
                labels[valid].append(y)
                seqs[valid].append(_FileRows(f, cut, valid, len(y)))
    if not seqs[False]:
        raise ValueError(f"no training rows in {len(files)} shard file(s) before the cut")
    train_set = lgb.Dataset(
        seqs[False], label=np.concatenate(labels[False]), feature_name=list(FEATURES)
    )
    valid_sets = []
    if seqs[True]:  # a share can end before the cut
        valid_sets.append(
            lgb.Dataset(seqs[True], label=np.concatenate(labels[True]), reference=train_set)
        )
    evals: dict[str, Any] = {}
    if socket is not None:
        socket.release()  # LightGBM listens on the port now
    try:
        booster = lgb.train(
            params,
            train_set,
            num_boost_round=rounds,
            valid_sets=valid_sets,
            valid_names=["valid"][: len(valid_sets)],
            callbacks=[lgb.record_evaluation(evals)],
        )
    finally:
        _LAST = (None, None)
    model = booster.model_to_string()
    if socket is not None:
        booster.free_network()
    return {
        "model": model,
        "losses": list(evals["valid"]["binary_logloss"]) if valid_sets else [],
        "rows_train": int(sum(len(y) for y in labels[False])),
        "rows_valid": int(sum(len(y) for y in labels[True])),
    }


def _signals(counts: dict[str, dict[str, int]]) -> dict[str, dict[str, float]]:
    """train_signals' card entry from FleetRows' counts."""
    frame = pd.DataFrame()
    frame.attrs["signals"] = counts
    return train_signals(frame)


__all__ = ["dask_client", "stopping_iteration", "train_dask", "train_files"]
