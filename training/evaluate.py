"""Judge a model where it matters: in the replay simulator, against today's policies and the oracle.

The model is trained on the first part of a trace's time span and judged on the rest: the replay
runs the whole trace (the earlier part warms the cluster up) and counts only the requests that
arrive in the judged part.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sim.replay import replay
from sim.scenario import Scenario, load_scenario
from sim.traces import TraceRequest, load_trace

BASELINES = ("none", "lookahead", "heuristic", "clairvoyant", "oracle")


def judged_from_seconds(trace: list[TraceRequest], train_fraction: float) -> float:
    start, end = trace[0].arrival_seconds, trace[-1].arrival_seconds
    return start + train_fraction * (end - start)


def evaluate(
    model_dir: Path | str,
    trace: Path | str,
    scenario: str | Scenario = "default",
    *,
    router: str = "sticky",
    train_fraction: float = 0.7,
    policies: tuple[str, ...] = (*BASELINES, "learned"),
) -> dict[str, Any]:
    """Replay `trace` under each policy; returns their summaries and the share of the none-to-oracle
    byte-hit-rate gap that `learned` closes (`gap_closed`), and that `clairvoyant`, a perfect
    model through the same planner, closes (`gap_closed_by_a_perfect_model`)."""
    requests = load_trace(trace)
    scen = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    measure_from = judged_from_seconds(requests, train_fraction)
    summaries = {
        p: replay(
            requests,
            scen,
            policy=p,
            router=router,
            model_dir=str(model_dir),
            measure_from_seconds=measure_from,
        ).summary
        for p in policies
    }
    out: dict[str, Any] = {
        "trace": Path(trace).name,
        "scenario": scen.name,
        "router": router,
        "judged_from_seconds": round(measure_from, 3),
        "policies": summaries,
    }
    if {"none", "oracle", "learned"} <= summaries.keys():
        gap = summaries["oracle"]["byte_hit_rate"] - summaries["none"]["byte_hit_rate"]
        won = summaries["learned"]["byte_hit_rate"] - summaries["none"]["byte_hit_rate"]
        out["gap_closed"] = round(won / gap, 4) if gap > 0 else None
        if "clairvoyant" in summaries:
            perfect = summaries["clairvoyant"]["byte_hit_rate"] - summaries["none"]["byte_hit_rate"]
            out["gap_closed_by_a_perfect_model"] = round(perfect / gap, 4) if gap > 0 else None
    return out
