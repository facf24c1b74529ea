"""`kvprefetch targets`: the cases replayed, and how each target is judged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sim.targets import (
    HALF,
    SYNTHETIC,
    Case,
    Target,
    cases,
    gap_closed,
    judge,
    markdown,
    run_case,
    targets,
)
from sim.traces import load_trace

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def summary(byte_hit_rate: float, stall: float = 10.0, moved: int = 0, unused: int = 0) -> Any:
    return {
        "byte_hit_rate": byte_hit_rate,
        "stall_seconds_total": stall,
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


def test_a_case_replays_its_policies_on_the_judged_part() -> None:
    case = Case(SYNTHETIC, "sticky", ("none", "oracle"), scenario="tight-hbm")
    results = run_case(case, TRACES, None)
    assert set(results) == {"none", "oracle"}
    assert results["oracle"]["byte_hit_rate"] >= results["none"]["byte_hit_rate"]
    # Judged on the last 30% by time: fewer requests than the trace holds.
    assert 0 < results["none"]["requests"] < len(load_trace(TRACES / SYNTHETIC))
    table = markdown([(case, results)], [])
    assert "synthetic, tight-hbm, sticky, signals off | oracle" in table
