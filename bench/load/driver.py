"""`run()`: the phases of `kvprefetch bench load`, in order, and the samples taken along the way."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

from bench._util import check_redis, info
from bench.load import probes, report
from bench.load.calibrate import calibrate, modes
from bench.load.ceiling import ceiling_phase
from bench.load.client import Load
from bench.load.options import LoadOptions
from bench.load.processes import BenchError, Proc, cpu_pressure, cpu_seconds, load_average, rss
from bench.load.traffic import Held, Shard, make_shards


class _Measured(NamedTuple):
    """The service phase: its samples, from the first of the measured window on, its client,
    and what was read from the service at its start and end."""

    points: list[dict[str, Any]]
    first: int
    load: Load
    startup_rss: int
    service_end: dict[str, Any]


def run(options: LoadOptions) -> dict[str, Any]:
    """The calibration, a ceiling phase, the service under load, a ceiling phase again: the JSON.
    ValueError for options that cannot make a run; BenchError when a server fails."""
    options.validate()
    bench_started = time.monotonic()
    headers = {"authorization": f"Bearer {options.token}"} if options.token else {}
    redis_url = os.environ.get("KVP_REDIS_URL", "redis://127.0.0.1:6379/0")
    prefix = f"kvp-bench-load-{uuid.uuid4().hex[:12]}"
    env = options.service_environment(redis_url, prefix)
    if options.store == "redis":
        check_redis(redis_url)  # before the calibration, which needs it too
    settings = report.service_settings(env)
    config = options.record(env, settings)
    calibration = _calibrate(options, redis_url, settings["dedupe_max_ids"])

    # Made after what can fail first (the settings, the calibration), so nothing is left behind.
    workdir = Path(tempfile.mkdtemp(prefix="kvp-bench-load-", dir=options.data_dir))
    env.setdefault("KVP_DATA_DIR", str(workdir / "data"))
    ceiling: list[dict[str, Any]] = []
    redis: dict[str, Any] | None = (
        {"prefix": prefix, "keys_removed": None} if options.store == "redis" else None
    )
    try:
        _ceiling(options, workdir, headers, ceiling, "before")
        measured = _measure(
            options,
            workdir,
            env,
            headers,
            settings,
            config,
            redis_url if options.store == "redis" else None,
        )
        if redis is not None:
            redis["used_memory_start"], redis["used_memory_end"] = (
                measured.points[measured.first]["redis"],
                measured.points[-1]["redis"],
            )
        _ceiling(options, workdir, headers, ceiling, "after")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if redis is not None:
            redis["keys_removed"] = probes.redis_clean(redis_url, prefix)

    return report.result(
        points=measured.points,
        first=measured.first,
        load=measured.load,
        settings=settings,
        calibration=calibration,
        startup_rss=measured.startup_rss,
        ceiling=ceiling,
        service_end=measured.service_end,
        redis=redis,
        config=config,
        bench_seconds=round(time.monotonic() - bench_started, 1),
    )


def _shards_kw(options: LoadOptions) -> dict[str, Any]:
    """make_shards' arguments: the traffic, the same for the service and the ceiling."""
    return {
        "connections": options.event_connections,
        "sessions": options.sessions,
        "instances": options.instances,
        "hbm_blocks": options.hbm_blocks,
        "seed": options.seed,
    }


def _load_kw(options: LoadOptions) -> dict[str, Any]:
    """Load's arguments, but for the offered rates (the service's alone)."""
    return {
        "hint_connections": options.hint_connections,
        "batch_size": options.batch_size,
        "token": options.token,
        "seed": options.seed,
    }


def _calibrate(options: LoadOptions, redis_url: str, dedupe_max_ids: int) -> dict[str, Any] | None:
    """What each unit of state costs, in fresh processes; None with no calibration sessions."""
    if options.calibrate_sessions <= 0:
        return None
    info(
        f"bench load: calibrating what state costs ({options.calibrate_sessions:,} sessions, "
        f"{len(modes(options.store))} fresh processes)"
    )
    calibration = calibrate(
        options.calibrate_sessions, options.store, redis_url, dedupe_max_ids, options.seed + 7
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
    return calibration


def _ceiling(
    options: LoadOptions,
    workdir: Path,
    headers: dict[str, str],
    ceiling: list[dict[str, Any]],
    label: str,
) -> None:
    """A ceiling phase, appended to `ceiling` (none with no ceiling seconds)."""
    if options.ceiling_seconds <= 0:
        return
    info(f"bench load: ceiling phase ({label}), {options.ceiling_seconds:g} s")
    # Traffic of its own for each phase.
    shards_kw = dict(_shards_kw(options), seed=options.seed + 100 + len(ceiling))
    result = ceiling_phase(
        workdir,
        options.ceiling_seconds,
        min(2.0, options.warmup_seconds),
        shards_kw=shards_kw,
        load_kw=_load_kw(options),
        headers=headers,
    )
    info(
        f"  ceiling: {result['event_batches']['events_per_second']:,.0f} events/s, "
        f"{result['route_hints']['requests_per_second']:,.0f} hints/s"
    )
    ceiling.append(result)


def _measure(
    options: LoadOptions,
    workdir: Path,
    env: dict[str, str],
    headers: dict[str, str],
    settings: dict[str, Any],
    config: dict[str, Any],
    redis_url: str | None,
) -> _Measured:
    """The service's start, its load and its stop; adds the hint candidates to `config`."""
    service: Proc | None = None
    load: Load | None = None
    try:
        service = Proc("service", ["-m", "kvprefetch_cli", "serve"], workdir=workdir, env=env)
        info(
            f"bench load: service on {service.url} "
            f"(store={options.store}, fsync={'on' if options.fsync else 'off'}, "
            f"session retention {settings['session_retention_seconds']:g} s), data in {workdir}"
        )
        service.wait_ready("/readyz", headers)
        startup_rss = rss(service.proc.pid)
        shards = make_shards(
            **_shards_kw(options),
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
            **_load_kw(options),
            events_per_second=options.events_per_second,
            hints_per_second=options.hints_per_second,
        )
        points, first = _service_phase(service, load, shards, headers, options, redis_url)
        service_end = {
            "readyz": probes.readyz(service.url, headers),
            "metrics": points[-1]["metrics"],
        }
        load.finish()
        service.stop()
        service_end["log"] = probes.log_summary(service.log_path)
        service = None
        return _Measured(points, first, load, startup_rss, service_end)
    finally:
        if load is not None:
            load.finish()
        if service is not None:
            service.stop()


def _service_phase(
    service: Proc,
    load: Load,
    shards: list[Shard],
    headers: dict[str, str],
    options: LoadOptions,
    redis_url: str | None,
) -> tuple[list[dict[str, Any]], int]:
    """The load on the service: the warm-up, then `duration_seconds` sampled every
    `sample_seconds`. Returns the samples (the first one at the service's start, before any
    load) and the index of the measured window's first."""
    warmup_seconds, sample_seconds = options.warmup_seconds, options.sample_seconds

    def sample(t_rel: float) -> dict[str, Any]:
        return _sample(service, shards, headers, redis_url, t_rel)

    points = [sample(-warmup_seconds)]
    load.start()
    info(f"bench load: warm-up {warmup_seconds:g} s, then {options.duration_seconds:g} s measured")
    time.sleep(warmup_seconds)
    points.append(sample(0.0))
    first = len(points) - 1
    t_start = points[first]["perf"]
    end_at = t_start + options.duration_seconds
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
        _log_window(s, load.window(points[-2]["perf"], s["perf"]))
    return points, first


def _sample(
    service: Proc,
    shards: list[Shard],
    headers: dict[str, str],
    redis_url: str | None,
    t_rel: float,
) -> dict[str, Any]:
    """What the service, the OS and the client say at `t_rel` seconds into the measured window."""
    pid = service.proc.pid
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


def _log_window(s: dict[str, Any], w: dict[str, Any]) -> None:
    """One line on stderr for a sample `s` and the window `w` since the one before."""
    info(
        f"  t={s['t']:6.1f} s  rss {s['rss_bytes'] / 2**20:7.1f} MiB  "
        f"sessions {(s['stats'] or {}).get('sessions')}, "
        f"{s['advised_sessions']} advised  "
        f"{w['event_batches']['events_per_second']:8,.0f} events/s  "
        f"{w['route_hints']['requests_per_second']:6,.0f} hints/s  "
        f"p99 batch {w['event_batches']['latency_ms']['p99']} ms, "
        f"hint {w['route_hints']['latency_ms']['p99']} ms"
    )
