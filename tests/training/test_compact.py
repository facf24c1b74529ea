"""`kvprefetch log compact`: an event log (segments, posted batches, a repeated event) to one
Parquet file that pandas, Polars and DuckDB read, each event once, nothing lost."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pandas as pd
import polars as pl
import pytest
from typer.testing import CliRunner

from app.ingest.eventlog import FileEventLog, encode_batch, encode_events, read_events
from kvprefetch_cli import cli
from kvprefetch_client.events import event_adapter
from tests.training.test_signals import chat_with_signals
from training.compact import compact_log


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "log"
    events = chat_with_signals(30, seed=4)
    log = FileEventLog(folder, segment_bytes=20_000, fsync=False)
    body = b'{"events": [' + encode_events(events[:40]).strip().replace(b"\n", b",") + b"]}"
    log.append(encode_batch(body))
    log.append(encode_events(events[40:]))
    log.append(encode_events(events[:2]))  # sent again
    log.close()
    return folder


def test_compacted_log_reads_the_same_in_pandas_polars_and_duckdb(
    tmp_path: Path, log_dir: Path
) -> None:
    out = tmp_path / "events.parquet"
    result = CliRunner().invoke(
        cli, ["log", "compact", "--events", str(log_dir), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    unique = list({e.event_id: e for e in reversed(list(read_events([log_dir])))}.values())[::-1]
    expected = sorted(unique, key=lambda e: e.event_id)
    assert f"wrote {len(expected)} events" in result.output

    frame = pd.read_parquet(out)
    assert len(frame) == len(expected) and frame.event_id.is_unique
    assert frame.ts.dtype == "float64"
    polars_frame = pl.read_parquet(out)
    assert polars_frame.height == len(expected)
    by_type = dict(duckdb.sql(f"SELECT type, count(*) FROM '{out}' GROUP BY type").fetchall())
    assert by_type == frame.type.value_counts().to_dict()
    signals = frame[frame.type == "session_signal"]
    assert set(signals.kind) == {"typing", "opened"}
    # The whole event survives in `event`: the log's own events, field for field.
    back = sorted(
        (event_adapter.validate_json(line) for line in polars_frame["event"].to_list()),
        key=lambda e: e.event_id,
    )
    assert back == expected
    routed = frame[frame.type == "request_routed"]
    assert routed.prompt_tokens.notna().all() and routed.session_id.notna().all()


def test_an_empty_log_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "x.parquet"
    result = CliRunner().invoke(cli, ["log", "compact", "--events", str(empty), "--out", str(out)])
    assert result.exit_code == 2 and "no events" in result.output
    assert not out.exists()
    with pytest.raises(Exception, match="no events"):
        compact_log([empty], out)
