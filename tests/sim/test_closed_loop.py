"""Closed-loop sessions (an agent's next call comes when its tool returns, after the previous
call finished here) and the replay's latencies in the field's currency: time to first token per
request, task completion time per session."""

from __future__ import annotations

import pytest

from sim.cluster import Cluster, SimRequest
from sim.metrics import latency_summary
from sim.policies import Policy
from sim.signals import SimSignal
from tests.sim.test_cluster import (
    BLOCK_TOKENS,
    DECODE,
    CheckedCluster,
    Placed,
    context,
    request,
    scenario,
)

PREFILL = 1e4  # tokens per second: a block of 100 tokens in 0.01 s


def turn(
    i: int, arrival: float, blocks: list[int], after: float | None, output: int = 10
) -> SimRequest:
    r = request(i, arrival, blocks, session="agent", output=output)
    r.after_seconds = after
    return r


def agent_run(
    requests: list[SimRequest], *, open_loop: bool = False, signals: list[SimSignal] | None = None
) -> Cluster:
    scen = scenario(prefill=PREFILL, instances=1)
    cluster = CheckedCluster(
        scen.model_copy(update={"arrivals": "open" if open_loop else "closed"}),
        requests,
        Placed([0] * len(requests)),
        Policy(),
        signals=signals or [],
    )
    cluster.run()
    return cluster


def test_a_call_with_after_seconds_arrives_that_long_after_its_predecessor_finished() -> None:
    first = turn(0, 1.0, context(0, 4), None, output=100)
    second = turn(1, 500.0, context(0, 6), 5.0)  # recorded at 500 s; its tool ran 5 s
    agent_run([first, second])
    assert first.finished_at == pytest.approx(1.0 + 4 * BLOCK_TOKENS / PREFILL + 100 * DECODE)
    assert second.arrival == pytest.approx(first.finished_at + 5.0)
    # Served faster, the next call comes sooner: a shorter first call brings it forward.
    quick, after = turn(0, 1.0, context(0, 4), None, output=10), turn(1, 500.0, context(0, 6), 5.0)
    agent_run([quick, after])
    assert after.arrival == pytest.approx(second.arrival - 90 * DECODE)


def test_open_loop_keeps_the_recorded_arrivals() -> None:
    first, second = turn(0, 1.0, context(0, 4), None), turn(1, 500.0, context(0, 6), 5.0)
    cluster = agent_run([first, second], open_loop=True)
    assert not cluster.closed_loop and second.arrival == 500.0


def test_a_chain_of_calls_runs_in_order_and_a_request_without_after_seconds_keeps_its_time() -> (
    None
):
    calls = [turn(0, 0.0, context(0, 2), None)]
    calls += [turn(i, 1000.0 + i, context(0, 2 + i), 2.0) for i in range(1, 4)]
    human = turn(4, 50.0, context(0, 6), None)  # no after_seconds: its recorded time
    human.session_id = "human"
    agent_run([*calls, human])
    for before, nxt in zip(calls, calls[1:]):
        assert nxt.arrival == pytest.approx(before.finished_at + 2.0)  # type: ignore[operator]
    assert human.arrival == 50.0


def test_a_true_signal_keeps_its_lead_before_the_call_as_it_comes_here() -> None:
    first, second = turn(0, 1.0, context(0, 4), None), turn(1, 500.0, context(0, 6), 5.0)
    true = SimSignal(
        495.0, "agent", "tool_finished", after=0, latest=500.0, true=True, lead_seconds=3.0
    )
    emitted: list[tuple[str, float]] = []
    cluster = Cluster(
        scenario(prefill=PREFILL, instances=1),
        [first, second],
        Placed([0, 0]),
        Policy(),
        emit=lambda kind, ts, fields: emitted.append((kind, ts)),
        signals=[true],
    )
    cluster.run()
    [(_, at)] = [e for e in emitted if e[0] == "session_signal"]
    assert at == pytest.approx(second.arrival - 3.0)
    assert cluster.totals.signals_emitted == 1


def test_time_to_first_token_is_arrival_to_the_end_of_its_prefill() -> None:
    lone = request(0, 2.0, context(0, 4))
    agent_run([lone])
    # No reuse, nothing queued: its prefill alone (4 blocks at 1e4 tokens a second).
    assert lone.ttft_seconds == pytest.approx(4 * BLOCK_TOKENS / PREFILL)
    # Queued behind a full instance: the wait counts too.
    a, b = request(0, 0.0, context(0, 4), output=1000), request(1, 0.0, context(10, 2))
    cluster = CheckedCluster(
        scenario(prefill=PREFILL, instances=1, max_running=1), [a, b], Placed([0, 0]), Policy()
    )
    cluster.run()
    assert b.ttft_seconds == pytest.approx(a.finished_at + 2 * BLOCK_TOKENS / PREFILL)  # type: ignore[operator]


def test_latency_summary_judges_whole_tasks_from_the_measured_window() -> None:
    early = [turn(0, 0.0, context(0, 2), None), turn(1, 0.0, context(0, 3), 1.0)]
    late = [turn(2, 100.0, context(50, 2), None), turn(3, 0.0, context(50, 3), 1.0)]
    for r in late:
        r.session_id = "late"
    agent_run([*early, *late])
    summary = latency_summary([*early, *late], measure_from_seconds=50.0)
    assert summary["tasks"] == 1  # the early task started before the window: not judged
    assert summary["task_seconds_mean"] == pytest.approx(late[1].finished_at - 100.0, abs=1e-3)  # type: ignore[operator]
    ttfts = sorted(r.ttft_seconds for r in late)  # type: ignore[type-var]
    assert summary["ttft_seconds_p99"] == pytest.approx(ttfts[-1], abs=1e-4)
    assert summary["ttft_seconds_mean"] == pytest.approx(sum(ttfts) / 2, abs=1e-4)
    assert latency_summary([], 0.0)["tasks"] == 0


def test_an_instrumented_agent_posts_its_tools_start_and_return_exactly() -> None:
    from sim.signals import TOOL_FINISHED_LEAD_SECONDS, SignalSettings, generate_signals

    first = turn(0, 1.0, context(0, 4), None, output=100)
    second = turn(1, 500.0, context(0, 6), 5.0)
    second.tool = "bash"
    human = turn(2, 600.0, context(0, 8), 30.0)  # a human turn: no tool, no tool signal
    signals = generate_signals([first, second, human], SignalSettings(tools=1.0))
    assert [(s.kind, s.tool) for s in signals] == [
        ("tool_started", "bash"),
        ("tool_finished", "bash"),
    ]
    emitted: list[tuple[float, dict]] = []
    cluster = Cluster(
        scenario(prefill=PREFILL, instances=1),
        [first, second, human],
        Placed([0, 0, 0]),
        Policy(),
        emit=lambda kind, ts, fields: (
            emitted.append((ts, fields)) if kind == "session_signal" else None
        ),
        signals=signals,
    )
    cluster.run()
    (started_at, started), (finished_at, finished) = emitted
    assert (started["kind"], started["tool"], finished["kind"], finished["tool"]) == (
        "tool_started",
        "bash",
        "tool_finished",
        "bash",
    )
    assert started_at == pytest.approx(first.finished_at)  # the tool starts as the call ends
    assert finished_at == pytest.approx(second.arrival - TOOL_FINISHED_LEAD_SECONDS)
    # No session instrumented: none.
    assert generate_signals([first, second], SignalSettings(tools=0.0)) == []


def test_the_instrumented_share_is_drawn_per_session() -> None:
    from sim.signals import SignalSettings, generate_signals

    calls = []
    for k in range(200):
        a, b = turn(2 * k, float(k), [k], None), turn(2 * k + 1, k + 0.5, [k, 1000 + k], 1.0)
        a.session_id = b.session_id = f"agent-{k}"
        b.tool = "read_file"
        calls += [a, b]
    signals = generate_signals(calls, SignalSettings(tools=0.5, seed=3))
    sessions = {s.session_id for s in signals}
    assert 60 < len(sessions) < 140  # about half of 200
    assert all(sum(s.session_id == x for s in signals) == 2 for x in sessions)  # both, or none
    again = generate_signals(calls, SignalSettings(tools=0.5, seed=3))
    assert again == signals
