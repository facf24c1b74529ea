"""The benchmarks run end to end at tiny sizes and print the documented JSON (no timing
thresholds)."""

from __future__ import annotations

import pytest

from tests.bench.conftest import positive, run_bench

pytestmark = pytest.mark.slow


def test_bench_ingest_prints_the_documented_json() -> None:
    r = run_bench("ingest", "--rounds", "1", "--batches", "3", "--concurrency", "2")
    for key in ("events_per_second", "ceiling_events_per_second", "ratio_to_ceiling"):
        assert set(r[key]) == {"batch_100", "batch_1000"}, key
        assert all(positive(v) for v in r[key].values()), (key, r[key])
    assert r["rounds"] == 1
    assert r["batches_per_round"] == {"batch_100": 3, "batch_1000": 3}
    assert r["fsync"] is True
    assert isinstance(r["python"], str) and positive(r["cpu_count"])
    for name in ("service", "ceiling"):
        assert all(len(xs) == 1 and positive(xs[0]) for xs in r["samples"][name].values())


def test_bench_memory_prints_the_documented_json() -> None:
    r = run_bench("memory", "--sessions", "1000")
    assert r["sessions"] == 1000
    assert positive(r["events"]) and 2 <= r["turns_per_session"] <= 4
    for key in ("bytes_per_session", "rss_bytes_per_session"):
        assert set(r[key]) == {"excluding_event_ids", "including_event_ids"}, key
    per = r["bytes_per_session"]
    assert positive(per["excluding_event_ids"])
    assert per["including_event_ids"] > per["excluding_event_ids"]
    assert r["remembered_event_ids"] == r["events"]
    assert positive(r["bytes_per_event_id"]["tracemalloc"])
    assert isinstance(r["within_target"], bool)
    assert isinstance(r["python"], str) and positive(r["cpu_count"])
