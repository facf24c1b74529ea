"""`kvprefetch trace import --from tracelab`: TraceLab's round traces of real coding-agent
sessions as agent traces. The fixture is two sessions trimmed from TraceLab's public example
(tests/fixtures/tracelab/README.md): a Codex one and a Claude Code one, months apart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from sim.replay import replay
from sim.scenario import load_scenario
from sim.tracelab import ImportOptions, import_tracelab
from sim.traces import TraceError, TraceRequest, load_trace
from tests.conftest import REPO

FIXTURE = REPO / "tests" / "fixtures" / "tracelab" / "round_trace.jsonl"
CODEX = "codex:a611041f-625d-6fad-5e59-845850dc6543"
CLAUDE = "claude:92ee5b8a-429c-e80b-5db6-5381512f4697"


def of(trace: list[TraceRequest], session_id: str) -> list[TraceRequest]:
    return [r for r in trace if r.session_id == session_id]


def shared(a: TraceRequest, b: TraceRequest) -> int:
    """How many leading blocks b shares with a."""
    n = 0
    for x, y in zip(a.hash_ids, b.hash_ids):
        if x != y:
            break
        n += 1
    return n


def test_the_fixture_imports_as_the_trace_says() -> None:
    trace, summary = import_tracelab(FIXTURE)
    assert (summary.rounds, summary.requests, summary.sessions) == (12, 12, 2)
    codex, claude = of(trace, CODEX), of(trace, CLAUDE)
    assert len(codex) == len(claude) == 6
    # Seconds from the previous round's last event to the input this round waited for: the
    # tools' measured runs (parallel ones overlapping: round 1 waited on the slowest of three
    # exec_command calls, 1.176 s of which 0.014 s overlapped the model's own output), then a
    # human's think time (tool None).
    assert [(r.after_seconds, r.tool) for r in codex] == [
        (None, None),
        (1.162, "exec_command"),
        (4.99, "write_stdin"),
        (0.002, "write_stdin"),
        (0.133, "exec_command"),
        (6.333, None),
    ]
    # Claude Code: round 1 waited on WebSearch (19.291 s, its tool_wall_latency_ms), the Bash
    # beside it long done.
    assert [(r.after_seconds, r.tool) for r in claude] == [
        (None, None),
        (19.291, "WebSearch"),
        (12.688, "WebSearch"),
        (21.467, "Write"),
        (0.145, "Bash"),
        (19.913, None),
    ]
    # Prompts are prefix_tokens + newly_append_tokens; a round reuses the previous round's first
    # min(prefix_tokens, previous prompt) // 512 blocks; the rest are new to the session.
    assert [r.input_tokens for r in codex] == [9324, 9917, 10058, 10152, 10472, 10436]
    assert [r.output_tokens for r in codex] == [444, 94, 59, 233, 294, 262]
    assert [len(r.hash_ids) for r in codex] == [19, 20, 20, 20, 21, 21]
    # Round 3: the provider's cache found 3,456 tokens only, so 6 blocks are reused.
    assert [shared(a, b) for a, b in zip(codex, codex[1:])] == [18, 19, 6, 19, 18]
    assert [shared(a, b) for a, b in zip(claude, claude[1:])] == [57, 69, 75, 80, 81]
    for session in (codex, claude):
        seen: set[int] = set()
        for a, b in zip(session, session[1:]):
            seen.update(a.hash_ids)
            assert not seen & set(b.hash_ids[shared(a, b) :])  # the rest is new
    assert not set(codex[0].hash_ids) & set(claude[0].hash_ids)  # sessions share nothing
    # Recorded times: Codex first (March), the Claude session after the 60 s idle cut.
    assert [r.arrival_seconds for r in codex] == [0.0, 7.376, 14.052, 15.306, 19.334, 30.379]
    assert claude[0].arrival_seconds == 94.228  # Codex's last event at 34.228 s, plus 60 s


def test_the_written_trace_reads_back_and_replays_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "agent.jsonl"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvprefetch_cli",
            "trace",
            "import",
            "--from",
            "tracelab",
            str(FIXTURE),
        ]
        + ["--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "wrote 12 requests in 2 sessions" in done.stderr
    trace = load_trace(out)
    assert trace == import_tracelab(FIXTURE)[0]
    replayed = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvprefetch_cli",
            "replay",
            "--trace",
            str(out),
            "--policy",
            "learned",
        ]
        + ["--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert replayed.returncode == 0, replayed.stderr
    summary = json.loads(replayed.stdout)
    assert summary["requests"] == 12 and summary["sessions"] == 2 and summary["tasks"] == 2
    assert summary["reuse_requests"] == 10  # every round but each session's first
    assert summary["arrivals"] == "closed"
    assert summary["byte_hit_rate"] > 0


def test_a_closed_loop_replay_brings_the_next_round_after_the_wait() -> None:
    trace, _ = import_tracelab(FIXTURE)
    result = replay(trace, load_scenario("default"), policy="none")
    by_index = {r.index: r for r in result.requests}
    for session_id in (CODEX, CLAUDE):
        rounds = [by_index[r.index] for r in of(trace, session_id)]
        for a, b in zip(rounds, rounds[1:]):
            assert a.finished_at is not None and b.after_seconds is not None
            assert b.arrival == pytest.approx(a.finished_at + b.after_seconds)


def test_the_idle_cut_and_poisson_session_starts(tmp_path: Path) -> None:
    recorded, _ = import_tracelab(FIXTURE, ImportOptions(max_idle_seconds=float("inf")))
    start = of(recorded, CLAUDE)[0].arrival_seconds
    assert start > 70 * 86400  # 2026-03-21 to 2026-06-01, as recorded
    tight, _ = import_tracelab(FIXTURE, ImportOptions(max_idle_seconds=0.0))
    assert of(tight, CLAUDE)[0].arrival_seconds == 34.228
    poisson, _ = import_tracelab(FIXTURE, ImportOptions(session_rate=0.1, seed=1))
    again, _ = import_tracelab(FIXTURE, ImportOptions(session_rate=0.1, seed=1))
    other, _ = import_tracelab(FIXTURE, ImportOptions(session_rate=0.1, seed=2))
    assert poisson == again and poisson != other
    assert of(poisson, CODEX)[0].arrival_seconds == 0.0
    # A session's own timeline moves with its start.
    for trace in (recorded, tight, poisson):
        claude = of(trace, CLAUDE)
        gaps = [round(b.arrival_seconds - a.arrival_seconds, 3) for a, b in zip(claude, claude[1:])]
        assert gaps == [30.787, 26.612, 47.932, 2.826, 35.025]


def test_the_block_size_is_the_scenarios() -> None:
    trace, _ = import_tracelab(FIXTURE, ImportOptions(block_tokens=256))
    codex = of(trace, CODEX)
    assert len(codex[0].hash_ids) == 37  # 9,324 tokens
    assert shared(codex[2], codex[3]) == 13  # 3,456 tokens cached: 13 whole blocks


def rounds(tmp_path: Path, *docs: dict[str, object]) -> Path:
    path = tmp_path / "rounds.jsonl"
    path.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in docs))
    return path


def a_round(index: int, at: str, **changes: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "session_id": "s",
        "round_index": index,
        "prefix_tokens": 0,
        "newly_append_tokens": 600,
        "output_tokens": 5,
        "timing_events": [
            {"event_type": "user_message", "timestamp": at},
            {"event_type": "text", "timestamp": at},
        ],
        "tools": [],
    }
    doc.update(changes)
    return doc


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prefix_tokens": -3}, "2: prefix_tokens must be >= 0, got -3"),
        ({"newly_append_tokens": "12"}, "2: newly_append_tokens must be an integer, got '12'"),
        ({"output_tokens": None}, "2: output_tokens must be an integer, got None"),
        ({"round_index": 1.5}, "2: round_index must be an integer, got 1.5"),
        ({"session_id": None}, "2: session_id must be a non-empty string, got None"),
        ({"timing_events": {"x": 1}}, "2: timing_events must be a list of objects"),
        (
            {"timing_events": [{"event_type": "user_message", "timestamp": "yesterday"}]},
            "2: timing_events[0].timestamp must be an ISO 8601 time, got 'yesterday'",
        ),
        (
            {"timing_events": [{"event_type": 4, "timestamp": "2026-01-01T00:00:00Z"}]},
            "2: timing_events[0].event_type must be a string, got 4",
        ),
        ({"tools": [{"tool_name": 9}]}, "2: tools[0].tool_name must be a string, got 9"),
    ],
)
def test_a_malformed_round_names_file_line_and_field(
    tmp_path: Path, change: dict[str, object], message: str
) -> None:
    path = rounds(tmp_path, a_round(0, "2026-01-01T00:00:00Z"), a_round(1, "x", **change))
    with pytest.raises(TraceError) as info:
        import_tracelab(path)
    assert str(info.value) == f"{path}:{message}"


def test_a_line_that_is_not_a_round(tmp_path: Path) -> None:
    path = tmp_path / "rounds.jsonl"
    path.write_text('{"session_id": "s"\n')
    with pytest.raises(TraceError, match=r"rounds.jsonl:1: not JSON"):
        import_tracelab(path)
    path.write_text("[1]\n")
    with pytest.raises(TraceError, match=r"rounds.jsonl:1: a line must be a JSON object"):
        import_tracelab(path)
    path.write_text("\n")
    with pytest.raises(TraceError, match=r"rounds.jsonl:0: no rounds to import"):
        import_tracelab(path)


def test_what_cannot_be_a_request_is_skipped_and_counted(tmp_path: Path) -> None:
    path = rounds(
        tmp_path,
        a_round(0, "2026-01-01T00:00:00Z", tools=[{"tool_call_id": "c1", "tool_name": "grep"}]),
        a_round(0, "2026-01-01T00:00:01Z"),  # TraceLab keeps duplicate rounds: the first stays
        a_round(1, "2026-01-01T00:00:02Z", timing_events=[{"event_type": "text"}]),  # no time
        a_round(2, "2026-01-01T00:00:03Z", prefix_tokens=0, newly_append_tokens=0),  # no usage
        a_round(
            3,
            "2026-01-01T00:00:04Z",
            prefix_tokens=512,
            timing_events=[
                {
                    "event_type": "tool_result",
                    "timestamp": "2026-01-01T00:00:04",
                    "tool_call_id": "c1",
                },
                {"event_type": "reasoning", "timestamp": "2026-01-01T00:00:05Z"},
            ],
        ),
    )
    trace, summary = import_tracelab(path)
    assert (summary.skipped_duplicate, summary.skipped_untimed, summary.skipped_no_tokens) == (
        1,
        1,
        1,
    )
    assert [(r.after_seconds, r.tool) for r in trace] == [(None, None), (4.0, "grep")]
    assert trace[1].hash_ids[:1] == trace[0].hash_ids[:1]  # the 512 cached tokens


def test_the_cli_refuses_an_unknown_format(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvprefetch_cli", "trace", "import", "--from", "otel", str(FIXTURE)]
        + ["--out", str(tmp_path / "x.jsonl")],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and "unknown format 'otel'" in done.stderr
