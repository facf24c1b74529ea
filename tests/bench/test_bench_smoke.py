"""The benchmarks run end to end at tiny sizes and print the documented JSON (no timing thresholds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _bench(*args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "app.cli", "bench", *args, "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"stdout must be exactly one JSON object, got:\n{done.stdout}"
    result = json.loads(lines[0])
    assert isinstance(result, dict)
    return result


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def test_bench_ingest_prints_the_documented_json() -> None:
    r = _bench("ingest", "--rounds", "1", "--batches", "3", "--concurrency", "2")
    for key in ("events_per_second", "ceiling_events_per_second", "ratio_to_ceiling"):
        assert set(r[key]) == {"batch_100", "batch_1000"}, key
        assert all(_positive(v) for v in r[key].values()), (key, r[key])
    assert r["rounds"] == 1
    assert r["batches_per_round"] == {"batch_100": 3, "batch_1000": 3}
    assert r["fsync"] is True
    assert isinstance(r["python"], str) and _positive(r["cpu_count"])
    for name in ("service", "ceiling"):
        assert all(len(xs) == 1 and _positive(xs[0]) for xs in r["samples"][name].values())


def test_bench_memory_prints_the_documented_json() -> None:
    r = _bench("memory", "--sessions", "1000")
    assert r["sessions"] == 1000
    assert _positive(r["events"]) and 2 <= r["turns_per_session"] <= 4
    for key in ("bytes_per_session", "rss_bytes_per_session"):
        assert set(r[key]) == {"excluding_event_ids", "including_event_ids"}, key
    per = r["bytes_per_session"]
    assert _positive(per["excluding_event_ids"])
    assert per["including_event_ids"] > per["excluding_event_ids"]
    assert r["remembered_event_ids"] == r["events"]
    assert _positive(r["bytes_per_event_id"]["tracemalloc"])
    assert isinstance(r["within_target"], bool)
    assert isinstance(r["python"], str) and _positive(r["cpu_count"])
