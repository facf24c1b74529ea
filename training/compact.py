"""An event log compacted to one Parquet file, for data scientists (`kvprefetch log compact`).

The log's own reader (app.ingest.eventlog.read_events) reads the segments, so posted batches
and legacy lines come out as the service reads them. One row per event, each event id once,
in file order. The columns every analysis asks for are typed (ts, type, session, request,
instance, token counts, the signal's fields, a block count); `event` keeps the whole canonical
event as JSON, so nothing is lost (block hashes can pass 64 bits, so they stay there). Written
in row groups of ROW_GROUP_EVENTS with zstd: pandas, Polars and DuckDB read it as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.core.errors import EventLogError
from app.ingest.eventlog import read_events
from kvprefetch_client.events import Event

ROW_GROUP_EVENTS = 100_000

# (column, Arrow type name, attribute of the event); missing attributes are nulls.
TYPED_COLUMNS: tuple[tuple[str, str], ...] = (
    ("event_id", "string"),
    ("ts", "float64"),
    ("type", "string"),
    ("session_id", "string"),
    ("request_id", "string"),
    ("instance_id", "string"),
    ("prompt_tokens", "int64"),
    ("output_tokens", "int64"),
    ("context_tokens", "int64"),
    ("kind", "string"),
    ("tool", "string"),
    ("expected_in_seconds", "float64"),
    ("expected_prompt_tokens", "int64"),
    ("order_id", "string"),
    ("status", "string"),
)


def _schema() -> Any:
    import pyarrow as pa

    fields = [pa.field(name, getattr(pa, kind)()) for name, kind in TYPED_COLUMNS]
    return pa.schema([*fields, pa.field("block_count", pa.int64()), pa.field("event", pa.string())])


def _table(events: Sequence[Event], schema: Any) -> Any:
    import pyarrow as pa

    columns: dict[str, list[Any]] = {
        name: [getattr(e, name, None) for e in events] for name, _ in TYPED_COLUMNS
    }
    columns["block_count"] = [
        len(hashes) if (hashes := getattr(e, "block_hashes", None)) is not None else None
        for e in events
    ]
    columns["event"] = [e.__pydantic_serializer__.to_json(e).decode() for e in events]
    return pa.Table.from_pydict(columns, schema=schema)


def compact_log(logs: Sequence[Path], out: Path) -> int:
    """Write the events of `logs` (segment files or log directories) to `out`; the count."""
    import pyarrow.parquet as pq

    schema = _schema()
    seen: set[str] = set()
    written = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(out, schema, compression="zstd") as writer:
        batch: list[Event] = []
        for e in read_events(list(logs)):
            if e.event_id in seen:
                continue
            seen.add(e.event_id)
            batch.append(e)
            if len(batch) >= ROW_GROUP_EVENTS:
                writer.write_table(_table(batch, schema))
                written += len(batch)
                batch = []
        if batch:
            writer.write_table(_table(batch, schema))
            written += len(batch)
    if written == 0:
        out.unlink(missing_ok=True)
        raise EventLogError(f"{', '.join(map(str, logs))}: the log holds no events")
    return written


__all__ = ["ROW_GROUP_EVENTS", "TYPED_COLUMNS", "compact_log"]
