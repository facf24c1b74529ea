"""`kvprefetch bench load` runs against a real service process for a few seconds and prints the
documented JSON: every figure there and positive, no errors (no timing thresholds)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from bench.load.client import _call, _Log, _Pacer
from tests.bench.conftest import REPO, positive, run_bench

pytestmark = pytest.mark.slow

SHORT = (
    "--duration-seconds",
    "5",
    "--warmup-seconds",
    "1",
    "--sample-seconds",
    "1",
    "--sessions",
    "300",
    "--instances",
    "4",
    "--hbm-blocks",
    "200",
    "--batch-size",
    "100",
)


def _run(*args: str, env: dict[str, str]) -> dict[str, Any]:
    """run_bench with an environment of our own (KVP_REDIS_URL, KVP_BENCH_TOKEN)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
    full.update(env)
    done = subprocess.run(
        [sys.executable, "-m", "kvprefetch_cli", "bench", "load", *args, "--json"],
        cwd=REPO,
        env=full,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"stdout must be exactly one JSON object, got:\n{done.stdout}"
    return json.loads(lines[0])


def _no_errors(r: dict[str, Any]) -> None:
    e = r["errors"]
    assert e["total"] == 0 and e["rate_limited_429"] == 0, e
    assert e["first_refusal"] is None, e
    assert e["dropped_after_retries"] == 0 and e["unexpected_duplicates_or_rejects"] == 0, e


def test_bench_load_prints_the_documented_json() -> None:
    r = run_bench(
        "load",
        *SHORT,
        "--ceiling-seconds",
        "1",
        "--calibrate-sessions",
        "1000",
        "--dedupe-max-ids",
        "5000",
        "--session-retention-seconds",
        "2",
        timeout=240,
    )
    t = r["throughput"]
    assert positive(t["seconds"])
    assert all(
        positive(t["event_batches"][k])
        for k in ("requests", "requests_per_second", "events", "events_per_second")
    )
    assert positive(t["route_hints"]["requests"]) and positive(
        t["route_hints"]["requests_per_second"]
    )
    for kind in ("event_batches", "route_hints"):
        lat = r["latency_ms"][kind]
        assert positive(lat["p50"]) and lat["p50"] <= lat["p99"] <= lat["max"], (kind, lat)
    _no_errors(r)

    m = r["memory"]
    assert all(
        positive(m[k])
        for k in ("rss_after_startup_bytes", "rss_start_bytes", "rss_end_bytes", "rss_peak_bytes")
    )
    assert m["rss_end_bytes"] - m["rss_start_bytes"] == m["rss_growth_bytes"]
    assert positive(m["store_stats_end"]["sessions"]) and positive(
        m["store_stats_end"]["remembered_event_ids"]
    )
    # Engines evict: removals are part of the traffic, and a tombstone in force is held.
    assert 0 < m["tombstones_alive"]["end"] <= m["tombstones_held_at_most"]["end"]
    assert positive(m["pull_sink"]["orders_held_by_pull_sink"]["end"]["high"])
    b = m["bound"]
    assert all(
        positive(b["unit_costs"][k])
        for k in (
            "bytes_per_session",
            "bytes_per_event_id",
            "bytes_per_resident_block",
            "bytes_per_tombstone",
            "bytes_per_advised_session",
            "bytes_per_held_order",
            "bytes_per_remembered_order_id",
            "dedupe_ring_peak_bytes",
        )
    )
    counted = {
        "sessions",
        "remembered_event_ids",
        "resident_blocks",
        "tombstones",
        "advised_sessions",
        "orders_held_by_pull_sink",
        "order_ids_remembered_by_pull_sink",
    }
    assert set(b["explained_bytes"]) == set(b["growth"]) == set(b["counts"]) == counted
    assert "outside_bound" not in b
    assert positive(b["growth"]["tombstones"]) and min(b["growth"].values()) >= 0
    assert b["counts"]["sessions"]["high_water"] <= max(
        m["sessions_within_retention"]["end"],
        max(s["sessions_within_retention"] for s in r["series"]),
    )
    assert b["unexplained_growth_bytes"] == m["rss_growth_bytes"] - sum(
        b["explained_bytes"].values()
    )
    assert b["bound_bytes"] == sum(b["explained_bytes"].values()) + b["allowance_bytes"]
    assert b["end_rss_limit_bytes"] == m["rss_start_bytes"] + b["bound_bytes"]
    assert b["within_bound"] == (m["rss_growth_bytes"] <= b["bound_bytes"])
    # A ring of 5,000 ids turns over within a second at these rates (10,000 events/s and more on
    # a busy 2-core machine): priced at its measured peak.
    assert b["dedupe_ring_turned_over"] is True and b["settings"]["dedupe_max_ids"] == 5_000
    assert b["explained_bytes"]["remembered_event_ids"] >= (
        b["unit_costs"]["dedupe_ring_peak_bytes"]
        - b["counts"]["remembered_event_ids"]["start"] * b["unit_costs"]["bytes_per_event_id"]
        - 1
    )

    series = r["series"]
    # Six samples on a quiet machine (t = 0..5 s); a loaded one may take longer over each.
    assert series[0]["t"] == 0 and len(series) >= 3
    assert all(positive(s["rss_bytes"]) and positive(s["sessions"]) for s in series)
    assert all(s["events_per_second"] >= 0 for s in series[1:]) and any(
        positive(s["events_per_second"]) for s in series[1:]
    )
    assert all(s["tombstones_alive"] <= s["tombstones_held_at_most"] for s in series)
    assert all(
        s["rss_bytes"] - series[0]["rss_bytes"] == s["explained_bytes"] + s["unexplained_bytes"]
        for s in series
    )
    assert series[-1]["unexplained_bytes"] == b["unexplained_growth_bytes"]

    c = r["ceiling"]
    assert len(c["phases"]) == 2
    assert all(positive(p["event_batches"]["events_per_second"]) for p in c["phases"])
    assert all(positive(p["route_hints"]["requests_per_second"]) for p in c["phases"])
    assert all(p["errors"]["total"] == 0 for p in c["phases"])
    assert positive(c["ratio_to_ceiling"]["events_per_second"])
    assert positive(c["ratio_to_ceiling"]["route_hints_per_second"])

    # A 2 s retention: the store forgets most of the conversations the run went through.
    assert m["store_stats_end"]["sessions"] < 0.8 * r["traffic"]["sessions_started"]

    tr = r["traffic"]["events_by_type"]
    for kind in (
        "request_routed",
        "request_started",
        "request_finished",
        "kv_blocks_stored",
        "kv_blocks_removed",
        "session_closed",
        "instance_status",
    ):
        assert positive(tr[kind]), kind
    assert r["service_end"]["readyz"]["status"] == "ready"
    assert positive(
        r["service_end"]["metrics"]['kvprefetch_events_ingested_total{type="request_routed"}']
    )
    cfg = r["config"]
    assert (cfg["duration_seconds"], cfg["store"], cfg["fsync"], cfg["token"]) == (
        5.0,
        "memory",
        True,
        None,
    )
    assert cfg["service_env"]["KVP_LOG_FSYNC"] == "true"
    assert (
        cfg["session_retention_seconds"],
        cfg["reorder_window_seconds"],
        cfg["dedupe_max_ids"],
    ) == (2.0, 60.0, 5_000)
    assert cfg["service_env"]["KVP_SESSION_RETENTION_SECONDS"] == "2"
    assert positive(r["environment"]["cpu_count"]) and isinstance(r["environment"]["python"], str)


def test_event_ids_are_priced_by_the_ring_alone_in_one_process() -> None:
    """The unit is one process's RSS step (two processes' difference read 0 on a loaded
    machine), and no less than the id strings the ring keeps; with Redis it is not measured."""
    from bench._util import child_env
    from bench.load.calibrate import MIN_IDS, modes

    assert {"ids", "ring"} <= set(modes("memory"))
    assert not {"ids", "ring"} & set(modes("redis"))
    done = subprocess.run(
        [sys.executable, "-m", "bench.load.calibrate", "--mode", "ids", "--sessions", "1"],
        cwd=REPO,
        env=child_env({}),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout)
    assert r["growth"] == {"remembered_event_ids": MIN_IDS, "ids_applied": MIN_IDS}
    # Every id the ring remembers is a str of its own, as the run's are (traffic.py).
    id_like_the_runs = f"{'0' * 23}-{0:012x}"
    assert r["bytes"] >= MIN_IDS * sys.getsizeof(id_like_the_runs)


def test_the_client_counts_what_the_store_may_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tombstones and sessions the bound allows, worked out from the events sent, against a
    MemoryStore fed the same events: tombstones in force exactly, held ones and sessions at most."""
    from app.state.memory import MemoryStore
    from bench.load import traffic
    from kvprefetch_client.events import batch_adapter

    clock = itertools.count()
    monkeypatch.setattr(traffic.time, "time", lambda: 1_700_000_000 + next(clock) * 0.001)
    window, retention = 2.0, 3.0
    shard = traffic.Shard(
        seed=1,
        sessions=50,
        instance_ids=["a", "b", "c"],
        hbm_blocks=40,
        reorder_window=window,
        session_retention=retention,
    )
    store = MemoryStore(
        bytes_per_token=1,
        block_tokens=512,
        reorder_window_seconds=window,
        session_retention_seconds=retention,
    )
    for _ in range(60):  # ~30 s of event time: windows and retentions go by
        for _ in range(100):
            shard.step()
        store.apply(batch_adapter.validate_python({"events": shard.take()}).events)
        alive = held = 0
        for inst in shard.instances:
            loc = store._locations[("hbm", inst)]
            ts = [*loc.removed.values(), *loc.removed_old.values()]
            alive += sum(t >= loc.newest - window for t in ts)
            held += len(ts)
        assert shard.tombstones_alive == alive
        assert alive <= held <= shard.tombstones_held_at_most
        assert store.stats()["sessions"] <= shard.sessions_within_retention
    assert 0 < store.stats()["sessions"] < shard.sessions_started / 2
    assert (
        shard.tombstones_held_at_most < shard.events["kv_blocks_removed"]
    )  # not every removal ever


def test_bench_load_against_redis_removes_its_keys(redis_url: str) -> None:
    import redis

    r = _run(
        *SHORT,
        "--store",
        "redis",
        "--ceiling-seconds",
        "0",
        "--calibrate-sessions",
        "0",
        env={"KVP_REDIS_URL": redis_url},
    )
    _no_errors(r)
    assert positive(r["throughput"]["event_batches"]["events_per_second"])
    assert positive(r["throughput"]["route_hints"]["requests_per_second"])
    assert positive(r["memory"]["store_stats_end"]["sessions"])
    assert "bound" not in r["memory"] and r["ceiling"]["phases"] == []
    prefix = r["redis"]["prefix"]
    assert prefix.startswith("kvp-bench-load-") and positive(r["redis"]["keys_removed"])
    client = redis.Redis.from_url(redis_url)
    try:
        assert list(client.scan_iter(match=f"{prefix}:*", count=1000)) == []
    finally:
        client.close()


def test_bench_load_sends_its_token_and_counts_refusals() -> None:
    quick = (
        *SHORT,
        "--duration-seconds",
        "2",
        "--ceiling-seconds",
        "0",
        "--calibrate-sessions",
        "0",
        "--service-env",
        "KVP_INGEST_TOKEN=bench-load-secret-0123456789",
    )
    r = _run(*quick, env={"KVP_BENCH_TOKEN": "bench-load-secret-0123456789"})
    _no_errors(r)
    assert r["config"]["token"] == "set" and r["config"]["service_env"]["KVP_INGEST_TOKEN"] == "set"
    assert positive(r["throughput"]["event_batches"]["events_per_second"])

    # Refused batches are counted by status, not retried; no session is acknowledged, so no hint
    # is asked.
    refused = _run(*quick, "--token", "wrong", env={})
    by_kind = refused["errors"]["by_kind"]
    assert refused["errors"]["total"] > 0 and refused["errors"]["dropped_after_retries"] > 0
    assert set(by_kind["event_batches"]) <= {"401", "403"} and by_kind["event_batches"], by_kind
    assert refused["throughput"]["event_batches"]["events"] == 0


def test_an_open_loop_pacer_keeps_its_schedule_and_never_runs_ahead() -> None:
    stop = threading.Event()
    assert _Pacer(None, stop).next() is None  # closed-loop: no schedule
    pacer = _Pacer(0.02, stop)
    starts = [pacer.next() for _ in range(3)]
    assert all(s is not None for s in starts)
    first, second, third = (s for s in starts if s is not None)
    # Each start one interval after the last, and never before it is due.
    assert second - first == pytest.approx(0.02) and third - second == pytest.approx(0.02)
    assert time.perf_counter() >= third
    # Behind schedule (a slow answer): the next start is the one that was due, at once.
    time.sleep(0.1)
    assert pacer.next() == pytest.approx(third + 0.02)
    stop.set()
    assert _Pacer(60.0, stop).next() is not None  # the first start is now
    late = _Pacer(60.0, stop)
    late.next()
    assert late.next() is None  # stopped while waiting


def test_an_open_loop_call_counts_its_latency_from_its_scheduled_start() -> None:
    class Client:
        def post(self, url: str, content: bytes, headers: dict[str, str]) -> Any:
            return SimpleNamespace(status_code=200, content=b"ok", headers={})

    log = _Log()
    scheduled = time.perf_counter() - 0.5  # due half a second ago: the server fell behind
    assert _call(
        Client(), "http://x", b"{}", {}, log, threading.Event(), lambda r, a: True, scheduled
    )
    assert _call(Client(), "http://x", b"{}", {}, log, threading.Event(), lambda r, a: True)
    assert log.latencies[0] >= 0.5 and log.latencies[1] < 0.5


def test_bench_load_open_loop_offers_no_more_than_its_rates() -> None:
    rate, hints, seconds, warmup = 2000.0, 20.0, 3.0, 1.0
    r = run_bench(
        "load",
        *SHORT,
        "--duration-seconds",
        str(seconds),
        "--warmup-seconds",
        str(warmup),
        "--ceiling-seconds",
        "0",
        "--calibrate-sessions",
        "0",
        "--events-per-second",
        str(rate),
        "--hints-per-second",
        str(hints),
        timeout=240,
    )
    _no_errors(r)
    assert r["config"]["mode"].startswith("open-loop: 2000 events/s offered, 20 hints/s")
    assert (r["config"]["events_per_second_offered"], r["config"]["hints_per_second_offered"]) == (
        rate,
        hints,
    )
    # The schedule started with the warm-up: what was answered in the measured window cannot be
    # more than was due by its end (each connection's first call is due at once; a second more
    # for the client's own start). Closed-loop, the service takes several times the rate.
    t = r["throughput"]
    due_seconds = warmup + t["seconds"] + 1.0
    connections, batch = 2, 100
    assert 0 < t["event_batches"]["events"] <= rate * due_seconds + connections * batch
    assert 0 < t["route_hints"]["requests"] <= hints * due_seconds + 2
