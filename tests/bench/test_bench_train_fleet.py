"""`kvprefetch bench train-fleet` at a tiny size: a fleet log of copied traces, the single path
beside a 2-worker LocalCluster, the old replay's rows against the columnar build's, the
documented JSON (no timing thresholds)."""

from __future__ import annotations

import pytest

from tests.bench.conftest import positive, run_bench

pytestmark = pytest.mark.slow


def test_bench_train_fleet_prints_the_documented_json() -> None:
    r = run_bench(
        "train-fleet",
        "--events",
        "30000",
        "--trace-requests",
        "400",
        "--max-rounds",
        "30",
        timeout=300,
    )
    assert r["events"] == 30000 and positive(r["log_bytes"]) and r["workers"] == 2
    assert positive(r["log_peak_rss_bytes"])
    for engine in ("polars", "duckdb"):
        assert r["engines"][engine]["events"] == 30000 and positive(r["engines"][engine]["seconds"])
    assert r["single"]["rows"] == r["dask"]["rows"] > 0
    ref = r["reference"]
    assert ref["events"] == 30000 and ref["rows"] == r["single"]["rows"]
    assert ref["rows_equal"] is True
    assert positive(ref["replay_seconds"]) and positive(ref["columnar_seconds"])
    for path in ("single", "dask"):
        p = r[path]
        for key in ("build_seconds", "train_seconds", "peak_rss_bytes"):
            assert positive(p[key]), (path, key)
        # The stages that last longer than a sample: the replay and the training.
        assert {"replay", "fit"} <= set(p["stages"]), (path, p["stages"])
        for stage in p["stages"].values():
            assert 0 < stage["peak_rss_bytes"] <= p["peak_rss_bytes"]
            assert 0 <= stage["cpu_seconds"] <= p["cpu_seconds"]
        # The learner's work is counted, its workers' included.
        assert p["stages"]["fit"]["cpu_seconds"] > 0
        assert 1 <= p["best_iteration"] <= 30
        assert 0.0 <= p["valid"]["brier"] <= 1.0 and p["valid"]["rows"] > 0
    q = r["quality"]
    assert set(q["difference"]) == set(q["tolerance"]) == {"brier", "log_loss"}
    assert q["equal_within_tolerance"] == all(
        q["difference"][k] <= q["tolerance"][k] for k in q["tolerance"]
    )


def test_bench_train_fleet_single_only_runs_the_single_path_alone() -> None:
    r = run_bench(
        "train-fleet",
        "--events",
        "30000",
        "--trace-requests",
        "400",
        "--max-rounds",
        "30",
        "--reference-events",
        "0",
        "--single-only",
        timeout=300,
    )
    assert "dask" not in r and r["reference"] is None
    assert r["single"]["rows"] > 0 and {"replay", "fit"} <= set(r["single"]["stages"])
    # Nothing to compare the model with.
    assert "difference" not in r["quality"] and "equal_within_tolerance" not in r["quality"]


def test_bench_train_fleet_refuses_both_only_options() -> None:
    from typer.testing import CliRunner

    from kvprefetch_cli import cli

    result = CliRunner().invoke(
        cli, ["bench", "train-fleet", "--events", "30000", "--dask-only", "--single-only"]
    )
    assert result.exit_code == 2
    assert "no path to run" in " ".join(result.stderr.split())
