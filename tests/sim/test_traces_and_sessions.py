"""Trace loading (errors name file and line) and session derivation on hand-made chains."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.sessions import derive_sessions, hot_blocks
from sim.traces import TraceError, TraceRequest, load_trace
from tests.conftest import TRACES


def req(i: int, t: float, hashes: list[int]) -> TraceRequest:
    return TraceRequest(
        index=i,
        arrival_seconds=t,
        input_tokens=512 * len(hashes),
        output_tokens=10,
        hash_ids=tuple(hashes),
    )


def test_loads_the_shared_traces() -> None:
    trace = load_trace(TRACES / "mooncake_synthetic.jsonl")
    assert len(trace) == 3993
    assert trace[0].arrival_seconds == 0.0
    assert all(a.arrival_seconds <= b.arrival_seconds for a, b in zip(trace, trace[1:]))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n'
            '{"timestamp": 5',
            "2: not JSON: unexpected end of data: line 1 column 16 (char 15)",
        ),
        ('{"timestamp": 0, "input_length": 1, "output_length": 1}', "1: missing field 'hash_ids'"),
        (
            '{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": []}',
            "1: input_length must be >= 0, got -1",
        ),
        (
            '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": ["a"]}',
            "1: hash_ids must be a list of integers",
        ),
        (
            '{"timestamp": 9, "input_length": 1, "output_length": 1, "hash_ids": []}\n'
            '{"timestamp": 3, "input_length": 1, "output_length": 1, "hash_ids": []}',
            "2: timestamp goes back in time (3 < 9)",
        ),
        ("[1, 2]", "1: a line must be a JSON object"),
        ("", "0: the trace holds no requests"),
    ],
)
def test_a_malformed_line_names_file_and_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value) == f"{path}:{message}"


def test_a_missing_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot open"):
        load_trace(tmp_path / "nope.jsonl")


def test_next_turn_joins_its_parent_despite_a_partial_last_block() -> None:
    trace = [
        req(0, 0, [0, 1, 2, 3]),  # turn 1 of A (block 3 partial)
        req(1, 1, [0, 10, 11]),  # turn 1 of B
        req(2, 5, [0, 1, 2, 4, 5]),  # turn 2 of A: shares 0,1,2 but not the partial 3
        req(3, 6, [0, 10, 11, 12]),  # turn 2 of B
        req(4, 9, [0, 1, 2, 4, 5, 6]),  # turn 3 of A: deepest shared block 5 is held by request 2
        req(5, 9, [0, 20]),  # new session C: shares only the hot root block 0
    ]
    a = derive_sessions(trace, hot_block_share=0.6)
    assert a.hot_blocks == frozenset({0})
    assert a.parents == [None, None, 0, 1, 2, None]
    assert a.session_ids == ["s0", "s1", "s0", "s1", "s0", "s5"]
    assert a.sessions == 3


def test_without_ignoring_hot_blocks_everything_would_merge() -> None:
    trace = [req(0, 0, [0, 1]), req(1, 1, [0, 2]), req(2, 2, [0, 3])]
    assert derive_sessions(trace, hot_block_share=1.01).sessions == 1
    assert derive_sessions(trace, hot_block_share=0.5).sessions == 3


def test_a_branch_stays_in_its_session_and_takes_the_most_recent_holder() -> None:
    trace = [req(0, 0, [1, 2, 3]), req(1, 1, [1, 2, 3, 4]), req(2, 2, [1, 2, 9])]
    a = derive_sessions(trace, hot_block_share=1.01)
    assert a.parents == [None, 0, 1]  # block 2 was last carried by request 1
    assert a.sessions == 1


def test_hot_blocks_must_recur() -> None:
    assert hot_blocks([req(0, 0, [1, 2])], share=0.5) == frozenset()


def test_derived_sessions_on_the_conversation_trace() -> None:
    trace = load_trace(TRACES / "mooncake_conversation_first60.jsonl")
    a = derive_sessions(trace)
    continued = sum(p is not None for p in a.parents) / len(trace)
    # Issue 3 / REFERENCE.md: roughly 4 in 10 requests extend an earlier one.
    assert 0.3 < continued < 0.5


def test_a_trace_error_crosses_a_process_boundary_whole(tmp_path: Path) -> None:
    """`kvprefetch targets` replays in worker processes: a bad trace's error comes back as
    itself, naming the file and line, not as a broken pool."""
    from concurrent.futures import ProcessPoolExecutor

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with ProcessPoolExecutor(1) as pool, pytest.raises(TraceError) as info:
        pool.submit(load_trace, bad).result()
    assert (info.value.path, info.value.line) == (str(bad), 1)
    assert str(info.value).startswith(f"{bad}:1: ")
