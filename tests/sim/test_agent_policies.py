"""The published agent policies as replay baselines (sim/agent_policies.py): what each does when a
call ends, from tool run times learned as calls came back."""

from __future__ import annotations

import pytest

from sim.agent_policies import (
    Continuum,
    FixedTtl,
    Tokencake,
    ToolHistory,
    continuum_ttl,
    make_agent_policy,
)
from sim.cluster import Cluster, SimRequest
from sim.policies import Policy
from sim.policy_registry import make_policy
from tests.sim.test_cluster import CheckedCluster, Placed, context, request, scenario

PREFILL = 1e4


def call(
    i: int, blocks: list[int], after: float | None, tool: str | None, session: str = "a"
) -> SimRequest:
    r = request(i, 0.0, blocks, session=session)
    r.after_seconds, r.tool = after, tool
    return r


def agent(policy: Policy, runs: list[float], tool: str = "bash", hbm_blocks: int = 64) -> Cluster:
    """One session: a first call, then one call per run of `tool`, each carrying its result."""
    calls = [call(0, context(0, 2), None, None)]
    for k, run in enumerate(runs, start=1):
        calls.append(call(k, context(0, 2 + k), run, tool))
    cluster = CheckedCluster(
        scenario(prefill=PREFILL, instances=1, hbm_blocks=hbm_blocks),
        calls,
        Placed([0] * len(calls)),
        policy,
    )
    cluster.run()
    return cluster


def test_a_tools_run_times_are_learned_from_the_calls_that_came_back() -> None:
    history = ToolHistory()
    first, second = call(0, [1], None, None), call(1, [1, 2], 3.0, "bash")
    history.finished(first, 10.0)
    history.arrived(second, 13.5)
    history.arrived(call(2, [1, 2, 3], 1.0, None), 20.0)  # a human turn: no tool
    assert history.runs == {"bash": [3.5]} and history.median("bash") == 3.5
    assert history.median("grep") is None


@pytest.mark.parametrize(
    ("price", "ttl"),
    [(0.1, 10.0), (0.5, 10.0), (1.0, 2.0), (2.0, 0.0)],
)
def test_continuums_ttl_maximises_reload_avoided_against_memory_time_held(
    price: float, ttl: float
) -> None:
    # Runs 1, 2 and 10 s; 5 s of reload and queueing avoided when the call comes back in time.
    # tau=1: 1/3 x 5 - 1 x price; tau=2: 2/3 x 5 - 5/3 x price; tau=10: 5 - 13/3 x price.
    assert continuum_ttl([1.0, 2.0, 10.0], 5.0, price) == ttl
    assert continuum_ttl([], 5.0, 0.0) == 0.0


def test_continuum_pins_a_tool_calls_context_once_it_knows_the_tool() -> None:
    policy = Continuum()
    cluster = agent(policy, [2.0, 2.0, 2.0])
    hbm = cluster.instances[0].hbm
    last = cluster.requests[-1]
    # The first call end knew no bash run: no pin; later ends did, and pinned for 2 s (alone on
    # the instance, holding memory costs nothing here).
    assert policy.tools.runs["bash"] == pytest.approx([2.0, 2.0, 2.0])
    kept = [b for b in context(0, 4) if hbm.entries[b].keep_until > 0]
    assert kept and max(hbm.entries[b].keep_until for b in kept) < last.arrival + 1e-9


def test_tokencake_offloads_for_a_long_tool_and_uploads_before_its_return() -> None:
    # Tool runs of 60 s, far longer than the context's reload (0.1 s a block from the pool); HBM
    # of 8 blocks, and another session's 6-block calls in the middle of each run evict the
    # offloaded context.
    calls = [call(0, context(0, 2), None, None)]
    calls += [call(k, context(0, 2 + k), 60.0, "bash") for k in (1, 2, 3)]
    filler = [request(4 + k, 30.0 + 60.2 * k, context(100 + 10 * k, 6)) for k in range(3)]
    policy = Tokencake()
    cluster = CheckedCluster(
        scenario(prefill=PREFILL, instances=1, hbm_blocks=8),
        [*calls, *filler],
        Placed([0] * 7),
        policy,
    )
    cluster.run()
    assert cluster.totals.prefetch_orders >= 1  # uploaded again before the predicted return
    third = calls[3]  # the bash median (60 s) known from two returns by then
    assert third.hit_blocks == third.reused_blocks == 4  # it landed in time
    short = Tokencake()
    agent(short, [0.05, 0.05, 0.05])
    assert short.cluster.totals.prefetch_orders == 0  # a short tool's context is kept instead


def test_a_fixed_ttl_keeps_every_calls_context_for_its_time() -> None:
    policy = make_agent_policy("ttl-300")
    assert isinstance(policy, FixedTtl) and policy.name == "ttl-300"
    cluster = agent(policy, [1.0])
    hbm = cluster.instances[0].hbm
    end = cluster.requests[-1].finished_at
    assert hbm.entries[0].keep_until == pytest.approx(end + 300.0)  # type: ignore[operator]
    assert make_agent_policy("ttl").ttl_seconds == 30.0  # type: ignore[union-attr]
    for bad in ("ttl-x", "ttl-0", "ttl-inf"):
        with pytest.raises(ValueError, match="ttl-N"):
            make_agent_policy(bad)
    assert make_agent_policy("nope") is None


def test_the_registry_builds_them_and_names_them_when_a_name_is_unknown() -> None:
    assert isinstance(make_policy("continuum"), Continuum)
    assert isinstance(make_policy("tokencake"), Tokencake)
    with pytest.raises(ValueError, match="continuum, tokencake"):
        make_policy("nope")
