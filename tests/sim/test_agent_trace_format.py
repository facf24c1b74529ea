"""The agent trace format: Mooncake lines with optional session_id, after_seconds and tool (read,
checked line by line, carried onto the replay's requests; sessions from the trace, not derived)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from sim.replay import build_requests
from sim.traces import TraceError, TraceRequest, load_trace

BASE = {"input_length": 1024, "output_length": 10}


def line(ts: int, hashes: list[int], **extra: object) -> str:
    return orjson.dumps({"timestamp": ts, **BASE, "hash_ids": hashes, **extra}).decode()


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "agent.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_agent_fields_are_read_and_unknown_fields_ignored(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        line(0, [1, 2], session_id="a", note="ignored"),
        line(500, [7], session_id="b"),
        line(3000, [1, 2, 3], session_id="a", after_seconds=2.5, tool="bash", extra={"x": 1}),
        line(9000, [1, 2, 3, 4], session_id="a", after_seconds=0),  # a human turn, at once
    )
    assert load_trace(path) == [
        TraceRequest(0, 0.0, 1024, 10, (1, 2), "a", None, None),
        TraceRequest(1, 0.5, 1024, 10, (7,), "b", None, None),
        TraceRequest(2, 3.0, 1024, 10, (1, 2, 3), "a", 2.5, "bash"),
        TraceRequest(3, 9.0, 1024, 10, (1, 2, 3, 4), "a", 0.0, None),
    ]


def test_a_mooncake_trace_reads_as_before(tmp_path: Path) -> None:
    path = write(tmp_path, line(0, [1]), line(1000, [1, 2]))
    assert load_trace(path) == [
        TraceRequest(0, 0.0, 1024, 10, (1,)),
        TraceRequest(1, 1.0, 1024, 10, (1, 2)),
    ]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (
            [line(0, [1], session_id="a"), line(5, [1, 2], session_id="a", after_seconds=-1)],
            "2: after_seconds must be >= 0, got -1",
        ),
        (
            [line(0, [1], session_id="a"), line(5, [1, 2], session_id="a", after_seconds="3")],
            "2: after_seconds must be a number, got '3'",
        ),
        (
            [line(0, [1], session_id="a"), line(5, [1, 2], session_id="a", after_seconds=True)],
            "2: after_seconds must be a number, got True",
        ),
        ([line(0, [1], session_id=7)], "1: session_id must be a non-empty string, got 7"),
        ([line(0, [1], session_id="")], "1: session_id must be a non-empty string, got ''"),
        ([line(0, [1], session_id="a", tool=3)], "1: tool must be a non-empty string, got 3"),
        (
            [line(0, [1], session_id="a"), line(5, [2])],
            "2: session_id must be on every request or on none (missing here)",
        ),
        (
            [line(0, [1]), line(5, [2], session_id="b")],
            "2: session_id must be on every request or on none (absent on earlier requests)",
        ),
        (
            [line(0, [1], session_id="a"), line(5, [2], session_id="b", after_seconds=1.0)],
            "2: after_seconds on the first request of session 'b'",
        ),
        ([line(0, [1], after_seconds=1.0)], "1: after_seconds needs a session_id"),
    ],
)
def test_a_malformed_agent_field_names_file_line_and_field(
    tmp_path: Path, lines: list[str], message: str
) -> None:
    path = write(tmp_path, *lines)
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value) == f"{path}:{message}"


def test_the_replay_takes_sessions_from_the_trace_and_carries_the_agent_fields() -> None:
    # Request 1 extends request 0's blocks, so a derived session would join them; the trace
    # says two sessions. (Seventy others keep blocks 10 and 11 under the hot-block share.)
    trace = [
        TraceRequest(0, 0.0, 1024, 10, (10, 11), "x"),
        TraceRequest(1, 1.0, 1536, 10, (10, 11, 12), "y"),
        TraceRequest(2, 4.0, 1536, 10, (10, 11, 13), "x", 3.5, "run_tests"),
        *[TraceRequest(3 + i, 5.0 + i, 512, 10, (1000 + i,), f"f{i}") for i in range(70)],
    ]
    requests = build_requests(trace)
    assert [r.session_id for r in requests[:3]] == ["x", "y", "x"]
    assert [(r.after_seconds, r.tool) for r in requests[:3]] == [
        (None, None),
        (None, None),
        (3.5, "run_tests"),
    ]
    # Without them the sessions are derived from the blocks, as for a Mooncake trace.
    plain = [TraceRequest(r.index, r.arrival_seconds, 1024, 10, r.hash_ids) for r in trace]
    assert [r.session_id for r in build_requests(plain)[:3]] == ["s0", "s0", "s0"]


def test_a_trace_half_labelled_in_python_is_refused() -> None:
    trace = [TraceRequest(0, 0.0, 512, 1, (1,), "x"), TraceRequest(1, 1.0, 512, 1, (2,))]
    with pytest.raises(ValueError, match="every request of a trace or on none"):
        build_requests(trace)
