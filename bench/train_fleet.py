"""Training at fleet scale: one process beside a Dask cluster, on one synthetic fleet log.

    kvprefetch bench train-fleet [--events 20000000] [--workers 2] [--max-rounds 300]
        [--dask-only | --single-only]
        [--reference-events 200000] [--trace-requests N] [--work-dir DIR] [--json]

The fleet log: the shared traces (`../shared/traces` beside the checkout, as the tests find
them) turned into events (`kvprefetch events-from-trace`), copied until the log holds `--events`,
each copy with its own session, request, event and instance ids and its times shifted (copies
overlap in time, as a fleet's deployments do), all in event-time order in one JSON Lines file.
DuckDB writes it out of core (fleet_log): its size is not bounded by this machine's memory.

Each path runs in a process of its own, its peak RSS and CPU seconds sampled with its
children's (the Dask workers' included) every SAMPLE_SECONDS, and per stage (the process names
its stages: scan, dedupe, shard, timeline, replay, fit, evaluate ...; a stage shorter than a
sample may not show). On a shared machine the CPU seconds are the steadier figure: other jobs
lengthen a stage's wall time, not its CPU time (much).

- `single`: one process, no Dask: training.fleet.build_rows_fleet with workers=0 (DuckDB orders
  and shards the log out of core, this process replays the shards one after another into
  Parquet files), then training.dask_train.train_files without a cluster (LightGBM's serial
  learner, training.train's parameters, the Dataset built from the files in batches);
- `dask`: the same build with the shards replayed on a LocalCluster of `--workers` workers,
  then train_files on the cluster (each worker builds its Dataset from its share of the files;
  LightGBM's data-parallel learner across them).

The old single-process path (training.dataset.build_dataset: one MemoryStore replaying the whole
log, then training.train on the rows in memory) takes hours and more memory than the machine at
20M events, so it is not a path here: `reference` runs it on the log's first
`--reference-events` events beside the columnar build (one process) and says whether the rows
are equal (`rows_equal`), with both times.

`engines`: the in-memory scan alone (read, parse ts/type/session, dedupe, order) by Polars and
by DuckDB, on the log's first ENGINE_EVENTS events (both hold what they scan). `quality`: both
models' Brier score and log loss on the same held-out part (the last 20% of the log's time
span); equal within QUALITY_TOLERANCE, when both paths ran. `--dask-only` skips the single path,
`--single-only` the Dask path.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._util import machine

SAMPLE_SECONDS = 0.2
# A path's process names its current stage in the file this variable names.
STAGE_FILE_ENV = "KVP_BENCH_STAGE_FILE"
# The engines' comparison holds the log in memory (both scans): on at most this many events.
ENGINE_EVENTS = 2_000_000
# The old replay (one MemoryStore) against the columnar build, rows compared: on this many.
REFERENCE_EVENTS = 200_000
# Two models from the same rows are "equal" when their held-out scores differ by at most this:
# lightgbm.dask's data-parallel learner splits on histograms merged across workers and falls back
# to the basic monotone method, so its trees are not the serial ones.
QUALITY_TOLERANCE = {"brier": 0.005, "log_loss": 0.015}
TRACE_NAMES = ("mooncake_synthetic.jsonl", "mooncake_conversation_first60.jsonl")


# The shared traces, beside the checkout (as tests/conftest.py finds them).
TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def base_logs(folder: Path, traces: Path, requests: int | None = None) -> list[Path]:
    """Each trace's event log (its first `requests` requests, or all), as `kvprefetch
    events-from-trace` writes it."""
    from sim.commands import events_from_trace

    out = []
    for name in TRACE_NAMES:
        trace = traces / name
        if requests is not None:
            lines = trace.read_text().splitlines(keepends=True)[:requests]
            trace = folder / f"first{requests}-{name}"
            trace.write_text("".join(lines))
        log = folder / f"base-{trace.name}"
        events_from_trace(trace, log, "default", "sticky", "none", None)
        out.append(log)
    return out


def fleet_log(bases: list[Path], events: int, out: Path, memory_limit: str = "2GB") -> int:
    """Copies of the base logs with shifted ids and times, until `events`; in ts order.

    DuckDB writes it (a database file beside `out`, spilling past `memory_limit`): the log is
    never in this process's memory, whatever its size."""
    import duckdb

    db = out.with_name(out.name + ".duckdb")
    con = duckdb.connect(str(db))
    spill = out.with_name(out.name + ".spill")
    try:
        con.execute("SET enable_progress_bar = false").fetchall()  # stdout is the JSON's
        con.execute(f"SET memory_limit = '{memory_limit}'").fetchall()
        con.execute(f"SET temp_directory = '{spill}'").fetchall()
        pattern = r'^\{"event_id":"([^"]*)","ts":([^,]+),(.*)$'
        parts = []
        skipped = 0
        for b, base in enumerate(bases):
            con.execute(
                f"""
                CREATE TABLE base{b} AS
                SELECT regexp_extract(line, '{pattern}', ['event_id', 'ts', 'rest']) AS g
                FROM read_csv('{base}', columns = {{'line': 'VARCHAR'}}, delim = '\x01',
                              quote = '', escape = '', header = false, auto_detect = false,
                              max_line_size = 100000000)
                """
            ).fetchall()
            (size,) = con.execute(f"SELECT count(*) FROM base{b}").fetchall()[0]
            # A copy's events in the bases' order: base 0's lines, then base 1's ...
            parts.append(
                f"SELECT {b} AS b, rowid + {skipped} AS row, g.event_id AS event_id, "
                f"CAST(g.ts AS DOUBLE) AS ts, g.rest AS rest FROM base{b}"
            )
            skipped += size
        per_copy = skipped
        copies = -(-events // per_copy)
        con.execute(f"CREATE TABLE base AS {' UNION ALL '.join(parts)}").fetchall()
        rest = "rest"
        for key in ("session_id", "request_id", "instance_id"):
            rest = f"""replace({rest}, '"{key}":"', '"{key}":"' || tag || '-')"""
        con.execute(
            f"""
            COPY (
                SELECT '{{"event_id":"' || tag || '-' || event_id || '","ts":'
                       || CAST(ts + shift AS VARCHAR) || ',' || {rest} AS line
                FROM (
                    -- Copies start a minute apart in an hour, then 7 s later each hour: they
                    -- overlap. `seq`: the order of a concatenation of the copies, cut at events.
                    SELECT base.*, (k % 60) * 60.0 + (k // 60) * 7.0 AS shift,
                           'c' || k || (CASE b WHEN 0 THEN 'a' ELSE 'b' END) AS tag,
                           k * {per_copy} + row AS seq
                    FROM base, range({copies}) r(k)
                )
                WHERE seq < {events}
                ORDER BY ts + shift, seq
            ) TO '{out}' (FORMAT CSV, HEADER false, QUOTE '', ESCAPE '', DELIMITER '\x01')
            """
        ).fetchall()
    finally:
        con.close()
        db.unlink(missing_ok=True)
        shutil.rmtree(spill, ignore_errors=True)
    return min(events, copies * per_copy)


def _stage(name: str) -> None:
    """Tell the parent (_run_path) which step this process is in: its RSS samples count there."""
    path = os.environ.get(STAGE_FILE_ENV)
    if path:
        Path(path).write_text(name)


def _path_single(log: Path, max_rounds: int) -> dict[str, Any]:
    from training.dask_train import train_files
    from training.fleet import build_rows_fleet
    from training.train import DEFAULT_PARAMS

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        # workers=0: the shards are replayed here, one after another.
        rows = build_rows_fleet([log], Path(tmp), workers=0, stage=_stage)
        build = time.perf_counter() - t
        _stage("train")
        t = time.perf_counter()
        # No client: LightGBM's serial learner here, training.train's parameters (2 threads).
        params = {**DEFAULT_PARAMS, "seed": 0}
        model = train_files(rows, None, params, num_boost_round=max_rounds, stage=_stage)
        fit = time.perf_counter() - t
        return _result(model.data["rows_train"] + model.data["rows_valid"], model, build, fit)


def _path_dask(log: Path, max_rounds: int, workers: int) -> dict[str, Any]:
    from training.dask_train import dask_client, train_dask
    from training.fleet import build_rows_fleet

    _stage("cluster")
    with dask_client(f"local:{workers}") as client, tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        rows = build_rows_fleet([log], Path(tmp), workers=workers, client=client, stage=_stage)
        build = time.perf_counter() - t
        _stage("train")
        t = time.perf_counter()
        # The workers read the shards' rows themselves: only the validation part comes here.
        model = train_dask(rows, client, num_boost_round=max_rounds, stage=_stage)
        fit = time.perf_counter() - t
        return _result(model.data["rows_train"] + model.data["rows_valid"], model, build, fit)


def _path_reference(log: Path, events: int) -> dict[str, Any]:
    """The log's first `events` events: build_dataset's replay (one MemoryStore) against the
    columnar build in one process; whether their rows are equal."""
    import pandas as pd

    from training.dataset import build_dataset
    from training.fleet import build_dataset_fleet

    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "prefix.jsonl"
        n = _head(log, events, prefix)
        _stage("replay")
        t = time.perf_counter()
        replayed = build_dataset([prefix])
        replay = time.perf_counter() - t
        _stage("columnar")
        t = time.perf_counter()
        columnar = build_dataset_fleet([prefix], workers=0, work_dir=Path(tmp) / "work")
        built = time.perf_counter() - t
    try:
        pd.testing.assert_frame_equal(replayed, columnar)
        equal = replayed.attrs == columnar.attrs
    except AssertionError:
        equal = False
    return {
        "events": n,
        "rows": len(replayed),
        "replay_seconds": round(replay, 2),
        "columnar_seconds": round(built, 2),
        "rows_equal": equal,
    }


def _head(log: Path, events: int, out: Path) -> int:
    """The log's first `events` lines to `out` (the log is in event-time order); how many."""
    n = 0
    with open(log) as f, open(out, "w") as o:
        for line in f:
            if n == events:
                break
            o.write(line)
            n += 1
    return n


def _result(rows: int, model: Any, build: float, fit: float) -> dict[str, Any]:
    m = model.metrics
    return {
        "rows": rows,
        "build_seconds": round(build, 2),
        "train_seconds": round(fit, 2),
        "best_iteration": m["best_iteration"],
        "valid": {k: m[k] for k in ("rows", "brier", "log_loss", "auc", "brier_of_base_rate")},
    }


def _path_engines(log: Path, events: int) -> dict[str, Any]:
    """Both scans (each holds the log in memory) on the log's first `events` events."""
    from training.fleet import ordered_events

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "prefix.jsonl"
        out["events"] = _head(log, events, prefix)
        for engine in ("polars", "duckdb", "polars", "duckdb"):  # the second round counts
            _stage(engine)
            t = time.perf_counter()
            frame = ordered_events(prefix, engine, Path(tmp))
            out[engine] = {"seconds": round(time.perf_counter() - t, 2), "events": frame.height}
            del frame
    return out


def _run_path(args: list[str]) -> dict[str, Any]:
    """`args` in a process of its own; its result, the peak RSS of it and its children, and
    each stage's (the process names its stages through a file): seconds and peak RSS."""
    import psutil

    # Dask's logs: only their end, and only on a failure.
    errors = tempfile.TemporaryFile()  # noqa: SIM115 - closed below, or with the process
    stage_file = tempfile.NamedTemporaryFile(delete=False)  # noqa: SIM115 - removed below
    stage_file.close()
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.train_fleet", *args],
        stdout=subprocess.PIPE,
        stderr=errors,
        env={**os.environ, "PYTHONWARNINGS": "ignore", STAGE_FILE_ENV: stage_file.name},
    )
    peak = 0
    stages: dict[str, dict[str, Any]] = {}
    current, since = "start", started
    parent = psutil.Process(proc.pid)
    # Each process's CPU seconds when last sampled (a child's last <SAMPLE_SECONDS are missed).
    cpu_seen: dict[int, float] = {}
    cpu_since = 0.0
    try:
        while proc.poll() is None:
            total = 0
            with contextlib.suppress(psutil.Error):  # a child may end between listing and reading
                for p in [parent, *parent.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        total += p.memory_info().rss
                        t = p.cpu_times()
                        cpu_seen[p.pid] = t.user + t.system
            cpu = sum(cpu_seen.values())
            now = Path(stage_file.name).read_text() or current
            if now != current:
                _close_stage(stages, current, since, cpu - cpu_since)
                current, since, cpu_since = now, time.perf_counter(), cpu
                print(
                    f"train-fleet {args[0]}: {now} at {since - started:.1f} s, "
                    f"RSS {total / 1e9:.2f} GB, CPU {cpu:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
            entry = stages.setdefault(
                current, {"seconds": 0.0, "cpu_seconds": 0.0, "peak_rss_bytes": 0}
            )
            entry["peak_rss_bytes"] = max(entry["peak_rss_bytes"], total)
            peak = max(peak, total)
            time.sleep(SAMPLE_SECONDS)
        _close_stage(stages, current, since, sum(cpu_seen.values()) - cpu_since)
    finally:
        os.unlink(stage_file.name)
    out = proc.stdout.read() if proc.stdout else b""
    if proc.returncode != 0:
        errors.seek(0)
        tail = errors.read().decode(errors="replace")[-3000:]
        raise RuntimeError(f"bench train-fleet {args[0]} failed ({proc.returncode}):\n{tail}")
    errors.close()
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    result["peak_rss_bytes"] = peak
    result["cpu_seconds"] = round(sum(cpu_seen.values()), 2)
    result["stages"] = stages
    return result


def _close_stage(stages: dict[str, dict[str, Any]], name: str, since: float, cpu: float) -> None:
    entry = stages.setdefault(name, {"seconds": 0.0, "cpu_seconds": 0.0, "peak_rss_bytes": 0})
    entry["seconds"] = round(entry["seconds"] + time.perf_counter() - since, 2)
    entry["cpu_seconds"] = round(entry["cpu_seconds"] + cpu, 2)


def run(
    *,
    events: int,
    workers: int = 2,
    max_rounds: int = 300,
    work_dir: Path | None = None,
    trace_requests: int | None = None,
    paths: tuple[str, ...] = ("single", "dask"),
    reference_events: int = REFERENCE_EVENTS,
) -> dict[str, Any]:
    """`paths`: which of single and dask run (a log too big for one process: dask alone).
    `reference_events`: the replay against the columnar build on that many (0: not run)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = work_dir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        log = folder / f"fleet-{events}.jsonl"
        written = fleet_log(base_logs(folder, TRACES, trace_requests), events, log)
        made = time.perf_counter() - t
        # This process's peak so far: the fleet log's writing (the paths run in children).
        log_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        print(f"train-fleet: {written} events in {made:.1f} s", file=sys.stderr, flush=True)
        engines = _run_path(["engines", str(log), str(min(events, ENGINE_EVENTS))])
        reference = None
        if reference_events:
            reference = _run_path(["reference", str(log), str(min(events, reference_events))])
        results = {}
        if "single" in paths:
            results["single"] = _run_path(["single", str(log), str(max_rounds)])
        if "dask" in paths:
            results["dask"] = _run_path(["dask", str(log), str(max_rounds), str(workers)])
        log_bytes = log.stat().st_size
    quality: dict[str, Any] = {"tolerance": QUALITY_TOLERANCE}
    if len(results) == 2:
        single, dask = results["single"], results["dask"]
        delta = {k: round(abs(single["valid"][k] - dask["valid"][k]), 5) for k in QUALITY_TOLERANCE}
        quality["difference"] = delta
        quality["equal_within_tolerance"] = all(delta[k] <= v for k, v in QUALITY_TOLERANCE.items())
    return {
        "events": written,
        "log_bytes": log_bytes,
        "log_seconds": round(made, 2),
        "log_peak_rss_bytes": log_peak,
        "workers": workers,
        "max_rounds": max_rounds,
        "trace_requests": trace_requests,
        "engines": engines,
        "reference": reference,
        **results,
        "quality": quality,
        "load_average": list(os.getloadavg()),
        **machine(),
    }


def _main(argv: list[str]) -> None:
    path, log = argv[0], Path(argv[1])
    if path == "engines":
        result = _path_engines(log, int(argv[2]))
    elif path == "reference":
        result = _path_reference(log, int(argv[2]))
    elif path == "single":
        result = _path_single(log, int(argv[2]))
    else:
        result = _path_dask(log, int(argv[2]), int(argv[3]))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
