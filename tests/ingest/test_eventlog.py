"""The durable event log: rotation, torn tails, corrupt lines, positions."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.core.errors import CorruptLogError
from app.ingest.eventlog import (
    FileEventLog,
    encode_batch,
    encode_events,
    iter_log,
    list_segments,
    read_events,
)
from app.state import LogPosition
from kvprefetch_client.events import batch_adapter, event_adapter


def closed(i: int):  # type: ignore[no-untyped-def]
    return event_adapter.validate_python(
        {"type": "session_closed", "event_id": f"e{i}", "ts": float(i), "session_id": f"s{i}"}
    )


def test_append_returns_positions_and_reads_back(tmp_path: Path) -> None:
    log = FileEventLog(tmp_path, fsync=False)
    p1 = log.append(encode_events([closed(1), closed(2)]))
    p2 = log.append(encode_events([closed(3)]))
    log.close()
    assert p1.segment == 1 and p2.offset > p1.offset
    read = list(iter_log(tmp_path))
    assert [e.event_id for _, e in read] == ["e1", "e2", "e3"]
    assert read[1][0] == p1 and read[2][0] == p2
    assert [e.event_id for _, e in iter_log(tmp_path, after=p1)] == ["e3"]


def test_segments_rotate_at_the_size_limit(tmp_path: Path) -> None:
    log = FileEventLog(tmp_path, segment_bytes=4096, fsync=True)
    for i in range(200):
        log.append(encode_events([closed(i)]))
    log.close()
    segments = list_segments(tmp_path)
    assert len(segments) > 1
    assert all(p.stat().st_size <= 4096 for _, p in segments)
    assert [e.event_id for _, e in iter_log(tmp_path)] == [f"e{i}" for i in range(200)]
    # Reading from a position in an older segment continues into the newer ones.
    middle = list(iter_log(tmp_path))[99][0]
    assert [e.event_id for _, e in iter_log(tmp_path, after=middle)] == [
        f"e{i}" for i in range(100, 200)
    ]


def test_a_torn_last_line_is_cut_on_open(tmp_path: Path) -> None:
    log = FileEventLog(tmp_path, fsync=False)
    log.append(encode_events([closed(1)]))
    log.close()
    path = list_segments(tmp_path)[-1][1]
    with open(path, "ab") as f:
        f.write(b'{"type": "session_closed", "event_id": "half')
    assert [e.event_id for _, e in iter_log(tmp_path)] == ["e1"]  # readers skip it too
    log = FileEventLog(tmp_path, fsync=False)
    assert path.read_bytes().endswith(b"}\n")
    log.append(encode_events([closed(2)]))
    log.close()
    assert [e.event_id for _, e in iter_log(tmp_path)] == ["e1", "e2"]


def test_a_corrupt_line_names_its_file_and_line(tmp_path: Path) -> None:
    log = FileEventLog(tmp_path, fsync=False)
    log.append(
        encode_events([closed(1)]) + b'{"type": "session_closed", "event_id": "x", "ts": -1, '
        b'"session_id": "s"}\n' + encode_events([closed(3)])
    )
    log.close()
    with pytest.raises(CorruptLogError) as info:
        list(iter_log(tmp_path))
    assert info.value.line == 2
    assert str(info.value).endswith(
        "events-00000001.jsonl:2: ts: Input should be greater than or equal to 0"
    )


def test_a_logged_batch_reads_back_whatever_numbers_the_ingest_accepted(tmp_path: Path) -> None:
    # A token id past 64 bits, and 1e400 in a field of a vLLM event that is ignored: the ingest's
    # parse takes both, so a restart replaying the log must too (found by tests/api/test_fuzz.py).
    body = (
        b'{"events": [{"type": "vllm_kv_events", "event_id": "v", "ts": 1, "instance_id": "gpu-0", '
        b'"events": [{"type": "BlockStored", "block_hashes": [1], "block_size": 16, '
        b'"token_ids": [123456789012345678901234567890], "extra_keys": 1e400}]}]}'
    )
    posted = batch_adapter.validate_json(body).events
    log = FileEventLog(tmp_path, fsync=False)
    log.append(encode_batch(body))
    log.append(encode_events(posted))
    log.close()
    assert [e for _, e in iter_log(tmp_path)] == posted * 2


def test_read_events_takes_files_and_directories(tmp_path: Path) -> None:
    log = FileEventLog(tmp_path / "log", fsync=False)
    log.append(encode_events([closed(1), closed(2)]))
    log.close()
    loose = tmp_path / "extra.jsonl"
    loose.write_bytes(encode_events([closed(3)]) + b"not json\n")
    with pytest.raises(CorruptLogError, match=r"extra.jsonl:2: not JSON"):
        list(read_events([tmp_path / "log", loose]))
    loose.write_bytes(encode_events([closed(3)]))
    assert [e.event_id for e in read_events([tmp_path / "log", loose])] == ["e1", "e2", "e3"]


def test_position_of_an_empty_log(tmp_path: Path) -> None:
    log = FileEventLog(tmp_path, fsync=False)
    assert log.position == LogPosition(1, 0)
    assert log.append(b"") == LogPosition(1, 0)
    log.close()


def test_a_failed_append_leaves_no_partial_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.core.errors import EventLogError
    from app.ingest import eventlog

    log = FileEventLog(tmp_path, fsync=True)
    log.append(encode_events([closed(1)]))

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(eventlog.os, "fsync", disk_full)
    with pytest.raises(EventLogError, match="No space left on device"):
        log.append(encode_events([closed(2)]))
    monkeypatch.undo()
    log.append(encode_events([closed(3)]))
    log.close()
    assert [e.event_id for _, e in iter_log(tmp_path)] == ["e1", "e3"]
