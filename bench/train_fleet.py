"""Training at fleet scale: one process beside a Dask cluster, on one synthetic fleet log.

    kvprefetch bench train-fleet [--events 20000000] [--workers 2] [--max-rounds 300] [--dask-only]
        [--trace-requests N] [--work-dir DIR] [--json]

The fleet log: the shared traces (`../shared/traces` beside the checkout, as the tests find
them) turned into events (`kvprefetch events-from-trace`), copied until the log holds `--events`,
each copy with its own session, request, event and instance ids and its times shifted (copies
overlap in time, as a fleet's deployments do), all in event-time order in one JSON Lines file.

Each path runs in a process of its own, its peak RSS sampled with its children's (the Dask
workers' included) every SAMPLE_SECONDS:

- `single`: training.dataset.build_dataset (one MemoryStore, one process), training.train;
- `dask`: training.fleet.build_rows_fleet on a LocalCluster of `--workers` workers (DuckDB
  scans, Polars partitions, the workers replay the shards into Parquet files), then
  training.dask_train.train_dask (lightgbm.dask) with the workers reading those files.

`engines`: the columnar step alone (read, parse ts/type/session, dedupe, order) by Polars and by
DuckDB on the log. `quality`: both models' Brier score and log loss on the same held-out part
(the last 20% of the log's time span); equal within QUALITY_TOLERANCE. `--dask-only` skips the
single path, for a log too big for one process.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._util import machine

SAMPLE_SECONDS = 0.2
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


def fleet_log(bases: list[Path], events: int, out: Path) -> int:
    """Copies of the base logs with shifted ids and times, until `events`; in ts order."""
    import polars as pl

    pattern = r'^\{"event_id":"([^"]*)","ts":([^,]+),(.*)$'
    parsed = []
    for base in bases:
        lines = pl.read_csv(
            base, has_header=False, separator="\x01", quote_char=None, new_columns=["line"]
        )
        parts = lines.select(pl.col("line").str.extract_groups(pattern).alias("g")).unnest("g")
        parts.columns = ["event_id", "ts", "rest"]
        parsed.append(parts.with_columns(pl.col("ts").cast(pl.Float64)))
    per_copy = sum(p.height for p in parsed)
    copies = -(-events // per_copy)
    frames = []
    for k in range(copies):
        # Copies start a minute apart in an hour, then 7 s later each hour: they overlap.
        offset = (k % 60) * 60.0 + (k // 60) * 7.0
        for b, parts in enumerate(parsed):
            tag = f"c{k}{'ab'[b]}"
            rest = (
                pl.col("rest")
                .str.replace_all('"session_id":"', f'"session_id":"{tag}-', literal=True)
                .str.replace_all('"request_id":"', f'"request_id":"{tag}-', literal=True)
                .str.replace_all('"instance_id":"', f'"instance_id":"{tag}-', literal=True)
            )
            frames.append(
                parts.select(
                    (pl.col("ts") + offset).alias("ts"),
                    pl.concat_str(
                        pl.lit(f'{{"event_id":"{tag}-'),
                        pl.col("event_id"),
                        pl.lit('","ts":'),
                        (pl.col("ts") + offset).cast(pl.String),
                        pl.lit(","),
                        rest,
                    ).alias("line"),
                )
            )
    fleet = pl.concat(frames).head(events).sort("ts", maintain_order=True)
    fleet.select("line").write_csv(out, include_header=False, quote_style="never")
    return fleet.height


def _path_single(log: Path, max_rounds: int) -> dict[str, Any]:
    from training import train
    from training.dataset import build_dataset

    t = time.perf_counter()
    rows = build_dataset([log])
    build = time.perf_counter() - t
    t = time.perf_counter()
    model = train(rows, num_boost_round=max_rounds)
    return _result(len(rows), model, build, time.perf_counter() - t)


def _path_dask(log: Path, max_rounds: int, workers: int) -> dict[str, Any]:
    from training.dask_train import dask_client, train_dask
    from training.fleet import build_rows_fleet

    with dask_client(f"local:{workers}") as client, tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        rows = build_rows_fleet([log], Path(tmp), workers=workers, client=client)
        build = time.perf_counter() - t
        t = time.perf_counter()
        # The workers read the shards' rows themselves: only the validation part comes here.
        model = train_dask(rows, client, num_boost_round=max_rounds)
        fit = time.perf_counter() - t
        return _result(model.data["rows_train"] + model.data["rows_valid"], model, build, fit)


def _result(rows: int, model: Any, build: float, fit: float) -> dict[str, Any]:
    m = model.metrics
    return {
        "rows": rows,
        "build_seconds": round(build, 2),
        "train_seconds": round(fit, 2),
        "best_iteration": m["best_iteration"],
        "valid": {k: m[k] for k in ("rows", "brier", "log_loss", "auc", "brier_of_base_rate")},
    }


def _path_engines(log: Path) -> dict[str, Any]:
    from training.fleet import ordered_events

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in ("polars", "duckdb", "polars", "duckdb"):  # the second round counts
            t = time.perf_counter()
            frame = ordered_events(log, engine, Path(tmp))
            out[engine] = {"seconds": round(time.perf_counter() - t, 2), "events": frame.height}
            del frame
    return out


def _run_path(args: list[str]) -> dict[str, Any]:
    """`args` in a process of its own; its result and the peak RSS of it and its children."""
    import psutil

    # Dask's logs: only their end, and only on a failure.
    errors = tempfile.TemporaryFile()  # noqa: SIM115 - closed below, or with the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.train_fleet", *args],
        stdout=subprocess.PIPE,
        stderr=errors,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    peak = 0
    parent = psutil.Process(proc.pid)
    while proc.poll() is None:
        total = 0
        with contextlib.suppress(psutil.Error):  # a child may end between listing and reading
            for p in [parent, *parent.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    total += p.memory_info().rss
        peak = max(peak, total)
        time.sleep(SAMPLE_SECONDS)
    out = proc.stdout.read() if proc.stdout else b""
    if proc.returncode != 0:
        errors.seek(0)
        tail = errors.read().decode(errors="replace")[-3000:]
        raise RuntimeError(f"bench train-fleet {args[0]} failed ({proc.returncode}):\n{tail}")
    errors.close()
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    result["peak_rss_bytes"] = peak
    return result


def run(
    *,
    events: int,
    workers: int = 2,
    max_rounds: int = 300,
    work_dir: Path | None = None,
    trace_requests: int | None = None,
    paths: tuple[str, ...] = ("single", "dask"),
) -> dict[str, Any]:
    """`paths`: which of single and dask run (a log too big for one process: dask alone)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = work_dir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        log = folder / f"fleet-{events}.jsonl"
        written = fleet_log(base_logs(folder, TRACES, trace_requests), events, log)
        made = time.perf_counter() - t
        engines = _run_path(["engines", str(log)])
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
        "workers": workers,
        "max_rounds": max_rounds,
        "trace_requests": trace_requests,
        "engines": engines,
        **results,
        "quality": quality,
        **machine(),
    }


def _main(argv: list[str]) -> None:
    path, log = argv[0], Path(argv[1])
    if path == "engines":
        result = _path_engines(log)
    elif path == "single":
        result = _path_single(log, int(argv[2]))
    else:
        result = _path_dask(log, int(argv[2]), int(argv[3]))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
