"""Training rows from a fleet's event logs: a columnar engine partitions, processes replay.

`build_dataset` (training/dataset.py) replays a whole log through one MemoryStore in one
process. Here DuckDB (the default; Polars, in memory, is the other engine) reads each log's
lines as text into a database file, pulls `ts`, `type`, `session_id` and `event_id` out of the
JSON, drops repeated event ids, and streams the lines out ordered by (session-shard, event
time, file order: load_events' order), each shard (a hash of session_id) to a file of its own:
out of core, under a memory limit, so the log is never in this process's memory. Each shard is
replayed by the same `rows_from_events`, in a worker process (or a Dask worker, or this process),
through its own MemoryStore and app.predict.features: a session's features depend on its own
events only, so the shard computes them as the whole log would. Shards are capped at
EVENTS_PER_SHARD events: a replay holds its shard's events as objects.

The deployment's features (DeploymentSignals) depend on the whole stream. They are computed in
one streaming pass over the log's request_routed and session_signal lines (the only events they
read), in the same order, through the same DeploymentSignals, and kept as a step function of
event time (an entry where they change): a shard's decision at `ts` reads the features after the
last of those events at or before `ts`, what the single-process replay reads. So the rows are the
single-process rows, in the same order (tests/training/test_fleet.py checks equality).

The tool features (ToolDurations) depend on the whole stream too: every session's runs make its
tools' distributions. The same pass writes the events ToolDurations reads (routed, signals,
closed) to a file of their own, with every event's time (expiry runs by the newest event time);
each shard replays them through its own ToolDurations as its decisions come (ToolsAt), so it
reads what the single-process replay reads. Only for a log with signals: without one no tool
runs, and the features are NaN.

Events without a session (blocks stored or removed without one, instance status, orders) do
not change a session's view, so the shards skip them; events that carry sessions only inside
(vllm_kv_events) go to every shard.
"""

from __future__ import annotations

import bisect
import math
import multiprocessing
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from app.core.config import Settings
from app.core.errors import EventLogError
from app.ingest.eventlog import encode_events, list_segments, read_events
from app.predict.features import (
    DEPLOYMENT_FEATURES,
    NAN,
    SIGNAL_FOLLOW_SECONDS,
    DeploymentSignals,
    tool_features,
)
from app.predict.tool_durations import ToolDurations, tool_durations_for
from kvprefetch_client.events import Event, RequestRouted, SessionSignal, event_adapter
from training.dataset import META_COLUMNS, gc_paused, load_events, rows_from_events
from training.lineage import log_record

ENGINES = ("polars", "duckdb")
# Events whose sessions are inside the event (a vLLM batch): every shard gets them.
EVERY_SHARD_TYPES = ("vllm_kv_events",)
# The events DeploymentSignals reads (routed, signals) and ToolDurations (those and closed).
DEPLOYMENT_TYPES = ("request_routed", "session_signal", "session_closed")
# A shard's replay holds its events as objects and its store (about 1.2 GB for 200,000 events,
# bench/README.md): shards of at most this many keep a replay's memory whatever the log's size.
EVENTS_PER_SHARD = 200_000
# DuckDB's memory while it orders and shards a log; past it, it spills under the work directory
# (a fleet's log can be larger than the machine's memory).
DUCKDB_MEMORY_LIMIT = "2GB"
# Lines fetched from DuckDB at a time (the shards' files, the deployment's events).
FETCH_ROWS = 50_000
# The longest log line DuckDB reads: a whole posted batch is at most max_body_bytes (32 MiB).
# Not more: DuckDB's read buffer is a multiple of it (16x unless set), and a 1.6 GB buffer
# broke a 2 GB memory limit on a 5.6 GB log.
MAX_LINE_BYTES = 40_000_000

Stage = Callable[[str], None]


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


def _shard_log_polars(
    log: Path, folder: Path, *, shards: int | None, workers: int, stage: Stage
) -> ShardedLog:
    """shard_log_duckdb's result, the log held in memory by Polars."""
    import polars as pl

    stage("scan")
    ordered = ordered_events(log, "polars", folder)
    n = shards or shard_count(ordered.height, workers)
    stage("shard")
    paths = partition(ordered, n, folder)
    stage("timeline")
    deployment = ordered.filter(pl.col("type").is_in(DEPLOYMENT_TYPES))
    signalled = deployment.filter(pl.col("type") == "session_signal").height
    lines = deployment.get_column("line").to_list()
    tools = folder / TOOL_EVENTS if signalled else None
    ts, feats, signals = deployment_timeline(
        [lines], follow_through=bool(signalled), tool_events=tools
    )
    span = (float(ordered["ts"][0]), float(ordered["ts"][-1]))
    every_ts = ordered.get_column("ts").to_numpy() if signalled else None
    return ShardedLog(paths, span, ordered.height, ts, feats, signals, every_ts)


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


def shard_count(events: int, workers: int) -> int:
    """4 shards a worker (smaller shards even out their loads), more for a long log."""
    return max(4 * max(workers, 1), math.ceil(events / EVENTS_PER_SHARD))


_READ_LINES = """
    CREATE OR REPLACE TABLE lines AS
    SELECT line,
           CAST(json_extract(line, '$.ts') AS DOUBLE) AS ts,
           json_extract_string(line, '$.type') AS type,
           json_extract_string(line, '$.session_id') AS session_id,
           json_extract_string(line, '$.event_id') AS event_id
    FROM read_csv({names}, columns = {{'line': 'VARCHAR'}}, delim = '\x01', quote = '',
                  escape = '', header = false, auto_detect = false,
                  max_line_size = {max_line}, buffer_size = {buffer})
"""


def _read_lines(paths: Sequence[Path]) -> str:
    names = "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in paths) + "]"
    return _READ_LINES.format(names=names, max_line=MAX_LINE_BYTES, buffer=2 * MAX_LINE_BYTES)


@dataclass
class ShardedLog:
    """A log split into session-shards' files (each in event-time order), its time span, its
    event count and the deployment's step function with the signals' follow-through."""

    shards: list[Path]
    span: tuple[float, float]
    events: int
    ts: np.ndarray
    feats: np.ndarray
    signals: dict[str, dict[str, int]]
    # A log with signals: every event's time, in order (its tool events are in TOOL_EVENTS).
    every_ts: np.ndarray | None = None


def shard_log_duckdb(
    log: Path,
    folder: Path,
    *,
    shards: int | None = None,
    workers: int = 2,
    memory_limit: str = DUCKDB_MEMORY_LIMIT,
    stage: Stage | None = None,
) -> ShardedLog:
    """ordered_events and partition without the log in memory: DuckDB (a database file under
    `folder`, spilling past `memory_limit`) reads the lines, drops repeated event ids (the
    first stays), and streams them out ordered by (shard, ts, file order), one shard's file
    after another; then the deployment's events, in (ts, file order), through
    deployment_timeline."""
    import duckdb

    files = [p for p in log_files(log) if p.stat().st_size]
    if not files:
        raise EventLogError(f"{log}: the log holds no events")
    say = stage or (lambda _: None)
    db = folder / "scan.duckdb"
    con = duckdb.connect(str(db))
    try:
        spill = folder / "spill"
        con.execute("SET enable_progress_bar = false").fetchall()  # stdout is the caller's
        con.execute(f"SET memory_limit = '{memory_limit}'").fetchall()
        con.execute("SET temp_directory = '" + str(spill).replace("'", "''") + "'").fetchall()
        # Kept (the default) for rowid: the lines' file order.
        con.execute("SET preserve_insertion_order = true").fetchall()
        say("scan")
        con.execute(_read_lines(files)).fetchall()
        if _one(con, "SELECT count(*) FROM lines WHERE type IS NULL")[0]:
            # Whole posted batches ({"events": [...]}): expanded by the log's own reader first.
            canonical = _canonical_copy(files, folder / f"{log.name}.canonical.jsonl")
            con.execute(_read_lines(canonical)).fetchall()
        say("dedupe")
        con.execute(
            """
            CREATE TABLE events AS
            SELECT rowid AS ord, ts, type, session_id, line FROM lines
            WHERE rowid IN (SELECT min(rowid) FROM lines GROUP BY event_id)
            """
        ).fetchall()
        con.execute("DROP TABLE lines").fetchall()
        count, first, last = _one(con, "SELECT count(*), min(ts), max(ts) FROM events")
        if not count:
            raise EventLogError(f"{log}: the log holds no events")
        n = shards or shard_count(count, workers)
        every = ", ".join(f"'{t}'" for t in EVERY_SHARD_TYPES)
        say("shard")
        reader: Any = con.sql(
            f"""
            WITH tagged AS (
                SELECT CASE WHEN type IN ({every}) THEN -1
                            WHEN session_id IS NULL THEN -2
                            ELSE CAST(hash(session_id) % {n} AS BIGINT) END AS shard,
                       ts, ord, line
                FROM events
            )
            SELECT shard, line FROM (
                SELECT shard, ts, ord, line FROM tagged WHERE shard >= 0
                UNION ALL
                SELECT s.i AS shard, ts, ord, line FROM tagged, range({n}) s(i)
                WHERE tagged.shard = -1
            ) ORDER BY shard, ts, ord
            """
        ).to_arrow_reader(FETCH_ROWS)
        paths = _write_shards(reader, folder)
        say("timeline")
        kinds = ", ".join(f"'{t}'" for t in DEPLOYMENT_TYPES)
        (signalled,) = _one(con, "SELECT count(*) FROM events WHERE type = 'session_signal'")
        reader = con.sql(
            f"SELECT line FROM events WHERE type IN ({kinds}) ORDER BY ts, ord"
        ).to_arrow_reader(FETCH_ROWS)
        batches = (b.column(0).to_pylist() for b in reader)
        tools = folder / TOOL_EVENTS if signalled else None
        ts, feats, signals = deployment_timeline(
            batches, follow_through=bool(signalled), tool_events=tools
        )
        every_ts = None
        if signalled:
            every_ts = con.sql("SELECT ts FROM events ORDER BY ts, ord").fetchnumpy()["ts"]
    finally:
        con.close()
        db.unlink(missing_ok=True)
        shutil.rmtree(folder / "spill", ignore_errors=True)
    span = (float(first), float(last))
    return ShardedLog(paths, span, int(count), ts, feats, signals, every_ts)


def _one(con: Any, sql: str) -> tuple[Any, ...]:
    rows = con.execute(sql).fetchall()  # all: a result left pending blocks the connection
    return tuple(rows[0])


def _write_shards(reader: Any, folder: Path) -> list[Path]:
    """Each shard's lines (the batches come ordered by shard) to shard-NNNN.jsonl."""
    paths: list[Path] = []
    out: Any = None
    current = None
    try:
        for batch in reader:
            shard = batch.column(0).to_numpy()
            lines = batch.column(1).to_pylist()
            cuts = [0, *(np.flatnonzero(np.diff(shard)) + 1).tolist(), len(lines)]
            for a, b in zip(cuts, cuts[1:]):
                if shard[a] != current:
                    if out is not None:
                        out.close()
                    current = int(shard[a])
                    paths.append(folder / f"shard-{current:04d}.jsonl")
                    out = open(paths[-1], "w")  # noqa: SIM115 - closed at the next shard or below
                out.write("\n".join(lines[a:b]))
                out.write("\n")
    finally:
        if out is not None:
            out.close()
    return paths


def _same(a: Sequence[float], b: Sequence[float]) -> bool:
    return all(x == y or (x != x and y != y) for x, y in zip(a, b))  # NaN equals NaN here


def deployment_timeline(
    batches: Iterable[Sequence[str]],
    *,
    follow_through: bool = True,
    tool_events: Path | None = None,
) -> tuple[np.ndarray, np.ndarray, dict[str, dict[str, int]]]:
    """DEPLOYMENT_FEATURES after the log's routed, signal and closed events (`batches` of their
    lines, in the log's order), as a step function: (ts, features) where they change, and the
    signals' follow-through counts (training.dataset.signal_follow_through's, from the same
    events). One event at a time: only the step function and the arrivals' times are kept.
    `tool_events`: where the lines are written as they pass, for ToolsAt."""
    deployment = DeploymentSignals()
    out = open(tool_events, "w") if tool_events is not None else None  # noqa: SIM115
    ts: list[float] = []
    feats: list[list[float]] = []
    arrivals: dict[str, list[float]] = defaultdict(list)
    signals: list[tuple[str, float, str]] = []
    for batch in batches:
        if out is not None:
            out.writelines(f"{line}\n" for line in batch)
        for line in batch:
            e = event_adapter.validate_json(line)
            deployment.observe([e])
            if follow_through:
                if isinstance(e, RequestRouted):
                    arrivals[e.session_id].append(e.ts)
                elif isinstance(e, SessionSignal):
                    signals.append((e.session_id, e.ts, e.kind))
            now = deployment.features()
            # An unchanged step reads the same from the one before it: not kept.
            if feats and _same(now, feats[-1]):
                continue
            ts.append(e.ts)
            feats.append(now)
    if out is not None:
        out.close()
    for times in arrivals.values() if signals else ():
        times.sort()
    counts: dict[str, dict[str, int]] = {}
    for session_id, at, kind in signals:
        times = arrivals.get(session_id, [])
        k = bisect.bisect_right(times, at)
        followed = k < len(times) and times[k] - at <= SIGNAL_FOLLOW_SECONDS
        entry = counts.setdefault(kind, {"signals": 0, "followed": 0})
        entry["signals"] += 1
        entry["followed"] += int(followed)
    shape = (len(feats), len(DEPLOYMENT_FEATURES))
    steps = np.asarray(feats, dtype=np.float64).reshape(shape)
    return np.asarray(ts, dtype=np.float64), steps, counts


class DeploymentAt:
    """The step function: the features after the last timeline event at or before `ts`."""

    def __init__(self, ts: np.ndarray, feats: np.ndarray) -> None:
        self.ts = ts
        self.feats = feats
        self.before = [NAN] * len(DEPLOYMENT_FEATURES)
        # The last step read (its ts bounds, its features as a list): a shard's decisions come
        # in time order, most of them within the step of the one before.
        self._low, self._high = -math.inf, (float(ts[0]) if len(ts) else math.inf)
        self._at = self.before

    def __call__(self, ts: float) -> list[float]:
        if not self._low <= ts < self._high:
            k = int(np.searchsorted(self.ts, ts, side="right"))
            self._low = float(self.ts[k - 1]) if k else -math.inf
            self._high = float(self.ts[k]) if k < len(self.ts) else math.inf
            self._at = self.before if k == 0 else self.feats[k - 1].tolist()
        return self._at


# The whole log's tool events (next to its deployment.npz), for a log with signals.
TOOL_EVENTS = "tools.jsonl"
# Every event's time, in the log's order, for a log with signals (empty without).
EVERY_TS = "every_ts.npy"


class ToolsAt:
    """TOOL_FEATURES of a session at `ts` as the whole log's ToolDurations reads them then: the
    log's tool events up to `ts` observed, and event time moved to its last event at or before
    `ts` (the events between, which ToolDurations only takes the time of, skipped). Asked in
    time order (rows_from_events asks at its decisions, sorted). `events` are read as they are
    needed (the whole log's tool events: a shard holds none of them it has observed)."""

    def __init__(self, events: Iterable[Event], every_ts: np.ndarray, tools: ToolDurations):
        self.events = iter(events)
        self.every_ts = every_ts
        self.tools = tools
        self._pending: Event | None = next(self.events, None)

    def __call__(self, session_id: str, ts: float, horizons: Sequence[float]) -> list[list[float]]:
        due = []
        pending = self._pending
        while pending is not None and pending.ts <= ts:
            due.append(pending)
            pending = next(self.events, None)
        self._pending = pending
        self.tools.observe(due)
        k = int(np.searchsorted(self.every_ts, ts, side="right"))
        if k:
            self.tools.advance(float(self.every_ts[k - 1]))
        return tool_features(self.tools, session_id, ts, horizons)


def shard_rows(
    shard: Path, log_name: str, span: tuple[float, float], timeline: Path, out: Path
) -> int:
    """Replay one shard (in a worker); write its rows, if any, to `out` (Parquet); the count."""
    with np.load(timeline) as t:
        deployment_at = DeploymentAt(t["ts"], t["feats"])
    # Mapped, not read: every event's time (8 bytes an event) in each shard's process.
    every_ts = np.load(timeline.parent / EVERY_TS, mmap_mode="r")
    tool_file = timeline.parent / TOOL_EVENTS
    tools_at = None  # a log without signals has no tool runs: the shard's own say so
    if len(every_ts) and tool_file.exists():
        # Of the KVP_TOOLS_* settings, as the service's. Read as the decisions come (the log's
        # file is in order, each event id once).
        tools_at = ToolsAt(read_events([tool_file]), every_ts, tool_durations_for(Settings()))
    with gc_paused():  # the shard's events live to its end, as the replay's objects do
        events = load_events(shard)
    rows = rows_from_events(
        events,
        log_name=log_name,
        span=span,
        deployment_at=deployment_at,
        tools_at=tools_at,
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
    # Each log's path, hash and span (training/lineage.py), DataFrame.attrs["logs"] elsewhere.
    lineage: list[dict[str, Any]] = field(default_factory=list)

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
    memory_limit: str = DUCKDB_MEMORY_LIMIT,
    stage: Stage | None = None,
) -> FleetRows:
    """Replay each log's session-shards in parallel; the rows stay in Parquet under `work_dir`.

    `client`: a dask.distributed Client to replay the shards on (its workers must see
    `work_dir`); else a pool of `workers` processes (0: this process replays them, one after
    another). `shards` defaults to shard_count's. `engine` "duckdb" orders and shards the log
    out of core (`memory_limit`); "polars" does it in memory. `stage(name)` hears each step
    begin (scan, dedupe, shard, timeline, replay)."""
    if engine not in SCANNERS:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}")
    say = stage or (lambda _: None)
    rows = FleetRows([], [])
    for n, log in enumerate(Path(p) for p in logs):
        folder = work_dir / f"log-{n:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        if engine == "duckdb":
            sharded = shard_log_duckdb(
                log, folder, shards=shards, workers=workers, memory_limit=memory_limit, stage=say
            )
        else:
            sharded = _shard_log_polars(log, folder, shards=shards, workers=workers, stage=say)
        span, paths = sharded.span, sharded.shards
        rows.lineage.append(log_record(log, sharded.events, *span))
        timeline = folder / "deployment.npz"
        every_ts = sharded.every_ts if sharded.every_ts is not None else np.zeros(0)
        np.savez(timeline, ts=sharded.ts, feats=sharded.feats)
        np.save(folder / EVERY_TS, every_ts)
        for kind, counts in sharded.signals.items():
            total = rows.signals.setdefault(kind, {"signals": 0, "followed": 0})
            total["signals"] += counts["signals"]
            total["followed"] += counts["followed"]
        del sharded
        say("replay")
        outs = [p.with_suffix(".parquet") for p in paths]
        args = [(p, log.name, span, timeline, o) for p, o in zip(paths, outs)]
        if client is not None:
            futures = [client.submit(shard_rows, *a, pure=False) for a in args]
            client.gather(futures)
        elif workers == 0:
            for a in args:
                shard_rows(*a)
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
    memory_limit: str = DUCKDB_MEMORY_LIMIT,
    stage: Stage | None = None,
) -> pd.DataFrame:
    """The rows of training.dataset.build_dataset (the same, in the same order), built shard by
    shard in parallel (build_rows_fleet) and gathered here."""
    base = Path(tempfile.mkdtemp(prefix="kvp-fleet-")) if work_dir is None else work_dir
    try:
        rows = build_rows_fleet(
            logs,
            base,
            workers=workers,
            shards=shards,
            engine=engine,
            client=client,
            memory_limit=memory_limit,
            stage=stage,
        )
        if stage is not None:
            stage("gather")
        frames = [_log_rows([pd.read_parquet(o) for o in outs]) for outs in rows.logs if outs]
        data = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    finally:
        if work_dir is None:
            shutil.rmtree(base, ignore_errors=True)
    if data.empty:
        raise EventLogError("the logs hold no finished request to learn from")
    data.attrs["signals"] = rows.signals
    data.attrs["logs"] = rows.lineage
    return data


__all__ = [
    "ENGINES",
    "FleetRows",
    "build_dataset_fleet",
    "build_rows_fleet",
    "ordered_events",
    "partition",
    "shard_count",
    "shard_log_duckdb",
]
