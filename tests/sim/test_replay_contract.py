"""The contract of `kvprefetch replay --json`, its errors, and replay determinism."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvprefetch_cli import cli
from sim.replay import replay
from sim.scenario import load_scenario
from tests.conftest import TRACES
from tests.sim.test_cluster import TRACE_FILES, trace_prefix

INTS = (
    "requests",
    "reuse_requests",
    "bytes_loaded_on_demand",
    "bytes_prefetched",
    "bytes_prefetched_unused",
    "recompute_tokens",
)
RATES = ("hit_rate", "byte_hit_rate", "byte_hit_rate_unshared", "gpu_wait_fraction")
SECONDS = ("stall_seconds_total", "stall_seconds_p50", "stall_seconds_p99")
SMALL = 300  # requests in the trace the CLI reads


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("traces") / "small.jsonl"
    with open(TRACES / TRACE_FILES[0]) as f:
        path.write_text("".join(next(f) for _ in range(SMALL)))
    return path


def invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, ["replay", *args])


def one_json_object(stdout: str) -> dict[str, Any]:
    lines = stdout.splitlines()
    assert len(lines) == 1, (
        f"expected exactly one line on stdout, got {len(lines)}: {stdout[:500]!r}"
    )
    doc = json.loads(lines[0])
    assert isinstance(doc, dict)
    return doc


def check_summary(
    s: dict[str, Any], policy: str, router: str = "sticky", scenario: str = "default"
) -> None:
    assert (s["policy"], s["router"], s["scenario"]) == (policy, router, scenario)
    assert all(type(s[key]) is str for key in ("policy", "router", "scenario"))
    # The landing rule it ran under (the shipped scenarios': chunks, usable as they land).
    assert (s["landing"], s["chunk_tokens"]) == ("chunked", 256)
    for key in INTS:
        assert type(s[key]) is int and s[key] >= 0, key
    for key in RATES:
        assert type(s[key]) is float and 0.0 <= s[key] <= 1.0, key
    for key in SECONDS:
        assert type(s[key]) is float and s[key] >= 0.0, key
    assert s["requests"] == SMALL
    assert 0 < s["reuse_requests"] <= s["requests"]
    assert s["stall_seconds_p50"] <= s["stall_seconds_p99"] <= s["stall_seconds_total"] + 1e-9
    assert s["bytes_prefetched_unused"] <= s["bytes_prefetched"]


def test_replay_json_is_one_object_with_the_contract_keys(small_trace: Path) -> None:
    result = invoke("--trace", str(small_trace), "--json")
    assert result.exit_code == 0, result.output
    s = one_json_object(result.stdout)
    check_summary(s, "none")
    assert s["bytes_prefetched"] == 0
    # Stall totals agree with what a direct replay measures.
    direct = replay(trace_prefix(TRACE_FILES[0], SMALL), load_scenario("default")).summary
    assert {k: s[k] for k in (*INTS, *RATES, *SECONDS)} == {
        k: direct[k] for k in (*INTS, *RATES, *SECONDS)
    }


def test_replay_json_with_options(small_trace: Path) -> None:
    result = invoke(
        "--trace",
        str(small_trace),
        "--policy",
        "oracle",
        "--router",
        "least-loaded",
        "--scenario",
        "tight-hbm",
        "--json",
    )
    assert result.exit_code == 0, result.output
    s = one_json_object(result.stdout)
    check_summary(s, "oracle", "least-loaded", "tight-hbm")
    assert s["bytes_prefetched"] > 0


def test_replay_compare_json(small_trace: Path) -> None:
    result = invoke("--trace", str(small_trace), "--compare", "none,oracle", "--json")
    assert result.exit_code == 0, result.output
    doc = one_json_object(result.stdout)
    assert list(doc) == ["compare"]
    assert [s["policy"] for s in doc["compare"]] == ["none", "oracle"]
    for s in doc["compare"]:
        check_summary(s, s["policy"])
    none, oracle = doc["compare"]
    assert oracle["byte_hit_rate"] >= none["byte_hit_rate"]
    assert oracle["stall_seconds_total"] <= none["stall_seconds_total"]


def flat(text: str) -> str:
    """The error panel without its frame and line wrapping."""
    return re.sub(r"[\s│╭╮╰╯─]+", "", text)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--policy", "nope"],
            "unknown policy 'nope'; choose from none, lookahead, belady, oracle",
        ),
        (["--compare", "none,nope"], "unknown policy 'nope'"),
        (["--router", "nope"], "unknown router 'nope'; choose from sticky, least-loaded, kv-aware"),
        (["--scenario", "nope"], "no scenario 'nope' (shipped: agents, busy, default"),
    ],
)
def test_unknown_names_fail_clearly(small_trace: Path, args: list[str], message: str) -> None:
    result = invoke("--trace", str(small_trace), *args, "--json")
    assert result.exit_code != 0
    assert result.stdout == ""
    assert flat(message) in flat(result.stderr), result.stderr


def test_a_malformed_trace_line_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
    path.write_text(
        good + good + '{"timestamp": 1, "input_length": "x", "output_length": 5, "hash_ids": [1]}\n'
    )
    result = invoke("--trace", str(path), "--json")
    assert result.exit_code != 0
    assert result.stdout == ""
    assert flat(f"{path}:3: input_length must be an integer") in flat(result.stderr), result.stderr


def test_a_missing_trace_fails_clearly(tmp_path: Path) -> None:
    result = invoke("--trace", str(tmp_path / "absent.jsonl"), "--json")
    assert result.exit_code != 0 and result.stdout == ""
    assert flat(f"{tmp_path / 'absent.jsonl'}:0: cannot open") in flat(result.stderr), result.stderr


# -- determinism ----------------------------------------------------------------------------------


def outcome(result: Any) -> tuple[dict[str, Any], list[tuple]]:
    summary = {k: v for k, v in result.summary.items() if k != "wall_seconds"}
    per_request = [
        (
            r.instance,
            r.admitted_at,
            r.ready_at,
            r.finished_at,
            r.hit_blocks,
            r.loaded_bytes,
            r.recompute_tokens,
        )
        for r in result.requests
    ]
    return summary, per_request


@pytest.mark.parametrize(
    ("trace", "policy", "router"),
    [
        (TRACE_FILES[0], "oracle", "least-loaded"),
        (TRACE_FILES[1], "belady", "kv-aware"),
        (TRACE_FILES[0], "heuristic", "sticky"),
        (TRACE_FILES[1], "learned", "least-loaded"),
    ],
)
def test_two_replays_of_the_same_input_are_identical(trace: str, policy: str, router: str) -> None:
    requests = trace_prefix(trace, 500)
    first = replay(requests, load_scenario("tight-hbm"), policy=policy, router=router)
    second = replay(requests, load_scenario("tight-hbm"), policy=policy, router=router)
    assert outcome(first) == outcome(second)
    assert "wall_seconds" in first.summary


def test_a_replay_engine_takes_the_guard_settings_and_the_policies_obey_its_guard() -> None:
    from sim.policy_registry import make_policy
    from sim.replay import sim_engine
    from sim.scenario import load_scenario

    scen = load_scenario("default")
    assert sim_engine(scen, load_model=False).guard is not None  # on, as in the service
    assert sim_engine(scen, load_model=False, planner_options={"lru_guard": False}).guard is None
    engine = sim_engine(scen, load_model=False, planner_options={"keep_min_p": 0.3})
    assert engine.guard is not None and engine.thresholds.keep_min_p == 0.3
    policy = make_policy("heuristic", session_view=engine.store.session, engine=engine)
    # The policy plans with the engine's scorer and scheduler: their thresholds and guard.
    assert policy.scheduler is engine.scheduler  # type: ignore[attr-defined]
    assert engine.scorer.guard is engine.guard
    with pytest.raises(ValueError, match="unknown planner option"):
        sim_engine(scen, load_model=False, planner_options={"return_horizon_seconds": 60.0})


def test_a_planner_replay_reports_what_its_guard_saw_of_the_demotes() -> None:
    """On a tight HBM under a spreading router the heuristic demotes, and the guard prices each
    demote against the room it made (app/decide/guard.py); told not to, it prices none."""
    requests = trace_prefix(TRACE_FILES[0], 500)
    scen = load_scenario("tight-hbm")
    priced = replay(requests, scen, policy="heuristic", router="least-loaded").summary
    seen = priced["lru_guard"]
    assert set(seen) == {
        "fallbacks",
        "demote_cost_blocks",
        "demote_gain_blocks",
        "demote_suspensions",
    }
    assert seen["demote_cost_blocks"] + seen["demote_gain_blocks"] > 0
    unpriced = replay(
        requests,
        scen,
        policy="heuristic",
        router="least-loaded",
        planner_options={"lru_guard_demotes": False},
    ).summary["lru_guard"]
    assert unpriced["demote_cost_blocks"] == unpriced["demote_gain_blocks"] == 0
    assert "lru_guard" not in replay(requests, scen, policy="none").summary


def test_a_replay_runs_where_an_event_loop_already_runs() -> None:
    """A Jupyter kernel runs its cells inside an event loop, where asyncio.run refuses to start
    another: the replay (and training.evaluate, the notebook's replays) still runs there, and
    gives what it gives outside one."""
    import asyncio

    requests = trace_prefix(TRACE_FILES[0], 200)

    async def inside_a_loop() -> Any:
        return replay(requests, load_scenario("default"), policy="learned")

    inside = asyncio.run(inside_a_loop())
    outside = replay(requests, load_scenario("default"), policy="learned")
    assert outcome(inside) == outcome(outside)
