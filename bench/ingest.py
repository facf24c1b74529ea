"""Ingest throughput: events/s through POST /v1/events over real HTTP, against the framework's
ceiling.

Two servers, each one uvicorn worker in its own process (bench/_server.py):
- service: the real app (create_app with the memory store, or `store="redis"` the Redis at
  KVP_REDIS_URL under a unique prefix removed afterwards; the event log in a temp dir, fsync at
  its default), as `kvprefetch serve` runs it;
- ceiling: bench/ceiling_app.py, which only reads the body and parses it into the same models.

The load comes from this process: `concurrency` threads, each with its own keep-alive
httpx.Client, posting bodies serialised before the clock starts. Each round sends the same
number of batches to both servers, batch size by batch size, alternating which goes first, so
that the machine's noise hits both; the figures are medians over rounds. Every event id is unique
over the whole run, so the service accepts every event (checked on every answer).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._util import (
    BenchError,
    Server,
    Traffic,
    check_redis,
    info,
    machine,
    median,
    redact_url,
)

BATCH_SIZES = (100, 1000)
DEFAULT_EVENTS_PER_ROUND = 100_000
HEADERS = {"content-type": "application/json"}


@dataclass
class _Target:
    name: str
    server: Server
    check: bytes | None  # what every answer's body must contain
    clients: list[Any] = field(default_factory=list)


def post_all(clients: list[Any], url: str, bodies: list[bytes], check: bytes | None) -> float:
    """Posts every body to url, one client (connection) per thread; returns the wall time.

    Raises BenchError on the first answer that is not a 200 containing `check`.
    """
    counter = itertools.count()
    n = len(bodies)
    errors: list[str] = []
    start = threading.Barrier(len(clients) + 1)

    def worker(client: Any) -> None:
        start.wait()
        try:
            while (i := next(counter)) < n:
                r = client.post(url, content=bodies[i], headers=HEADERS)
                if r.status_code != 200 or (check is not None and check not in r.content):
                    errors.append(f"HTTP {r.status_code}: {r.content[:300]!r}")
                    return
        except Exception as exc:  # reported below, the run is void
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(c,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise BenchError(errors[0])
    return elapsed


def _post_all(target: _Target, bodies: list[bytes]) -> float:
    try:
        return post_all(target.clients, target.server.url + "/v1/events", bodies, target.check)
    except BenchError as exc:
        raise BenchError(
            f"{target.name}: {exc}\n--- {target.name} server log ---\n{target.server.log_tail()}"
        ) from None


def new_clients(n: int) -> list[Any]:
    import httpx

    return [httpx.Client(timeout=60.0, limits=httpx.Limits(max_connections=1)) for _ in range(n)]


def run(
    *,
    rounds: int = 5,
    batches: int | None = None,
    concurrency: int = 3,
    fsync: bool = True,
    data_dir: Path | None = None,
    seed: int = 0,
    store: str = "memory",
) -> dict[str, Any]:
    if rounds < 1 or concurrency < 1 or (batches is not None and batches < 1):
        raise ValueError("rounds, batches and concurrency must be at least 1")
    if store not in ("memory", "redis"):
        raise ValueError("store must be memory or redis")
    redis_url = os.environ.get("KVP_REDIS_URL", "redis://127.0.0.1:6379/0")
    prefix = f"kvp-bench-ingest-{uuid.uuid4().hex[:12]}"
    if store == "redis":
        check_redis(redis_url)
    n_batches = {size: batches or max(1, DEFAULT_EVENTS_PER_ROUND // size) for size in BATCH_SIZES}

    info(
        f"bench ingest: {rounds} rounds, batches per round: "
        f"{', '.join(f'{n} x {s}' for s, n in n_batches.items())}"
    )
    traffic = Traffic(seed=seed)
    warmup = {size: traffic.batches(max(2, concurrency * 2), size) for size in BATCH_SIZES}

    workdir = Path(tempfile.mkdtemp(prefix="kvp-bench-ingest-", dir=data_dir))
    info(f"bench ingest: servers in {workdir} (event log fsync={'on' if fsync else 'off'})")
    service_env = {
        "KVP_STORE": store,
        "KVP_DATA_DIR": str(workdir / "data"),
        "KVP_LOG_FSYNC": "true" if fsync else "false",
        "KVP_REPLICA_ID": "bench",
    }
    if store == "redis":
        service_env.update({"KVP_REDIS_URL": redis_url, "KVP_REDIS_PREFIX": prefix})
        info(f"bench ingest: the service's store is the Redis at {redact_url(redis_url)}")
    keys_removed = None
    samples: dict[str, dict[int, list[float]]] = {
        n: {s: [] for s in BATCH_SIZES} for n in ("service", "ceiling")
    }
    started: list[_Target] = []
    try:
        started.append(
            _Target(
                "service",
                Server("service", workdir=workdir, env=service_env),
                check=b'"duplicates":[],"rejected":[]',
            )
        )
        started.append(_Target("ceiling", Server("ceiling", workdir=workdir), check=None))
        targets = tuple(started)
        for t in targets:
            t.server.wait_ready()
            t.clients = new_clients(concurrency)
        for size in BATCH_SIZES:  # warm up: connections open, code paths hot
            for t in targets:
                _post_all(t, warmup[size])
        for r in range(rounds):
            for size in BATCH_SIZES:
                # Serialised before the clock starts; one set per round keeps memory flat, and
                # the service and the ceiling get the very same bytes.
                round_bodies = traffic.batches(n_batches[size], size)
                order = targets if r % 2 == 0 else targets[::-1]
                line = []
                for t in order:
                    elapsed = _post_all(t, round_bodies)
                    rate = len(round_bodies) * size / elapsed
                    samples[t.name][size].append(rate)
                    line.append(f"{t.name} {rate:,.0f}")
                info(f"  round {r + 1}/{rounds} batch {size}: " + ", ".join(line) + " events/s")
    finally:
        for t in started:
            for c in t.clients:
                c.close()
            t.server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        if store == "redis":
            from bench.load.probes import redis_clean

            keys_removed = redis_clean(redis_url, prefix)

    def medians(name: str) -> dict[str, float]:
        return {f"batch_{s}": round(median(samples[name][s]), 1) for s in BATCH_SIZES}

    eps, ceil = medians("service"), medians("ceiling")
    return {
        "events_per_second": eps,
        "ceiling_events_per_second": ceil,
        "ratio_to_ceiling": {k: round(eps[k] / ceil[k], 3) for k in eps},
        "store": store,
        "redis": None if store != "redis" else {"prefix": prefix, "keys_removed": keys_removed},
        "rounds": rounds,
        "batches_per_round": {f"batch_{s}": n for s, n in n_batches.items()},
        "concurrency": concurrency,
        "fsync": fsync,
        "samples": {
            name: {f"batch_{s}": [round(x, 1) for x in xs] for s, xs in per.items()}
            for name, per in samples.items()
        },
        **machine(),
    }
