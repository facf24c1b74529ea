"""The fleet path (training/fleet.py): shards replayed apart, by processes or Dask workers, give
the single-process rows; lightgbm.dask on a 2-worker LocalCluster trains the same model as
training.train, within the bench's tolerance; `kvprefetch train --dask local:2` writes it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from app.core.config import Settings
from app.ingest.eventlog import FileEventLog, encode_batch, encode_events
from app.predict.features import DEPLOYMENT_FEATURES
from app.predict.tool_durations import tool_durations_for
from bench.train_fleet import QUALITY_TOLERANCE
from kvprefetch_cli import cli
from kvprefetch_client.events import Event
from sim.commands import events_from_trace
from sim.replay import replay
from sim.scenario import load_scenario
from sim.signals import with_signals
from sim.workloads import AgentWorkload, agent_trace
from tests.conftest import TRACES
from tests.training.test_signals import chat_with_signals
from training import build_dataset, train
from training.dask_train import dask_client, stopping_iteration, train_dask, train_files
from training.fleet import (
    ENGINES,
    DeploymentAt,
    ToolsAt,
    build_dataset_fleet,
    build_rows_fleet,
    shard_count,
)
from training.train import DEFAULT_PARAMS


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    with dask_client("local:2") as c:
        yield c


@pytest.fixture(scope="module")
def signal_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A log directory: signals (the deployment features move), whole posted batches, a
    repeated event, two segments."""
    folder = tmp_path_factory.mktemp("signal-log") / "log"
    events = chat_with_signals(120, seed=2)
    log = FileEventLog(folder, segment_bytes=40_000, fsync=False)
    for i in range(0, len(events), 50):
        batch = events[i : i + 50]
        if i % 100 == 0:
            body = b'{"events": [' + encode_events(batch).strip().replace(b"\n", b",") + b"]}"
            log.append(encode_batch(body))
        else:
            log.append(encode_events(batch))
    log.append(encode_events(events[:3]))  # sent again: the replay skips them
    log.close()
    return folder


@pytest.fixture(scope="module")
def trace_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The whole synthetic trace's events: enough rows for a held-out part of both labels."""
    log = tmp_path_factory.mktemp("trace-log") / "synthetic.events.jsonl"
    events_from_trace(TRACES / "mooncake_synthetic.jsonl", log, "default", "sticky", "none", None)
    return log


@pytest.mark.parametrize("engine", ENGINES)
def test_shards_give_the_single_process_rows(tiny_log: Path, engine: str) -> None:
    single = build_dataset([tiny_log])
    fleet = build_dataset_fleet([tiny_log], workers=2, shards=5, engine=engine)
    pd.testing.assert_frame_equal(single, fleet)
    assert fleet.attrs == single.attrs


def test_deployment_features_are_the_whole_logs_in_every_shard(signal_log: Path) -> None:
    single = build_dataset([signal_log])
    fleet = build_dataset_fleet([signal_log], workers=2, shards=7)
    # The deployment's signals move its features: a shard's own stream would give others.
    sent = [
        "deployment_signalled_arrival_share",
        "deployment_typing_followed_share",
        "deployment_opened_followed_share",
    ]
    assert set(sent) <= set(DEPLOYMENT_FEATURES)
    assert single[sent].notna().any().all()
    assert single["deployment_signals_per_arrival"].nunique() > 100
    pd.testing.assert_frame_equal(single, fleet)
    assert fleet.attrs["signals"] == single.attrs["signals"] != {}


@pytest.fixture(scope="module")
def tool_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Generated agent tasks replayed with every session's tool calls signalled."""
    trace = agent_trace(AgentWorkload(tasks=50, seconds=200.0, seed=9))
    scenario = load_scenario("agents")
    scenario = scenario.model_copy(
        update={"signals": with_signals(scenario.signals, {"tools": 1.0})}
    )
    log = tmp_path_factory.mktemp("tool-log") / "agents.events.jsonl"
    log.write_bytes(encode_events(replay(trace, scenario, keep_events=True).events))
    return log


@pytest.mark.parametrize("engine", ENGINES)
def test_tool_features_are_the_whole_logs_in_every_shard(
    tool_log: Path, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each shard reads the tool runs of every session (its own would give other quantiles and
    counts), and expires calls by the whole log's event time (a short limit: many expire)."""
    monkeypatch.setenv("KVP_TOOL_MAX_RUN_SECONDS", "4")
    monkeypatch.setenv("KVP_TOOLS_TRACKED", "5")
    single = build_dataset([tool_log])
    assert single["tool_remaining_p50_seconds"].notna().sum() > 100
    assert single["tool_runs_seen"].nunique() > 20
    fleet = build_dataset_fleet([tool_log], workers=2, shards=5, engine=engine)
    pd.testing.assert_frame_equal(single, fleet)


def test_tools_at_reads_the_whole_logs_tool_events_as_the_decisions_come() -> None:
    """A shard holds none of the log's tool events it has observed: ToolsAt pulls them as the
    decisions' times pass them (one ahead), not all at its start."""
    events = [
        e for e in chat_with_signals(40, seed=4) if e.type in ("request_routed", "session_signal")
    ]
    events.sort(key=lambda e: e.ts)
    pulled: list[Event] = []

    def read() -> Iterator[Event]:
        for e in events:
            pulled.append(e)
            yield e

    every_ts = np.asarray([e.ts for e in events])
    tools_at = ToolsAt(read(), every_ts, tool_durations_for(Settings()))
    middle = events[len(events) // 2].ts
    tools_at(events[0].session_id, middle, (15.0,))
    due = sum(e.ts <= middle for e in events)
    assert len(pulled) == due + 1 < len(events)


def test_dask_workers_replay_the_shards(client: Any, signal_log: Path, tiny_log: Path) -> None:
    single = build_dataset([tiny_log, signal_log])
    fleet = build_dataset_fleet([tiny_log, signal_log], client=client, shards=4)
    pd.testing.assert_frame_equal(single, fleet)


def test_the_duckdb_build_under_a_memory_limit_gives_the_same_rows(
    trace_log: Path, tmp_path: Path
) -> None:
    """DuckDB holds at most memory_limit while it orders and shards (past it, it spills under
    the work directory): the rows do not change; its database and spill files are removed."""
    single = build_dataset([trace_log])
    stages: list[str] = []
    fleet = build_dataset_fleet(
        [trace_log], workers=0, memory_limit="64MB", work_dir=tmp_path, stage=stages.append
    )
    pd.testing.assert_frame_equal(single, fleet)
    assert stages == ["scan", "dedupe", "shard", "timeline", "replay", "gather"]
    left = {p.name for p in (tmp_path / "log-0000").iterdir()}
    assert "scan.duckdb" not in left and "spill" not in left and "deployment.npz" in left


def test_shards_grow_with_the_log() -> None:
    assert shard_count(10_000, 2) == 8  # 4 a worker
    assert shard_count(20_000_000, 2) == 100  # at most EVENTS_PER_SHARD each
    assert shard_count(1000, 0) == 4


def test_deployment_step_function_keeps_only_changes() -> None:
    at = DeploymentAt(np.array([1.0, 3.0]), np.array([[0.5] * 8, [0.25] * 8]))
    assert all(np.isnan(at(0.5)))
    assert at(1.0) == [0.5] * 8 and at(2.9) == [0.5] * 8 and at(3.0) == [0.25] * 8


def test_training_from_files_in_one_process(trace_log: Path, tmp_path: Path) -> None:
    """train_files without a cluster: the serial learner on the files read in batches, the
    same model as training.train on the gathered rows, within the bench's tolerance."""
    gathered = build_dataset([trace_log])
    rows = build_rows_fleet([trace_log], tmp_path, workers=0, shards=6)
    params = {**DEFAULT_PARAMS, "seed": 0}
    from_files = train_files(rows, None, params, num_boost_round=120, early_stopping_rounds=20)
    single = train(gathered, num_boost_round=120, early_stopping_rounds=20)
    assert from_files.data["dask_workers"] == 0
    assert from_files.data["rows_train"] == single.data["rows_train"]
    assert from_files.metrics["rows"] == single.metrics["rows"]
    for key, tolerance in QUALITY_TOLERANCE.items():
        assert abs(from_files.metrics[key] - single.metrics[key]) <= tolerance, key
    assert from_files.metrics["brier"] < from_files.metrics["brier_of_base_rate"]


def test_stopping_iteration_is_early_stoppings_rule() -> None:
    assert stopping_iteration([3.0, 2.0, 1.0], 2) == 3
    # Best at round 2; rounds 3 and 4 do not beat it: stopped there, round 2 kept, though
    # round 6 would have been better.
    assert stopping_iteration([3.0, 1.0, 2.0, 2.0, 2.0, 0.5], 2) == 2


def test_dask_training_matches_the_single_process_model(client: Any, trace_log: Path) -> None:
    rows = build_dataset([trace_log])
    single = train(rows, num_boost_round=120, early_stopping_rounds=20)
    fleet = train_dask(rows, client, num_boost_round=120, early_stopping_rounds=20)
    assert fleet.data["dask_workers"] == 2
    assert fleet.data["rows_train"] == single.data["rows_train"]
    assert fleet.metrics["rows"] == single.metrics["rows"]
    for key, tolerance in QUALITY_TOLERANCE.items():
        assert abs(fleet.metrics[key] - single.metrics[key]) <= tolerance, key
    assert fleet.metrics["brier"] < fleet.metrics["brier_of_base_rate"]
    assert 1 <= fleet.metrics["best_iteration"] <= 120


def test_dask_training_from_the_shards_files(client: Any, trace_log: Path, tmp_path: Path) -> None:
    """The workers read the shards' Parquet rows themselves: the same rows, the same model
    within the tolerance, as from the gathered DataFrame."""
    gathered = build_dataset([trace_log])
    rows = build_rows_fleet([trace_log], tmp_path, client=client, shards=6)
    assert rows.log_names == [trace_log.name] and len(rows.files) == 6
    assert sum(len(pd.read_parquet(f)) for f in rows.files) == len(gathered)
    from_files = train_dask(rows, client, num_boost_round=120, early_stopping_rounds=20)
    from_frame = train_dask(gathered, client, num_boost_round=120, early_stopping_rounds=20)
    assert from_files.data["rows_train"] == from_frame.data["rows_train"]
    assert from_files.metrics["rows"] == from_frame.metrics["rows"]
    for key, tolerance in QUALITY_TOLERANCE.items():
        assert abs(from_files.metrics[key] - from_frame.metrics[key]) <= tolerance, key


def test_train_dask_local_writes_a_model(tmp_path: Path, trace_log: Path) -> None:
    out = tmp_path / "model"
    args = ["train", "--events", str(trace_log), "--out", str(out), "--max-rounds", "60"]
    result = CliRunner().invoke(cli, [*args, "--dask", "local:2", "--json"])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout.strip().splitlines()[-1])
    card = json.loads((out / "card.json").read_text())
    assert card["trained_on"] == "dask local:2" and card["data"]["dask_workers"] == 2
    assert card["metrics_valid"] == metrics and metrics["brier"] < metrics["brier_of_base_rate"]
    import lightgbm as lgb

    booster = lgb.Booster(model_file=str(out / "model.txt"))
    assert booster.num_trees() == metrics["best_iteration"]
    assert np.isfinite(booster.predict(np.zeros((1, booster.num_feature())))).all()


@pytest.mark.parametrize("address", ["local:x", "local:0"])
def test_train_dask_refuses_a_bad_address(tmp_path: Path, tiny_log: Path, address: str) -> None:
    args = ["train", "--events", str(tiny_log), "--out", str(tmp_path / "m"), "--dask", address]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2
    assert "local:N" in result.output or "at least 1" in result.output
    assert not (tmp_path / "m").exists()


def test_train_dask_refuses_tune(tmp_path: Path, tiny_log: Path) -> None:
    args = ["train", "--events", str(tiny_log), "--out", str(tmp_path / "m")]
    result = CliRunner().invoke(cli, [*args, "--dask", "local:2", "--tune", "3"])
    assert result.exit_code == 2 and "--tune" in result.output
