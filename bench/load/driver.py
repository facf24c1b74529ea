"""`run()`: the phases of `kvprefetch bench load`, in order, and the samples taken along the way."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench._util import check_redis, info
from bench.load import probes, report
from bench.load.calibrate import calibrate, modes
from bench.load.ceiling import ceiling_phase
from bench.load.client import Load
from bench.load.processes import BenchError, Proc, cpu_pressure, cpu_seconds, load_average, rss
from bench.load.traffic import Held, Shard, make_shards

# The bench's conversations come back about a second after each answer, where people take
# minutes: an hour of retention at a human pace is about a minute at the bench's. With the
# service's own 3600 s, every conversation of the run would be tracked to the end and the
# sessions could not level off within minutes.
SESSION_RETENTION_SECONDS = 60.0


def run(
    *,
    duration_seconds: float = 120.0,
    warmup_seconds: float = 10.0,
    sessions: int = 3000,
    instances: int = 16,
    hbm_blocks: int = 2000,
    batch_size: int = 200,
    event_connections: int = 2,
    hint_connections: int = 2,
    store: str = "memory",
    fsync: bool = True,
    dedupe_max_ids: int | None = None,
    session_retention_seconds: float = SESSION_RETENTION_SECONDS,
    sample_seconds: float = 5.0,
    ceiling_seconds: float = 10.0,
    calibrate_sessions: int = 10_000,
    token: str | None = None,
    service_env: dict[str, str] | None = None,
    data_dir: Path | None = None,
    seed: int = 0,
    events_per_second: float | None = None,
    hints_per_second: float | None = None,
) -> dict[str, Any]:
    if store not in ("memory", "redis"):
        raise ValueError("store must be memory or redis")
    if (
        min(duration_seconds, sample_seconds, session_retention_seconds) <= 0
        or warmup_seconds < 0
        or ceiling_seconds < 0
    ):
        raise ValueError("durations must be positive (warm-up and ceiling: zero or more)")
    if (
        min(sessions, instances, hbm_blocks, batch_size, event_connections) < 1
        or hint_connections < 0
    ):
        raise ValueError(
            "sessions, instances, hbm blocks, batch size and event connections must be at least 1"
        )
    if (events_per_second is not None and events_per_second <= 0) or (
        hints_per_second is not None and hints_per_second <= 0
    ):
        raise ValueError("offered rates must be positive (or unset: closed-loop)")
    if hints_per_second is not None and hint_connections == 0:
        raise ValueError("an offered hint rate needs hint connections")
    if instances < event_connections:
        raise ValueError(
            "every event connection needs an instance of its own: instances >= event connections"
        )
    if dedupe_max_ids is None and "KVP_DEDUPE_MAX_IDS" in (service_env or {}):
        dedupe_max_ids = int(service_env["KVP_DEDUPE_MAX_IDS"])  # type: ignore[index]
    bench_started = time.monotonic()
    headers = {"authorization": f"Bearer {token}"} if token else {}
    redis_url = os.environ.get("KVP_REDIS_URL", "redis://127.0.0.1:6379/0")
    if store == "redis":
        check_redis(redis_url)  # before the calibration, which needs it too
    prefix = f"kvp-bench-load-{uuid.uuid4().hex[:12]}"

    env = {
        "KVP_HOST": "127.0.0.1",
        "KVP_STORE": store,
        "KVP_LOG_FSYNC": "true" if fsync else "false",
        "KVP_REPLICA_ID": "bench-load",
        "KVP_SESSION_RETENTION_SECONDS": f"{session_retention_seconds:g}",
    }
    if store == "redis":
        env.update({"KVP_REDIS_URL": redis_url, "KVP_REDIS_PREFIX": prefix})
    if dedupe_max_ids is not None:
        env["KVP_DEDUPE_MAX_IDS"] = str(dedupe_max_ids)
    env.update(service_env or {})
    settings = report.service_settings(env)

    shards_kw = {
        "connections": event_connections,
        "sessions": sessions,
        "instances": instances,
        "hbm_blocks": hbm_blocks,
        "seed": seed,
    }
    load_kw: dict[str, Any] = {
        "hint_connections": hint_connections,
        "batch_size": batch_size,
        "token": token,
        "seed": seed,
    }
    config: dict[str, Any] = {
        "duration_seconds": duration_seconds,
        "warmup_seconds": warmup_seconds,
        "sessions": sessions,
        "instances": instances,
        "hbm_blocks": hbm_blocks,
        "batch_size": batch_size,
        "event_connections": event_connections,
        "hint_connections": hint_connections,
        "store": store,
        "fsync": fsync,
        "sample_seconds": sample_seconds,
        "ceiling_seconds": ceiling_seconds,
        "calibrate_sessions": calibrate_sessions,
        "token": "set" if token else None,
        "seed": seed,
        "mode": _mode(events_per_second, hints_per_second),
        "events_per_second_offered": events_per_second,
        "hints_per_second_offered": hints_per_second,
        # In force in the service, from --service-env, the options, or its defaults.
        "dedupe_max_ids": settings["dedupe_max_ids"],
        "session_retention_seconds": settings["session_retention_seconds"],
        "reorder_window_seconds": settings["reorder_window_seconds"],
        "service_env": {
            k: (v if "TOKEN" not in k.upper() else "set")
            for k, v in sorted(env.items())
            if k != "KVP_DATA_DIR"
        },
    }

    calibration = None
    if calibrate_sessions > 0:
        info(
            f"bench load: calibrating what state costs ({calibrate_sessions:,} sessions, "
            f"{len(modes(store))} fresh processes)"
        )
        calibration = calibrate(
            calibrate_sessions, store, redis_url, settings["dedupe_max_ids"], seed + 7
        )
        info(
            f"  {calibration['bytes_per_session']:,.0f} B/session, "
            f"{calibration['bytes_per_event_id']:,.0f} B/event id, "
            f"{calibration['bytes_per_resident_block']:,.0f} B/resident block, "
            f"{calibration['bytes_per_tombstone']:,.0f} B/tombstone, "
            f"{calibration['bytes_per_advised_session']:,.0f} B/advised session, "
            f"{calibration['bytes_per_held_order']:,.0f} B/held order, "
            f"{calibration['bytes_per_remembered_order_id']:,.0f} B/remembered order id"
        )

    # Made after what can fail first (the settings, the calibration), so nothing is left behind.
    workdir = Path(tempfile.mkdtemp(prefix="kvp-bench-load-", dir=data_dir))
    env.setdefault("KVP_DATA_DIR", str(workdir / "data"))
    ceiling: list[dict[str, Any]] = []
    ceiling_warmup = min(2.0, warmup_seconds)

    def ceiling_run(label: str) -> None:
        if ceiling_seconds <= 0:
            return
        info(f"bench load: ceiling phase ({label}), {ceiling_seconds:g} s")
        kw = dict(shards_kw, seed=seed + 100 + len(ceiling))
        result = ceiling_phase(
            workdir, ceiling_seconds, ceiling_warmup, shards_kw=kw, load_kw=load_kw, headers=headers
        )
        info(
            f"  ceiling: {result['event_batches']['events_per_second']:,.0f} events/s, "
            f"{result['route_hints']['requests_per_second']:,.0f} hints/s"
        )
        ceiling.append(result)

    service: Proc | None = None
    load: Load | None = None
    redis: dict[str, Any] | None = (
        {"prefix": prefix, "keys_removed": None} if store == "redis" else None
    )
    try:
        ceiling_run("before")
        service = Proc("service", ["-m", "kvprefetch_cli", "serve"], workdir=workdir, env=env)
        info(
            f"bench load: service on {service.url} "
            f"(store={store}, fsync={'on' if fsync else 'off'}, "
            f"session retention {settings['session_retention_seconds']:g} s), data in {workdir}"
        )
        service.wait_ready("/readyz", headers)
        startup_rss = rss(service.proc.pid)
        shards = make_shards(
            **shards_kw,
            reorder_window=settings["reorder_window_seconds"],
            session_retention=settings["session_retention_seconds"],
        )
        config["hint_candidates"] = "the instances of the session's shard: " + ", ".join(
            str(len(sh.instances)) for sh in shards
        )
        # The offered rates are the service's alone: the ceiling phases measure full speed.
        load = Load(
            service.url,
            shards,
            **load_kw,
            events_per_second=events_per_second,
            hints_per_second=hints_per_second,
        )
        points, first = _service_phase(
            service,
            load,
            shards,
            headers,
            warmup_seconds,
            duration_seconds,
            sample_seconds,
            redis_url if store == "redis" else None,
        )
        if redis is not None:
            redis["used_memory_start"], redis["used_memory_end"] = (
                points[first]["redis"],
                points[-1]["redis"],
            )
        service_end = {
            "readyz": probes.readyz(service.url, headers),
            "metrics": points[-1]["metrics"],
        }
        load.finish()
        service.stop()
        service_end["log"] = probes.log_summary(service.log_path)
        service = None
        ceiling_run("after")
    finally:
        if load is not None:
            load.finish()
        if service is not None:
            service.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        if redis is not None:
            redis["keys_removed"] = probes.redis_clean(redis_url, prefix)

    return report.result(
        points=points,
        first=first,
        load=load,
        settings=settings,
        calibration=calibration,
        startup_rss=startup_rss,
        ceiling=ceiling,
        service_end=service_end,
        redis=redis,
        config=config,
        bench_seconds=round(time.monotonic() - bench_started, 1),
    )


def _service_phase(
    service: Proc,
    load: Load,
    shards: list[Shard],
    headers: dict[str, str],
    warmup_seconds: float,
    duration_seconds: float,
    sample_seconds: float,
    redis_url: str | None,
) -> tuple[list[dict[str, Any]], int]:
    """The load on the service: the warm-up, then `duration_seconds` sampled every
    `sample_seconds`. Returns the samples (the first one at the service's start, before any
    load) and the index of the measured window's first."""
    pid = service.proc.pid

    def sample(t_rel: float) -> dict[str, Any]:
        metrics = probes.metrics(service.url, headers)
        ready = probes.readyz(service.url, headers) or {}
        scheduler = probes.scheduler(service.url, headers) or {}
        return {
            "t": round(t_rel, 1),
            "perf": time.perf_counter(),
            "rss_bytes": rss(pid),
            "service_cpu_seconds": cpu_seconds(pid),
            "client_cpu_seconds": time.process_time(),
            "load_average_1m": load_average(),
            "cpu_pressure_avg60": cpu_pressure(),
            "stats": ready.get("stats"),
            "metrics": metrics,
            "orders": probes.order_totals(metrics),
            "events_ingested": probes.events_ingested(metrics),
            **{k: sum(getattr(s.acked, k) for s in shards) for k in Held._fields},
            "advised_sessions": int(scheduler.get("tracked_sessions", 0)),
            "redis": probes.redis_memory(redis_url) if redis_url is not None else None,
        }

    points = [sample(-warmup_seconds)]
    load.start()
    info(f"bench load: warm-up {warmup_seconds:g} s, then {duration_seconds:g} s measured")
    time.sleep(warmup_seconds)
    points.append(sample(0.0))
    first = len(points) - 1
    t_start = points[first]["perf"]
    end_at = t_start + duration_seconds
    while True:
        now = time.perf_counter()
        if now >= end_at:
            break
        if service.proc.poll() is not None:
            raise BenchError(
                f"the service exited with {service.proc.returncode} under load:\n"
                f"{service.log_tail()}"
            )
        time.sleep(min(sample_seconds - (now - t_start) % sample_seconds, end_at - now))
        s = sample(time.perf_counter() - t_start)
        points.append(s)
        w = load.window(points[-2]["perf"], s["perf"])
        info(
            f"  t={s['t']:6.1f} s  rss {s['rss_bytes'] / 2**20:7.1f} MiB  "
            f"sessions {(s['stats'] or {}).get('sessions')}, "
            f"{s['advised_sessions']} advised  "
            f"{w['event_batches']['events_per_second']:8,.0f} events/s  "
            f"{w['route_hints']['requests_per_second']:6,.0f} hints/s  "
            f"p99 batch {w['event_batches']['latency_ms']['p99']} ms, "
            f"hint {w['route_hints']['latency_ms']['p99']} ms"
        )
    return points, first


def _mode(events_per_second: float | None, hints_per_second: float | None) -> str:
    if events_per_second is None and hints_per_second is None:
        return "closed-loop, full speed"
    parts = [
        f"{rate:g} {what}/s offered" if rate is not None else f"{what} closed-loop"
        for rate, what in ((events_per_second, "events"), (hints_per_second, "hints"))
    ]
    return "open-loop: " + ", ".join(parts) + "; latency from each call's scheduled start"
