"""Training rows from a fleet's event logs: a columnar engine partitions, processes replay.

`build_dataset` (training/dataset.py) replays a whole log through one MemoryStore in one
process. Here a columnar engine (DuckDB by default; Polars, measured slower on the same lines by
bench/train_fleet.py, is the other) reads each log's lines as text, pulls `ts`, `type`,
`session_id` and `event_id` out of the JSON, drops repeated event ids, orders by event time
(file order breaks ties, as load_events does); Polars writes the lines of each session-shard (a
hash of session_id) to a file of its own. Each shard is replayed by the same
`rows_from_events`, in a worker process (or a Dask worker), through its own MemoryStore and
app.predict.features: a session's features depend on its own events only, so the shard
computes them as the whole log would.

The deployment's features (DeploymentSignals) depend on the whole stream. They are computed in
one streaming pass over the log's request_routed and session_signal lines (the only events they
read), in the same order, through the same DeploymentSignals, and kept as a step function of
event time: a shard's decision at `ts` reads the features after the last of those events at or
before `ts`, what the single-process replay reads. So the rows are the single-process rows, in
the same order (tests/training/test_fleet.py checks equality).

Events without a session (blocks stored or removed without one, instance status, orders) do
not change a session's view, so the shards skip them; events that carry sessions only inside
(vllm_kv_events) go to every shard.
"""

from __future__ import annotations

import bisect
import multiprocessing
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from app.core.errors import EventLogError
from app.ingest.eventlog import encode_events, list_segments, read_events
from app.predict.features import DEPLOYMENT_FEATURES, NAN, DeploymentSignals
from kvprefetch_client.events import event_adapter
from training.dataset import META_COLUMNS, load_events, rows_from_events, signal_follow_through

ENGINES = ("polars", "duckdb")
# Events whose sessions are inside the event (a vLLM batch): every shard gets them.
EVERY_SHARD_TYPES = ("vllm_kv_events",)
DEPLOYMENT_TYPES = ("request_routed", "session_signal")


def log_files(log: Path) -> list[Path]:
    """A log's segment files (a directory) or the file itself."""
    if log.is_dir():
        return [p for _, p in list_segments(log)]
    return [log]


def _canonical_copy(files: Sequence[Path], out: Path) -> list[Path]:
    """The files rewritten one canonical event a line (batch lines expanded), for the engines."""
    with open(out, "wb") as f:
        batch = []
        for e in read_events(list(files)):
            batch.append(e)
            if len(batch) >= 10_000:
                f.write(encode_events(batch))
                batch = []
        f.write(encode_events(batch))
    return [out]


def scan_polars(files: Sequence[Path]) -> Any:
    """Polars: the lines with ts, type, session_id and event_id; batch lines keep a null type."""
    import polars as pl

    frames = [
        pl.read_csv(
            p,
            has_header=False,
            separator="\x01",  # a control character never appears raw in a JSON line
            quote_char=None,
            new_columns=["line"],
            schema_overrides={"line": pl.String},
        )
        for p in files
        if p.stat().st_size
    ]
    lines = pl.concat(frames) if frames else pl.DataFrame({"line": []}, schema={"line": pl.String})
    return lines.with_columns(
        pl.col("line").str.json_path_match("$.ts").cast(pl.Float64).alias("ts"),
        pl.col("line").str.json_path_match("$.type").alias("type"),
        pl.col("line").str.json_path_match("$.session_id").alias("session_id"),
        pl.col("line").str.json_path_match("$.event_id").alias("event_id"),
    )


def scan_duckdb(files: Sequence[Path]) -> Any:
    """DuckDB: the same columns as scan_polars, handed over as Arrow."""
    import duckdb
    import polars as pl

    names = [str(p) for p in files if p.stat().st_size]
    if not names:
        return scan_polars([])
    con = duckdb.connect()
    try:
        table = con.sql(
            """
            SELECT line,
                   CAST(json_extract(line, '$.ts') AS DOUBLE) AS ts,
                   json_extract_string(line, '$.type') AS type,
                   json_extract_string(line, '$.session_id') AS session_id,
                   json_extract_string(line, '$.event_id') AS event_id
            FROM read_csv(?, columns = {'line': 'VARCHAR'}, delim = '\x01', quote = '',
                          escape = '', header = false, auto_detect = false,
                          max_line_size = 100000000)
            """,
            params=[names],
        ).to_arrow_table()
    finally:
        con.close()
    return pl.from_arrow(table)


SCANNERS: dict[str, Callable[[Sequence[Path]], Any]] = {
    "polars": scan_polars,
    "duckdb": scan_duckdb,
}


def ordered_events(log: Path, engine: str, work_dir: Path) -> Any:
    """A log's lines, each event id once (the first), in event-time order, file order on ties."""
    import polars as pl

    files = log_files(log)
    if not files:
        raise EventLogError(f"{log}: the log holds no events")
    frame = SCANNERS[engine](files)
    if frame.filter(pl.col("type").is_null()).height:
        # Whole posted batches ({"events": [...]}): expanded by the log's own reader first.
        frame = SCANNERS[engine](_canonical_copy(files, work_dir / f"{log.name}.canonical.jsonl"))
    frame = (
        frame.with_row_index("order")
        .unique(subset="event_id", keep="first", maintain_order=True)
        .sort(["ts", "order"])
    )
    if frame.height == 0:
        raise EventLogError(f"{log}: the log holds no events")
    return frame


def partition(frame: Any, shards: int, out_dir: Path) -> list[Path]:
    """Write each session-shard's lines (and every-shard events) to its own file, in order."""
    import polars as pl

    shard = (pl.col("session_id").hash(seed=0) % shards).cast(pl.Int64)
    every = pl.col("type").is_in(EVERY_SHARD_TYPES)
    tagged = frame.select(
        "line",
        pl.when(every).then(-1).when(pl.col("session_id").is_null()).then(-2).otherwise(shard),
    )
    tagged = tagged.rename({tagged.columns[1]: "shard"})
    paths = []
    for i in range(shards):
        part = tagged.filter(pl.col("shard").is_in([i, -1]))
        if part.height == 0:
            continue
        path = out_dir / f"shard-{i:04d}.jsonl"
        with open(path, "w") as f:
            f.write("\n".join(part.get_column("line").to_list()))
            f.write("\n")
        paths.append(path)
    return paths


def deployment_timeline(frame: Any) -> tuple[np.ndarray, np.ndarray, list[Any]]:
    """DEPLOYMENT_FEATURES after each routed or signal event of the log, in the log's order:
    (ts, features), and the events (for the signals' follow-through)."""
    import polars as pl

    lines = frame.filter(pl.col("type").is_in(DEPLOYMENT_TYPES)).get_column("line").to_list()
    deployment = DeploymentSignals()
    events = [event_adapter.validate_json(line) for line in lines]
    ts = np.empty(len(events), dtype=np.float64)
    feats = np.empty((len(events), len(DEPLOYMENT_FEATURES)), dtype=np.float64)
    for i, e in enumerate(events):
        deployment.observe([e])
        ts[i] = e.ts
        feats[i] = deployment.features()
    return ts, feats, events


class DeploymentAt:
    """The step function: the features after the last timeline event at or before `ts`."""

    def __init__(self, ts: np.ndarray, feats: np.ndarray) -> None:
        self.ts = ts.tolist()
        self.feats = feats
        self.before = [NAN] * len(DEPLOYMENT_FEATURES)

    def __call__(self, ts: float) -> list[float]:
        k = bisect.bisect_right(self.ts, ts)
        return self.before if k == 0 else self.feats[k - 1].tolist()


def shard_rows(
    shard: Path, log_name: str, span: tuple[float, float], timeline: Path, out: Path
) -> int:
    """Replay one shard (in a worker); write its rows, if any, to `out` (Parquet); the count."""
    with np.load(timeline) as t:
        deployment_at = DeploymentAt(t["ts"], t["feats"])
    rows = rows_from_events(
        load_events(shard), log_name=log_name, span=span, deployment_at=deployment_at
    )
    if not rows.empty:  # an empty frame's columns have no types to agree with the others'
        rows.to_parquet(out, index=False)
    return len(rows)


# The single-process replay's row order: decisions sorted by (ts, anchor ts, session, checkpoint,
# anchor), then horizons. At one decision ts a later anchor is a smaller checkpoint.
ROW_ORDER = ["decision_ts", "checkpoint_seconds", "session_id", "anchor", "horizon_seconds"]
ROW_ASCENDING = [True, False, True, True, True]


def _log_rows(shards: list[pd.DataFrame]) -> pd.DataFrame:
    """A log's shards' rows as rows_from_events gives the whole log's: in its order, and each
    text column typed from the whole column (a shard's all-None column reads back as object)."""
    rows = pd.concat(shards, ignore_index=True)
    rows = rows.sort_values(ROW_ORDER, ascending=ROW_ASCENDING, kind="stable")
    rows = rows.reset_index(drop=True)
    for name in META_COLUMNS:
        if rows[name].dtype == object:
            rows[name] = rows[name].tolist()
    return rows


@dataclass
class FleetRows:
    """Rows left where the workers wrote them: one Parquet file per shard, per log (in the logs'
    order), and the signals' follow-through counts (DataFrame.attrs["signals"] elsewhere)."""

    logs: list[list[Path]]
    log_names: list[str]
    signals: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def files(self) -> list[Path]:
        return [path for log in self.logs for path in log]


def build_rows_fleet(
    logs: Iterable[Path | str],
    work_dir: Path,
    *,
    workers: int = 2,
    shards: int | None = None,
    engine: str = "duckdb",
    client: Any = None,
) -> FleetRows:
    """Replay each log's session-shards in parallel; the rows stay in Parquet under `work_dir`.

    `client`: a dask.distributed Client to replay the shards on (its workers must see
    `work_dir`); else a pool of `workers` processes. `shards` defaults to 4 per worker (smaller
    shards even out the workers' loads)."""
    if engine not in SCANNERS:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}")
    shards = shards or 4 * max(workers, 1)
    rows = FleetRows([], [])
    for n, log in enumerate(Path(p) for p in logs):
        folder = work_dir / f"log-{n:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        ordered = ordered_events(log, engine, folder)
        span = (float(ordered["ts"][0]), float(ordered["ts"][-1]))
        ts, feats, deployment_events = deployment_timeline(ordered)
        timeline = folder / "deployment.npz"
        np.savez(timeline, ts=ts, feats=feats)
        for kind, counts in signal_follow_through(deployment_events).items():
            total = rows.signals.setdefault(kind, {"signals": 0, "followed": 0})
            total["signals"] += counts["signals"]
            total["followed"] += counts["followed"]
        del deployment_events
        paths = partition(ordered, shards, folder)
        del ordered
        outs = [p.with_suffix(".parquet") for p in paths]
        args = [(p, log.name, span, timeline, o) for p, o in zip(paths, outs)]
        if client is not None:
            futures = [client.submit(shard_rows, *a, pure=False) for a in args]
            client.gather(futures)
        else:
            # Spawned, not forked: a fork of a process running Polars' threads can hang.
            context = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(max_workers=max(workers, 1), mp_context=context) as pool:
                list(pool.map(shard_rows, *zip(*args)))
        rows.logs.append([o for o in outs if o.exists()])
        rows.log_names.append(log.name)
    if not rows.logs:
        raise ValueError("no event logs given")
    return rows


def build_dataset_fleet(
    logs: Iterable[Path | str],
    *,
    workers: int = 2,
    shards: int | None = None,
    engine: str = "duckdb",
    client: Any = None,
    work_dir: Path | None = None,
) -> pd.DataFrame:
    """The rows of training.dataset.build_dataset (the same, in the same order), built shard by
    shard in parallel (build_rows_fleet) and gathered here."""
    base = Path(tempfile.mkdtemp(prefix="kvp-fleet-")) if work_dir is None else work_dir
    try:
        rows = build_rows_fleet(
            logs, base, workers=workers, shards=shards, engine=engine, client=client
        )
        frames = [_log_rows([pd.read_parquet(o) for o in outs]) for outs in rows.logs if outs]
        data = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    finally:
        if work_dir is None:
            shutil.rmtree(base, ignore_errors=True)
    if data.empty:
        raise EventLogError("the logs hold no finished request to learn from")
    data.attrs["signals"] = rows.signals
    return data


__all__ = [
    "ENGINES",
    "FleetRows",
    "build_dataset_fleet",
    "build_rows_fleet",
    "ordered_events",
    "partition",
]
