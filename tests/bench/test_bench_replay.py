"""`kvprefetch bench replay` runs end to end on a small trace and prints the documented JSON
(no timing thresholds)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvprefetch_cli import cli
from tests.bench.conftest import positive, run_bench
from tests.conftest import trace_slice

POLICY_KEYS = {
    "requests",
    "simulated_seconds",
    "byte_hit_rate",
    "trace_load_seconds",
    "wall_seconds",
    "wall_seconds_rounds",
    "requests_per_second",
    "peak_rss_bytes",
    "baseline_rss_bytes",
    "tracemalloc_peak_bytes",
}


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    return trace_slice(tmp_path, "conversation_first60", 300)


def _bench_replay(*args: str) -> dict[str, Any]:
    return run_bench("replay", *args, timeout=240)


@pytest.mark.slow
def test_bench_replay_prints_the_documented_json(small_trace: Path) -> None:
    r = _bench_replay("--trace", str(small_trace), "--policy", "belady", "--rounds", "2")
    assert r["trace"] == "conversation300.jsonl" and r["trace_path"] == str(small_trace.resolve())
    assert (r["requests"], r["router"], r["scenario"], r["rounds"]) == (300, "sticky", "default", 2)
    assert list(r["policies"]) == ["belady"] and r["slowest_policy"] == "belady"
    p = r["policies"]["belady"]
    assert set(p) == POLICY_KEYS
    assert p["requests"] == 300
    assert len(p["wall_seconds_rounds"]) == 2 and all(positive(w) for w in p["wall_seconds_rounds"])
    for key in POLICY_KEYS - {"wall_seconds_rounds", "byte_hit_rate"}:
        assert positive(p[key]), (key, p[key])
    assert 0.0 <= p["byte_hit_rate"] <= 1.0
    assert p["peak_rss_bytes"] >= p["baseline_rss_bytes"]
    assert positive(r["slowest_seconds_with_load"]) and r["target_seconds"] == 60.0
    assert isinstance(r["within_target"], bool)
    assert isinstance(r["python"], str) and positive(r["cpu_count"])


@pytest.mark.slow
def test_bench_replay_all_runs_every_policy_but_the_models(small_trace: Path) -> None:
    r = _bench_replay("--trace", str(small_trace), "--policy", "all", "--rounds", "1")
    assert list(r["policies"]) == [
        "none",
        "lookahead",
        "belady",
        "oracle",
        "heuristic",
        "clairvoyant",
    ]
    assert all(
        positive(p["wall_seconds"]) and positive(p["requests_per_second"])
        for p in r["policies"].values()
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace", "/nonexistent/trace.jsonl"], "no trace at /nonexistent/trace.jsonl"),
        (["--policy", "nope"], "unknown policy 'nope'"),
        (["--router", "nope"], "unknown router 'nope'"),
    ],
)
def test_bench_replay_refuses_bad_arguments_before_running(
    small_trace: Path, args: list[str], message: str
) -> None:
    trace = [] if "--trace" in args else ["--trace", str(small_trace)]
    result = CliRunner().invoke(cli, ["bench", "replay", *trace, *args])
    assert result.exit_code == 2
    assert message in " ".join(result.stderr.split())
