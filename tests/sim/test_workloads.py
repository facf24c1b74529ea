"""The agent-like workload: tool loops, shared prefixes, a Mooncake trace the replay reads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sim.replay import replay
from sim.scenario import load_scenario
from sim.sessions import derive_sessions
from sim.traces import load_trace
from sim.workloads import AgentWorkload, agent_trace, write_trace
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


def test_the_cli_writes_the_trace(tmp_path: Path) -> None:
    out = tmp_path / "a.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "agent-trace", "--out", str(out), "--tasks", "100"]
        + ["--seconds", "200", "--seed", "3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert load_trace(out) == agent_trace(SMALL)
    assert f"wrote {len(agent_trace(SMALL))} requests" in done.stderr
