"""`kvprefetch targets`: the cases replayed, and how each target is judged."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvprefetch_cli import cli
from sim.targets import (
    CONVERSATION,
    HALF,
    SEED_FREE,
    SYNTHETIC,
    Case,
    Target,
    aggregate,
    as_json,
    cases,
    gap_closed,
    judge,
    markdown,
    run,
    run_case,
    targets,
    units,
)

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
SMALL = 300  # requests of the conversation trace in the small one


def summary(byte_hit_rate: float, stall: float = 10.0, moved: float = 0, unused: float = 0) -> Any:
    return {
        "byte_hit_rate": byte_hit_rate,
        "stall_seconds_total": stall,
        "ttft_seconds_p99": stall / 10,
        "task_seconds_mean": 100.0 + stall,
        "bytes_prefetched": moved,
        "bytes_prefetched_unused": unused,
    }


def test_every_target_names_policies_its_case_replays() -> None:
    all_cases = cases()
    found = targets(all_cases)
    assert len(found) >= 10
    for t in found:
        assert t.policy in t.case.policies
        assert set(t.case.policies) >= set(t.not_below)
        if t.min_gap is not None:
            assert {"none", "oracle"} <= set(t.case.policies)


def test_a_target_is_met_only_when_every_part_of_it_is() -> None:
    case = Case("t", "sticky", ("none", "signal", "learned", "oracle"), signals=HALF)
    target = Target(
        case,
        "learned",
        "x",
        min_gap=0.55,
        not_below=("signal",),
        strict=True,
        max_unused_share=0.3,
    )
    results = {
        "none": summary(0.4),
        "oracle": summary(1.0),
        "signal": summary(0.6, stall=20.0),
        "learned": summary(0.8, stall=15.0, moved=100, unused=20),
    }
    assert gap_closed(results, "learned") == 0.4 / 0.6
    assert judge(target, results).met
    slower = {**results, "learned": summary(0.8, stall=25.0, moved=100, unused=20)}
    assert not judge(target, slower).met  # beats signal on hits, not on stall
    wasteful = {**results, "learned": summary(0.8, stall=15.0, moved=100, unused=40)}
    assert judge(target, wasteful).why == ["unused 40%"]
    short = {**results, "learned": summary(0.65, stall=15.0)}
    assert not judge(target, short).met
    tolerant = Target(case, "learned", "never below none", not_below=("none",))
    assert judge(tolerant, {**results, "learned": summary(0.396)}).met  # within 0.005
    assert not judge(tolerant, {**results, "learned": summary(0.39)}).met


@pytest.fixture(scope="module")
def small_traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A traces directory whose conversation trace is the real one's first requests."""
    folder = tmp_path_factory.mktemp("traces")
    with open(TRACES / CONVERSATION) as f:
        (folder / CONVERSATION).write_text("".join(next(f) for _ in range(SMALL)))
    return folder


def test_a_case_replays_its_policies_on_the_judged_part(small_traces: Path) -> None:
    case = Case(CONVERSATION, "sticky", ("none", "oracle"), scenario="tight-hbm")
    results = run_case(case, small_traces, None)
    assert set(results) == {"none", "oracle"}
    assert results["oracle"]["byte_hit_rate"] >= results["none"]["byte_hit_rate"]
    # Judged on the last 30% by time: fewer requests than the trace holds.
    assert 0 < results["none"]["requests"] < SMALL
    assert "seeds" not in results["none"]  # no signals: one replay
    table = markdown([(case, results)], [])
    assert "conversation, tight-hbm, sticky, signals off | oracle" in table
    assert "signal seed" not in table


def test_a_signal_case_replays_what_reads_signals_under_each_seed(small_traces: Path) -> None:
    # kv-aware: a case no target is set for (the targets' cases replay learned, which is slow).
    case = Case(CONVERSATION, "kv-aware", ("none", "signal", "oracle"), signals=HALF)
    assert [(u.policy, u.seed) for u in units(case, (0, 1, 2))] == [
        ("none", None),
        ("signal", 0),
        ("signal", 1),
        ("signal", 2),
        ("oracle", None),
    ]
    ((ran, res),) = run(small_traces, None, jobs=1, seeds=(0, 1), all_cases=[case])[0]
    assert ran == case
    signal = res["signal"]
    assert [s["seed"] for s in signal["seeds"]] == [0, 1]
    assert [s["signals"]["seed"] for s in signal["seeds"]] == [0, 1]
    # Two seeds, two draws of the signals: not the same signals twice.
    assert signal["seeds"][0]["signals_true"] != signal["seeds"][1]["signals_true"]
    assert signal["byte_hit_rate"] == statistics.fmean(s["byte_hit_rate"] for s in signal["seeds"])
    assert "seeds" not in res["none"] and "seeds" not in res["oracle"]
    assert res["none"]["signals"]["coverage"] == 0.5  # replayed under the signals, once
    with pytest.raises(ValueError, match="at least one signal seed"):
        run(small_traces, None, seeds=(), all_cases=[case])


def fake_seeds(case: Case, rates: list[float], **per_seed: Sequence[float]) -> dict[Any, Any]:
    """`done` for aggregate: none at 0.4, oracle at 1.0, learned at `rates` (one per seed)."""
    done: dict[Any, Any] = {("none", None): summary(0.4), ("oracle", None): summary(1.0)}
    for seed, rate in enumerate(rates):
        fields = {k: v[seed] for k, v in per_seed.items()}
        done[("learned", seed)] = summary(rate, **fields)
    return done


def test_seeds_aggregate_to_their_mean_and_standard_deviation() -> None:
    case = Case("t", "sticky", ("none", "learned", "oracle"), signals=HALF)
    rates = [0.58, 0.61, 0.64, 0.61]
    stalls = [10.0, 12.0, 14.0, 16.0]
    moved = [100, 200, 300, 400]
    unused = [50, 50, 150, 100]
    res = aggregate(case, fake_seeds(case, rates, stall=stalls, moved=moved, unused=unused))
    learned = res["learned"]
    assert list(res) == ["none", "learned", "oracle"]
    assert learned["byte_hit_rate"] == pytest.approx(0.61)
    assert learned["byte_hit_rate_sd"] == pytest.approx(statistics.stdev(rates))
    gaps = [(r - 0.4) / 0.6 for r in rates]
    assert learned["gap_closed"] == pytest.approx(0.35)
    assert gap_closed(res, "learned") == pytest.approx(0.35)
    assert learned["gap_closed_sd"] == pytest.approx(statistics.stdev(gaps))
    assert learned["stall_seconds_total"] == 13.0
    assert learned["stall_seconds_total_sd"] == pytest.approx(statistics.stdev(stalls))
    assert learned["bytes_prefetched"] == 250
    # The unused share is the seeds' shares' mean (0.5, 0.25, 0.5, 0.25), not 450 / 1000.
    assert learned["unused_share"] == pytest.approx(0.375)
    assert learned["unused_share_sd"] == pytest.approx(statistics.stdev([0.5, 0.25, 0.5, 0.25]))
    assert [s["seed"] for s in learned["seeds"]] == [0, 1, 2, 3]
    assert [s["gap_closed"] for s in learned["seeds"]] == pytest.approx(gaps)
    assert learned["seeds"][2]["byte_hit_rate"] == 0.64
    # One seed: a mean of one, and no spread.
    one = aggregate(case, fake_seeds(case, [0.58]))["learned"]
    assert one["byte_hit_rate"] == 0.58 and one["byte_hit_rate_sd"] is None


def test_a_target_is_judged_on_the_mean_over_seeds() -> None:
    case = Case("t", "least-loaded", ("none", "signal", "learned", "oracle"), signals=HALF)
    target = Target(case, "learned", "x", not_below=("signal",))
    done = fake_seeds(case, [0.50, 0.60, 0.60, 0.60])
    done.update({("signal", s): summary(rate) for s, rate in enumerate([0.52, 0.58, 0.58, 0.58])})
    # Below signal by more than the tolerance on seed 0, above it on the mean.
    assert judge(target, aggregate(case, done)).met
    done[("learned", 1)] = summary(0.50)
    done[("learned", 2)] = summary(0.55)
    verdict = judge(target, aggregate(case, done))
    assert not verdict.met and verdict.why == ["-0.0275 against signal"]


def test_the_table_prints_the_spread_over_seeds() -> None:
    case = Case("t", "sticky", ("none", "learned", "oracle"), signals=HALF)
    rates = [0.6284, 0.6325, 0.6366, 0.6325]
    res = aggregate(case, fake_seeds(case, rates, moved=[100e9] * 4, unused=[50e9] * 4))
    table = markdown([(case, res)], [])
    sd = statistics.stdev(rates)
    assert f"| learned | 0.6325 ± {sd:.4f} | {0.2325 / 0.6:.0%} ± {sd / 0.6 * 100:.0f} |" in table
    assert "| 100 ± 0 | 50% ± 0 |" in table
    assert "| none | 0.4000 | 0% |" in table  # replayed once: no spread
    assert "over 4 signal seeds (0, 1, 2, 3)" in table.splitlines()[0]
    doc = json.loads(as_json([(case, res)], []))
    assert doc["signal_seeds"] == [0, 1, 2, 3]
    per_seed = doc["cases"][0]["results"]["learned"]["seeds"]
    assert [s["byte_hit_rate"] for s in per_seed] == rates


def test_the_least_loaded_half_signal_case_is_judged_against_the_naive_rule() -> None:
    found = targets(cases())
    for trace in (CONVERSATION, SYNTHETIC):
        for router, strict in (("least-loaded", False), ("sticky", True)):
            case = Case(trace, router, ("none", "signal", "learned", "oracle"), signals=HALF)
            assert case in cases()
            (t,) = [t for t in found if t.case == case]
            assert (t.policy, t.not_below, t.strict) == ("learned", ("signal",), strict)
        # Signals off, learned never below LRU under both routers.
        for router in ("sticky", "least-loaded"):
            (t,) = [
                t
                for t in found
                if t.case.trace == trace
                and t.case.router == router
                and t.case.signals is None
                and t.case.scenario == "default"
                and t.policy == "learned"
            ]
            assert t.not_below == ("none",) and not t.strict


def test_seed_free_policies_read_no_signals() -> None:
    assert {"none", "oracle"} <= SEED_FREE
    assert not SEED_FREE & {"signal", "learned", "heuristic", "clairvoyant", "scheduled"}


@pytest.mark.parametrize("value", ["0", "-1"])
def test_seeds_below_one_are_refused_naming_the_option(value: str) -> None:
    result = CliRunner().invoke(cli, ["targets", "--seeds", value])
    assert result.exit_code == 2
    assert "Invalid value for '--seeds'" in result.output


# -- the agent targets (issue 28) -----------------------------------------------------------------


def agent_summary(seed: int, hit: float, ttft: float, task: float) -> dict[str, Any]:
    return {
        "seed": seed,
        "byte_hit_rate": hit,
        "ttft_seconds_p99": ttft,
        "task_seconds_mean": task,
        "stall_seconds_total": 0.0,
        "bytes_prefetched": 0,
        "bytes_prefetched_unused": 0,
        "tasks": 10,
    }


def agent_results(case: Case, per_policy: dict[str, list[tuple[float, float, float]]]) -> Any:
    done = {
        (p, seed): agent_summary(seed, *values)
        for p, rows in per_policy.items()
        for seed, values in enumerate(rows)
    }
    return aggregate(case, done)


def test_the_agent_cases_replay_every_policy_under_every_seed_on_a_trace_of_that_seed() -> None:
    from sim.targets import AGENT_LIGHT, AGENT_LOADED, ANCHORS, agent_cases, load, units

    found = agent_cases()
    assert {c.trace for c in found} == {AGENT_LIGHT, AGENT_LOADED}
    assert all(c.scenario == "agents" and set(ANCHORS) < set(c.policies) for c in found)
    assert all(c in cases() for c in found)
    light = found[0]
    assert {(u.policy, u.seed) for u in units(light, (0, 1))} == {
        (p, s) for p in light.policies for s in (0, 1)
    }
    first, again, other = load(AGENT_LIGHT, Path("."), 0), load(AGENT_LIGHT, Path("."), 0), None
    other = load(AGENT_LIGHT, Path("."), 1)
    assert first == again and first != other
    assert len(load(AGENT_LOADED, Path("."), 0)) > 2 * len(first)
    assert [t.agent_rule for t in targets(found)] == ["light", "light", "light", "loaded"]


def test_at_light_load_learned_must_beat_every_anchor_on_ttft_and_hits_paired_by_seed() -> None:
    from sim.targets import agent_cases

    light = agent_cases()[0]
    [target] = targets([light])
    good = {
        "none": [(0.80, 1.0, 100.0), (0.70, 1.2, 101.0)],
        "ttl": [(0.80, 1.1, 100.0), (0.70, 1.2, 101.0)],
        "continuum": [(0.81, 0.9, 100.0), (0.71, 1.1, 100.5)],
        "tokencake": [(0.60, 2.0, 103.0), (0.50, 2.2, 104.0)],
        "learned": [(0.85, 0.8, 100.5), (0.75, 1.0, 101.0)],
    }
    assert judge(target, agent_results(light, good)).met
    # As slow as continuum's, plus 0.1 s on both seeds (and no faster than none's).
    bad = {**good, "learned": [(0.85, 1.0, 100.5), (0.75, 1.2, 101.0)]}
    verdict = judge(target, agent_results(light, bad))
    assert not verdict.met
    assert "against continuum: TTFT p99 +0.100 ± 0.000 s, byte hit +0.0400 ± 0.0000" in verdict.why
    assert not any(w.startswith("against ttl") for w in verdict.why)  # -0.05 on the mean
    slow = {**good, "learned": [(0.85, 0.8, 103.0), (0.75, 1.0, 103.0)]}
    assert judge(target, agent_results(light, slow)).why == ["task time +2.7% against the best"]


def test_under_loaded_compute_learned_must_match_continuums_task_time_and_cut_its_ttft() -> None:
    from sim.targets import agent_cases

    loaded = agent_cases()[-1]
    [target] = targets([loaded])
    base = {p: [(0.5, 10.0, 300.0), (0.5, 12.0, 310.0)] for p in ("none", "ttl", "tokencake")}
    ok = {
        **base,
        "continuum": [(0.5, 10.0, 300.0), (0.5, 12.0, 310.0)],
        "learned": [(0.5, 7.0, 299.0), (0.5, 9.0, 309.0)],
    }
    assert judge(target, agent_results(loaded, ok)).met
    worse = {**ok, "learned": [(0.5, 9.0, 302.0), (0.5, 11.0, 312.0)]}
    assert judge(target, agent_results(loaded, worse)).why == [
        "task time +2.0 ± 0.0 s against continuum",
        "TTFT p99 0.91 of continuum's",
    ]
