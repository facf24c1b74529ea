"""`run()`: the rounds of `kvprefetch bench planner` (the package's docstring says what each
measures)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench._util import check_redis, info, machine, redact_url
from bench.load.client import Load, window
from bench.load.processes import BenchError, Proc, cpu_seconds, load_average
from bench.load.traffic import Shard, make_shards
from bench.planner.options import PlannerOptions

POLL_SECONDS = 0.1
FEED_WRITER = "bench-planner-feed"  # the replica id the pre-filled entries name


def run(options: PlannerOptions) -> dict[str, Any]:
    """The rounds, then their medians: the JSON. ValueError for options that cannot make a run;
    BenchError when Redis does not answer or a replica fails."""
    options.validate()
    started = time.monotonic()
    redis_url = os.environ.get("KVP_REDIS_URL", "redis://127.0.0.1:6379/0")
    check_redis(redis_url)
    load_before = _load_averages()
    workdir = Path(tempfile.mkdtemp(prefix="kvp-bench-planner-", dir=options.data_dir))
    rounds: list[dict[str, Any]] = []
    keys_removed = 0
    prefixes: list[str] = []
    try:
        for r in range(options.rounds):
            seed = options.seed * 1000 + r
            info(f"bench planner: round {r + 1}/{options.rounds}")
            prefix = f"kvp-bench-planner-{uuid.uuid4().hex[:12]}"
            prefixes.append(prefix)
            try:
                one = _fleet(options, 1, redis_url, prefix, workdir / f"r{r}-one", seed, feed=True)
            finally:
                keys_removed += _redis_clean(redis_url, prefix)
            prefix = f"kvp-bench-planner-{uuid.uuid4().hex[:12]}"
            prefixes.append(prefix)
            try:
                many = _fleet(
                    options, options.replicas, redis_url, prefix, workdir / f"r{r}-many", seed
                )
            finally:
                keys_removed += _redis_clean(redis_url, prefix)
            rounds.append({"one_replica": one, "replicas": many})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    redis = {"url": redact_url(redis_url), "prefixes": prefixes, "keys_removed": keys_removed}
    return _result(options, rounds, redis, load_before, started)


def _fleet(
    options: PlannerOptions,
    n: int,
    redis_url: str,
    prefix: str,
    workdir: Path,
    seed: int,
    *,
    feed: bool = False,
) -> dict[str, Any]:
    """`n` replicas on one Redis under the routers' closed-loop load; with `feed`, then the
    pre-filled feed applied by the (one) replica."""
    workdir.mkdir(parents=True)
    procs: list[Proc] = []
    loads: list[Load] = []
    try:
        for i in range(n):
            env = options.env(redis_url, prefix, f"bench-planner-{i}", workdir / f"data-{i}")
            procs.append(
                Proc(f"replica-{i}", ["-m", "kvprefetch_cli", "serve"], workdir=workdir, env=env)
            )
        for p in procs:
            p.wait_ready("/readyz")
        planner = _one_planner(procs)
        info(
            f"  {n} replica(s) ready, replica-{planner} plans; warm-up {options.warmup_seconds:g} s"
        )
        from bench.load.report import service_settings

        settings = service_settings(options.env(redis_url, prefix, "x", workdir))
        shards = make_shards(
            connections=options.connections,
            sessions=options.sessions,
            instances=options.instances,
            hbm_blocks=options.hbm_blocks,
            seed=seed,
            reorder_window=settings["reorder_window_seconds"],
            session_retention=settings["session_retention_seconds"],
        )
        loads = [
            Load(
                p.url,
                [sh for j, sh in enumerate(shards) if j % n == i],
                hint_connections=0,
                batch_size=options.batch_size,
                token=None,
                seed=seed,
            )
            for i, p in enumerate(procs)
        ]
        for load in loads:
            load.start()
        time.sleep(options.warmup_seconds)
        result = _measure(options, procs, loads, planner)
        if feed:
            result["feed_apply"] = _feed_apply(
                options, procs[0], redis_url, prefix, seed, result["events_per_second"]
            )
        return result
    finally:
        for load in loads:
            load.finish()
        for p in procs:
            p.stop()


def _one_planner(procs: Sequence[Proc], timeout_seconds: float = 30.0) -> int:
    """The index of the replica holding the lease, once exactly one does."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        leaders = [i for i, p in enumerate(procs) if _scrape(p)["leader"] == 1]
        if len(leaders) == 1:
            return leaders[0]
        if time.monotonic() > deadline:
            raise BenchError(f"{len(leaders)} replicas plan, not one, {timeout_seconds:g} s on")
        time.sleep(0.1)


def _measure(
    options: PlannerOptions, procs: Sequence[Proc], loads: Sequence[Load], planner: int
) -> dict[str, Any]:
    """The measured window, then the load's stop and the planner's catch-up."""
    n = len(procs)

    def lag() -> tuple[int, float, list[dict[str, float]]]:
        # The planner read first: the others' counts, read after it, are no older than what it
        # had applied (a replica counts a batch as ingested just after publishing it, so a lag
        # may still read a batch low).
        first = _scrape(procs[planner])
        scraped = [first if i == planner else _scrape(p) for i, p in enumerate(procs)]
        others = sum(s["ingested"] for i, s in enumerate(scraped) if i != planner)
        return int(others - first["applied_events"]), others, scraped

    cpu0 = [cpu_seconds(p.proc.pid) for p in procs]
    client0 = time.process_time()
    t0 = time.perf_counter()
    _, others0, _ = lag()
    lags: list[tuple[int, float]] = []
    end = t0 + options.duration_seconds
    while (now := time.perf_counter()) < end or (n > 1 and not lags):
        time.sleep(max(0.0, min(options.sample_seconds, end - now)))
        for p in procs:
            if p.proc.poll() is not None:
                raise BenchError(f"{p.name} exited under load:\n{p.log_tail()}")
        if n > 1:
            lags.append(lag()[:2])
    t1 = time.perf_counter()
    cpu1 = [cpu_seconds(p.proc.pid) for p in procs]
    client_cpu = time.process_time() - client0
    seconds = t1 - t0
    logs = {k: [log for load in loads for log in load.logs[k]] for k in ("event_batches",)}
    fleet = window(logs, t0, t1)["event_batches"]
    per_replica = []
    for i, load in enumerate(loads):
        w = load.window(t0, t1)["event_batches"]
        per_replica.append(
            {
                "planner": i == planner,
                "events_per_second": w["events_per_second"],
                "batch_latency_ms": w["latency_ms"],
                "cpu_share": round((cpu1[i] - cpu0[i]) / seconds, 3),
                # Per second of the replica's CPU, all its work included: what a core would give
                # on a machine where it had one (this one is shared).
                "events_per_cpu_second": _per(w["events"], cpu1[i] - cpu0[i]),
            }
        )
    errors = sum(load.errors()["total"] for load in loads)
    for load in loads:
        load.finish()
    out: dict[str, Any] = {
        "replicas": n,
        "seconds": round(seconds, 2),
        "events": fleet["events"],
        "events_per_second": fleet["events_per_second"],
        "batches": fleet["requests"],
        "batch_latency_ms": fleet["latency_ms"],
        "per_replica": per_replica,
        "client_cpu_share": round(client_cpu / seconds, 3),
        "errors": errors,
        "load_average_1m": load_average(),
    }
    if n > 1:
        # The lag as the load ended (the last sample's), then how long the planner took to
        # reach zero once the routers stopped (their last batches answered).
        at_end, others = lags[-1]
        stopped_at = time.perf_counter()
        behind, _, scraped = lag()
        while behind > 0 and time.perf_counter() - stopped_at < options.catch_up_seconds:
            time.sleep(POLL_SECONDS)
            behind, _, scraped = lag()
        caught_up = time.perf_counter() - stopped_at
        others_rate = (others - others0) / seconds
        sampled = [x for x, _ in lags]
        out["feed"] = {
            "others_events_per_second": round(others_rate, 1),
            "planner_applied_events": int(scraped[planner]["applied_events"]),
            "planner_applied_batches": int(scraped[planner]["applied_batches"]),
            "lag_events_sampled": sampled,
            "lag_events_max": max(sampled),
            "lag_events_at_end": at_end,
            "behind_seconds_at_end": round(at_end / others_rate, 3) if others_rate > 0 else None,
            "caught_up_seconds": round(caught_up, 2) if behind <= 0 else None,
            "lag_events_after_catch_up": behind,
        }
    return out


def _feed_apply(
    options: PlannerOptions,
    proc: Proc,
    redis_url: str,
    prefix: str,
    seed: int,
    own_events_per_second: float,
) -> dict[str, Any]:
    """The feed pre-filled while the replica is stopped, then applied: events/s."""
    import redis

    from app.decide.fleet_feed import FEED_MAXLEN, feed_entry, feed_key
    from kvprefetch_client.events import event_adapter

    info(f"  feed: {options.feed_events:,} events made, then added while the replica is stopped")
    shard = make_shards(
        connections=1,
        sessions=options.sessions,
        instances=options.instances,
        hbm_blocks=options.hbm_blocks,
        seed=seed + 500,
    )[0]
    entries = list(
        _entries(shard, options.feed_events, options.batch_size, feed_entry, event_adapter)
    )
    time.sleep(1.0)  # the replica's reader past its own last batches
    before = _scrape(proc)
    client = redis.Redis.from_url(redis_url, socket_timeout=60)
    stopped = _signal_all(proc, signal.SIGSTOP)
    try:
        t = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for fields in entries:
            pipe.xadd(feed_key(prefix), fields, maxlen=FEED_MAXLEN, approximate=True)
        pipe.execute()
        publish_seconds = time.perf_counter() - t
    finally:
        _signal_all(proc, signal.SIGCONT, stopped)
        client.close()
    continued = time.perf_counter()
    cpu0 = cpu_seconds(proc.proc.pid)
    events = options.feed_events
    polls: list[tuple[float, int]] = []
    while True:
        got = int(_scrape(proc)["applied_events"] - before["applied_events"])
        polls.append((time.perf_counter(), got))
        if got >= events:
            break
        if time.perf_counter() - continued > options.catch_up_seconds:
            raise BenchError(
                f"the replica applied {got:,} of the feed's {events:,} events in "
                f"{options.catch_up_seconds:g} s:\n{proc.log_tail()}"
            )
        time.sleep(POLL_SECONDS)
    done = polls[-1][0]
    cpu = cpu_seconds(proc.proc.pid) - cpu0
    after = _scrape(proc)
    # From the first poll that saw some applied: the continued process's first moments (its
    # timers, a read that timed out while it was stopped) are not the feed's.
    first = next(((t, g) for t, g in polls if g > 0), polls[-1])
    if first[1] < events:
        rate = (events - first[1]) / (done - first[0])
    else:  # all of it within one poll: a bound from below
        rate = events / (done - continued)
    return {
        "events": events,
        "batches": int(after["applied_batches"] - before["applied_batches"]),
        "publish_seconds": round(publish_seconds, 3),
        "apply_seconds": round(done - continued, 3),
        "events_per_second": round(rate, 1),
        "replica_cpu_share": round(cpu / (done - continued), 3),
        "events_per_cpu_second": _per(events, cpu),
        "own_ingest_events_per_second": own_events_per_second,
        "ratio_to_own_ingest": round(rate / own_events_per_second, 2)
        if own_events_per_second
        else None,
        "polls": len(polls),
    }


def _entries(
    shard: Shard, events: int, batch_size: int, entry: Callable[..., Any], adapter: Any
) -> Iterator[Any]:
    """`events` of the shard's traffic as feed entries of `batch_size`, from a replica of its
    own."""
    import orjson

    left = events
    while left > 0:
        body = shard.batch(min(batch_size, left))[0]
        batch = orjson.loads(body)["events"]
        yield entry(FEED_WRITER, [adapter.validate_python(e) for e in batch])
        left -= len(batch)


def _signal_all(proc: Proc, sig: int, pids: list[int] | None = None) -> list[int]:
    """`sig` to the process and its children (those of `pids` when given); the pids signalled."""
    import psutil

    if pids is None:
        pids = [proc.proc.pid]
        with contextlib.suppress(psutil.Error):
            pids += [c.pid for c in psutil.Process(proc.proc.pid).children(recursive=True)]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue
    return pids


def _scrape(proc: Proc) -> dict[str, float]:
    """From the replica's /metrics: events it accepted, what it applied from the feed, whether it
    holds the lease."""
    import httpx

    r = httpx.get(proc.url + "/metrics", timeout=10.0)
    if r.status_code != 200:
        raise BenchError(f"{proc.name}'s /metrics answered {r.status_code}")
    out = {"ingested": 0.0, "applied_events": 0.0, "applied_batches": 0.0, "leader": 0.0}
    names = {
        "kvprefetch_fleet_feed_applied_events_total": "applied_events",
        "kvprefetch_fleet_feed_applied_batches_total": "applied_batches",
        "kvprefetch_planning_leader": "leader",
    }
    for line in r.text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("kvprefetch_events_ingested_total"):
            out["ingested"] += float(value)
        elif name in names:
            out[names[name]] = float(value)
    return out


def _per(events: float, cpu_seconds: float) -> float | None:
    return round(events / cpu_seconds, 1) if cpu_seconds > 0 else None


def _redis_clean(url: str, prefix: str) -> int:
    from bench.load.probes import redis_clean

    return redis_clean(url, prefix)


def _load_averages() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _median(rows: Sequence[Any]) -> float | None:
    xs = [x for x in rows if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def _result(
    options: PlannerOptions,
    rounds: list[dict[str, Any]],
    redis: dict[str, Any],
    load_before: list[float],
    started: float,
) -> dict[str, Any]:
    def pick(*path: str) -> list[Any]:
        out = []
        for r in rounds:
            x: Any = r
            for p in path:
                x = None if x is None else x.get(p)
            out.append(x)
        return out

    one_rate = _median(pick("one_replica", "events_per_second"))
    many_rate = _median(pick("replicas", "events_per_second"))
    apply_rate = _median(pick("one_replica", "feed_apply", "events_per_second"))
    own_cpu = [r["one_replica"]["per_replica"][0]["events_per_cpu_second"] for r in rounds]
    apply_cpu = pick("one_replica", "feed_apply", "events_per_cpu_second")
    cfg = asdict(options)
    cfg["data_dir"] = str(options.data_dir) if options.data_dir else None
    return {
        "config": cfg,
        "summary": {
            "one_replica_events_per_second": one_rate,
            "one_replica_batch_p99_ms": _median(pick("one_replica", "batch_latency_ms", "p99")),
            "replicas_events_per_second": many_rate,
            "replicas_batch_p99_ms": _median(pick("replicas", "batch_latency_ms", "p99")),
            "feed_apply_events_per_second": apply_rate,
            "feed_apply_ratio_to_own_ingest": _median(
                pick("one_replica", "feed_apply", "ratio_to_own_ingest")
            ),
            # The same per second of the replica's CPU (ingest: its whole CPU under load).
            "one_replica_events_per_cpu_second": _median(own_cpu),
            "feed_apply_events_per_cpu_second": _median(apply_cpu),
            "feed_apply_cpu_ratio_to_own_ingest": _median(
                [a / o if a and o else None for a, o in zip(apply_cpu, own_cpu, strict=True)]
            ),
            # The planner applies the others' events: (n-1)/n of the fleet's.
            "planner_feed_load_events_per_second": _median(
                pick("replicas", "feed", "others_events_per_second")
            ),
            "planner_lag_events_at_end": _median(pick("replicas", "feed", "lag_events_at_end")),
            "planner_behind_seconds_at_end": _median(
                pick("replicas", "feed", "behind_seconds_at_end")
            ),
            "planner_caught_up_seconds": _median(pick("replicas", "feed", "caught_up_seconds")),
        },
        "rounds": rounds,
        "redis": redis,
        "machine": machine(),
        "load_average": {"before": load_before, "after": _load_averages()},
        "note": (
            f"the replicas, Redis and this client share {os.cpu_count()} cores: "
            f"{options.replicas} replicas here are not {options.replicas} hosts"
        ),
        "bench_seconds": round(time.monotonic() - started, 1),
    }
