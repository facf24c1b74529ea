"""The benchmarks run end to end at tiny sizes and print the documented JSON (no timing
thresholds)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.bench.conftest import REPO, positive, run_bench
from tests.ports import dead_port

pytestmark = pytest.mark.slow


def test_bench_ingest_prints_the_documented_json() -> None:
    r = run_bench("ingest", "--rounds", "1", "--batches", "3", "--concurrency", "2")
    for key in ("events_per_second", "ceiling_events_per_second", "ratio_to_ceiling"):
        assert set(r[key]) == {"batch_100", "batch_1000"}, key
        assert all(positive(v) for v in r[key].values()), (key, r[key])
    assert r["rounds"] == 1
    assert r["batches_per_round"] == {"batch_100": 3, "batch_1000": 3}
    assert r["fsync"] is True
    assert r["store"] == "memory" and r["redis"] is None
    assert isinstance(r["python"], str) and positive(r["cpu_count"])
    for name in ("service", "ceiling"):
        assert all(len(xs) == 1 and positive(xs[0]) for xs in r["samples"][name].values())


def test_bench_ingest_against_redis_removes_its_keys(redis_url: str) -> None:
    import redis

    r = run_bench(
        "ingest",
        *("--rounds", "1", "--batches", "2", "--concurrency", "2", "--store", "redis"),
        env={"KVP_REDIS_URL": redis_url},
    )
    assert r["store"] == "redis"
    assert all(positive(v) for v in r["events_per_second"].values())
    prefix = r["redis"]["prefix"]
    assert prefix.startswith("kvp-bench-ingest-") and positive(r["redis"]["keys_removed"])
    client = redis.Redis.from_url(redis_url)
    try:
        assert list(client.scan_iter(match=f"{prefix}:*", count=1000)) == []
    finally:
        client.close()


@pytest.mark.parametrize("bench", ["ingest", "load"])
def test_a_redis_bench_without_redis_says_so(bench: str) -> None:
    with dead_port() as port:
        done = subprocess.run(
            [sys.executable, "-m", "kvprefetch_cli", "bench", bench, "--store", "redis", "--json"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "KVP_REDIS_URL": f"redis://:secret@127.0.0.1:{port}/0"},
        )
    assert done.returncode == 1 and done.stdout == ""
    assert f"--store redis: no Redis answers at redis://***@127.0.0.1:{port}/0" in done.stderr
    assert "secret" not in done.stderr


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
