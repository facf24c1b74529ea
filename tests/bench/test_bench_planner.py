"""`kvprefetch bench planner` against real replicas on the real Redis, tiny: the documented JSON,
every figure there and positive, the fed events all applied, the planner caught up, its keys
removed (no timing thresholds)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.bench.conftest import REPO, positive, run_bench

pytestmark = pytest.mark.slow

FEED_EVENTS, BATCH = 2000, 50


def test_bench_planner_measures_the_feed_and_one_replica_against_two(redis_url: str) -> None:
    import redis

    r = run_bench(
        "planner",
        "--replicas",
        "2",
        "--connections",
        "2",
        "--duration-seconds",
        "2",
        "--warmup-seconds",
        "0.5",
        "--sample-seconds",
        "0.5",
        "--feed-events",
        str(FEED_EVENTS),
        "--batch-size",
        str(BATCH),
        "--sessions",
        "200",
        "--instances",
        "2",
        "--hbm-blocks",
        "100",
        "--no-fsync",
        timeout=240,
        env={"KVP_REDIS_URL": redis_url},
    )
    s = r["summary"]
    for key in (
        "one_replica_events_per_second",
        "one_replica_batch_p99_ms",
        "replicas_events_per_second",
        "replicas_batch_p99_ms",
        "feed_apply_events_per_second",
        "feed_apply_ratio_to_own_ingest",
        "planner_feed_load_events_per_second",
        "one_replica_events_per_cpu_second",
        "feed_apply_events_per_cpu_second",
        "feed_apply_cpu_ratio_to_own_ingest",
    ):
        assert positive(s[key]), key
    assert s["planner_lag_events_at_end"] is not None and s["planner_caught_up_seconds"] is not None
    (only,) = r["rounds"]
    one, two = only["one_replica"], only["replicas"]
    assert (one["replicas"], two["replicas"]) == (1, 2)
    for fleet in (one, two):
        assert fleet["errors"] == 0 and positive(fleet["events"]) and positive(fleet["batches"])
        lat = fleet["batch_latency_ms"]
        assert 0 < lat["p50"] <= lat["p99"] <= lat["max"]
        # The fleet's figures are its replicas' together: one of them plans.
        assert [p["planner"] for p in fleet["per_replica"]].count(True) == 1
        total = sum(p["events_per_second"] for p in fleet["per_replica"])
        assert abs(total - fleet["events_per_second"]) <= len(fleet["per_replica"])
        for p in fleet["per_replica"]:
            assert positive(p["cpu_share"]) and positive(p["events_per_cpu_second"])
    assert "feed" not in one and "feed_apply" not in two
    fed = one["feed_apply"]
    # Every event the bench added applied, in the entries it added them in.
    assert (fed["events"], fed["batches"]) == (FEED_EVENTS, FEED_EVENTS // BATCH)
    assert positive(fed["events_per_second"]) and positive(fed["apply_seconds"])
    assert fed["own_ingest_events_per_second"] == one["events_per_second"]
    feed = two["feed"]
    # Caught up: the planner applied every event the other replica accepted, no more.
    assert feed["lag_events_after_catch_up"] == 0 and feed["caught_up_seconds"] is not None
    assert positive(feed["planner_applied_events"]) and positive(feed["planner_applied_batches"])
    assert feed["lag_events_max"] == max(feed["lag_events_sampled"])
    assert r["redis"]["keys_removed"] > 0 and len(r["redis"]["prefixes"]) == 2
    client = redis.Redis.from_url(redis_url)
    try:
        for prefix in r["redis"]["prefixes"]:
            assert not list(client.scan_iter(match=f"{prefix}:*", count=1000))
    finally:
        client.close()
    assert positive(r["machine"]["cpu_count"]) and len(r["load_average"]["before"]) == 3


def test_bench_planner_refuses_fewer_connections_than_replicas() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvprefetch_cli", "bench", "planner", "--connections", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "connections >= replicas" in " ".join(done.stderr.replace("│", " ").split())
