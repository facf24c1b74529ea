"""`kvprefetch bench redis-io` on the real Redis at a tiny size: the documented JSON, every event
of every path applied, its keys removed; a clear error without Redis (no timing thresholds)."""

from __future__ import annotations

import subprocess
import sys
from urllib.parse import urlsplit

import pytest

from tests.bench.conftest import REPO, positive, run_bench
from tests.ports import dead_port

pytestmark = pytest.mark.slow

OPS = {"ingest_100", "ingest_1000", "judge_1000", "live_sessions_256"}
PATHS = {"store_thread", "asyncio", "asyncio_c_pack", "inline"}


def test_bench_redis_io_measures_each_call_each_way_and_applies_every_event(
    redis_url: str,
) -> None:
    import redis

    parts = urlsplit(redis_url)
    db = int(parts.path.strip("/") or 0)
    r = run_bench(
        "redis-io",
        "--redis-url",
        f"{parts.scheme}://{parts.netloc}",
        "--db",
        str(db),
        "--rounds",
        "1",
        "--events",
        "1000",
        "--reads",
        "2",
        "--callers",
        "3",
    )
    assert (r["rounds"], r["callers"], r["read_callers"], r["reads_per_segment"]) == (1, 3, 1, 2)
    # Each way posts, per round and per batch size, `--events` events (one uncounted round of
    # two batches at most first): every one applied once, each found applied at the end.
    per_way = (2 * 100 + 1 * 1000) + (10 * 100 + 1 * 1000)
    assert r["events_applied"] == len(PATHS) * per_way
    assert set(r["ops"]) == OPS
    for op, per in r["ops"].items():
        assert set(per) == PATHS, op
        for path, row in per.items():
            assert positive(row["calls_per_second"]) and positive(row["ms_per_call"]), (op, path)
            lag = row["loop_lag_ms"]
            assert positive(lag["ticks"]) and lag["median"] <= lag["p99"] <= lag["max"], (op, path)
            if op.startswith("ingest_"):
                assert row["events"] == 1000 and positive(row["events_per_second"]), (op, path)
                assert row["calls"] == 1000 // int(op.rsplit("_", 1)[1])
            else:
                assert row["calls"] == 2 and "events" not in row
            if path != "store_thread":
                assert positive(row["speed_vs_store_thread"]), (op, path)
    assert r["loop"] in {"uvloop", "asyncio"} and r["tick_ms"] == 1.0
    assert r["redis"]["url"] == f"{parts.scheme}://{parts.netloc}/{db}"
    prefix = r["redis"]["prefix"]
    assert prefix.startswith("kvp-bench-redis-io-") and positive(r["redis"]["keys_removed"])
    client = redis.Redis.from_url(redis_url)
    try:
        assert not list(client.scan_iter(match=f"{prefix}:*", count=1000))
    finally:
        client.close()
    assert len(r["load_average"]["before"]) == 3 and positive(r["machine"]["cpu_count"])


def test_bench_redis_io_says_so_when_redis_does_not_answer() -> None:
    with dead_port() as port:
        nobody = f"redis://127.0.0.1:{port}"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvprefetch_cli",
                "bench",
                "redis-io",
                "--redis-url",
                nobody,
                "--json",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 1 and done.stdout == ""
    assert f"Redis did not answer at {nobody}/0" in done.stderr, done.stderr
