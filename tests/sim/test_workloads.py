"""The agent-like workload: tool loops, shared prefixes, an agent trace the replay reads (each
request's session, and the tool it waited on and for how long)."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from sim.replay import replay
from sim.scenario import load_scenario
from sim.sessions import derive_sessions
from sim.traces import TraceRequest, load_trace
from sim.workloads import DEFAULT_TOOLS, AgentTool, AgentWorkload, agent_trace, write_trace
from tests.conftest import REPO

# Big enough that no task carries 5% of the requests (the share past which sim/sessions.py takes
# a block for a shared prefix, not a session's).
SMALL = AgentWorkload(tasks=100, seconds=200.0, seed=3)


def test_the_trace_is_deterministic_ordered_and_prefix_chained() -> None:
    requests = agent_trace(SMALL)
    assert requests == agent_trace(SMALL) and requests != agent_trace(
        AgentWorkload(tasks=100, seconds=200.0, seed=4)
    )
    times = [r.arrival_seconds for r in requests]
    assert times == sorted(times) and len(requests) > SMALL.tasks  # tasks make several calls
    prefix = SMALL.system_blocks + SMALL.tool_blocks
    kinds = {r.hash_ids[:prefix] for r in requests}
    assert len(kinds) == SMALL.agent_kinds  # every call starts with its kind's shared prefix


def test_a_task_is_one_session_whose_calls_come_seconds_apart(tmp_path: Path) -> None:
    path = tmp_path / "agent.jsonl"
    assert write_trace(agent_trace(SMALL), path) == len(agent_trace(SMALL))
    trace = load_trace(path)
    assert len({r.session_id for r in trace}) == SMALL.tasks
    sessions = derive_sessions(trace)
    assert len(set(sessions.session_ids)) == SMALL.tasks
    # The shared prefixes are carried by many requests: hot, so they tie no sessions together.
    assert len(sessions.hot_blocks) >= SMALL.system_blocks + SMALL.tool_blocks
    gaps = sorted(
        b.arrival_seconds - a.arrival_seconds
        for i, a in enumerate(trace)
        for b in trace[i + 1 :]
        if sessions.parents[b.index] == a.index
    )
    assert gaps and gaps[len(gaps) // 2] < 30.0  # tool loops: a median gap of seconds
    summary = replay(trace, load_scenario("tight-hbm"), policy="none").summary
    assert summary["requests"] == len(trace) and summary["byte_hit_rate"] > 0
    assert summary["arrivals"] == "closed"  # its calls come when the replay serves the last


def test_each_call_after_the_first_says_what_it_waited_on_and_for_how_long() -> None:
    requests = agent_trace(SMALL)
    previous: dict[str, TraceRequest] = {}
    human_turns = 0
    for r in requests:
        before = previous.get(r.session_id or "")
        if before is None:  # a task's first call waited on nothing
            assert r.after_seconds is None and r.tool is None
        else:
            assert r.after_seconds is not None and r.after_seconds > 0
            # The open-loop arrival: the previous call's, its decode, then the wait (ms rounding).
            decode = before.output_tokens * SMALL.decode_seconds_per_token
            expected = before.arrival_seconds + decode + r.after_seconds
            assert r.arrival_seconds == pytest.approx(expected, abs=0.002)
            human_turns += r.tool is None
        previous[r.session_id or ""] = r
    assert len(previous) == SMALL.tasks and human_turns > 0
    # Sessions named as sim/sessions.py derives them: the same tasks, the same ids.
    assert [r.session_id for r in requests] == derive_sessions(requests).session_ids
    # Every tool is called, a slow one waited on longer than a fast one.
    waits: dict[str, list[float]] = {}
    for r in requests:
        if r.tool is not None:
            waits.setdefault(r.tool, []).append(r.after_seconds or 0.0)
    assert set(waits) == {t.name for t in SMALL.tools}
    assert statistics.median(waits["build"]) > 5 * statistics.median(waits["read_file"])


def test_the_tools_and_their_run_times_are_the_workloads() -> None:
    names = [t.name for t in DEFAULT_TOOLS]
    assert names[0] == "read_file" and names[-1] == "build" and len(set(names)) == 8
    medians = [t.median_seconds for t in DEFAULT_TOOLS]
    assert medians == sorted(medians) and medians[0] == 0.5 and medians[-1] == pytest.approx(10.0)
    one = AgentWorkload(tasks=20, seconds=60.0, tools=(AgentTool("sleep", 30.0, 0.01),))
    waits = [r.after_seconds for r in agent_trace(one) if r.tool is not None]
    assert waits and all(w == pytest.approx(30.0, rel=0.05) for w in waits)
    assert {r.tool for r in agent_trace(one)} == {"sleep", None}
    with pytest.raises(ValueError, match="at least one tool"):
        agent_trace(AgentWorkload(tools=()))


def test_the_cli_writes_the_trace(tmp_path: Path) -> None:
    out = tmp_path / "a.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "kvprefetch_cli", "agent-trace", "--out", str(out), "--tasks", "100"]
        + ["--seconds", "200", "--seed", "3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert load_trace(out) == agent_trace(SMALL)
    assert f"wrote {len(agent_trace(SMALL))} requests" in done.stderr
