"""Judge a model where it matters: in the replay simulator, against today's policies and the oracle.

The model is trained on the first part of a trace's time span and judged on the rest: the replay
runs the whole trace (the earlier part warms the cluster up) and counts only the requests that
arrive in the judged part.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.core.bundle import model_identity
from sim.replay import replay
from sim.scenario import Scenario, load_scenario
from sim.traces import judged_from_seconds, load_trace

__all__ = ["BASELINES", "evaluate", "judged_from_seconds"]

BASELINES = ("none", "lookahead", "heuristic", "clairvoyant", "oracle")


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
    model through the same planner, closes (`gap_closed_by_a_perfect_model`); the same two with
    `_unshared` on the byte hit rate without the blocks most requests carry (sim/metrics.py)."""
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
        # The model `learned` ran and the split it was judged on name the result.
        "model": model_identity(model_dir),
        "train_fraction": train_fraction,
        "trace": Path(trace).name,
        "scenario": scen.name,
        "router": router,
        "judged_from_seconds": round(measure_from, 3),
        "policies": summaries,
    }
    if {"none", "oracle", "learned"} <= summaries.keys():
        # On both byte hit rates: all reused bytes, and without the blocks most requests carry.
        for metric, suffix in (("byte_hit_rate", ""), ("byte_hit_rate_unshared", "_unshared")):
            gap = summaries["oracle"][metric] - summaries["none"][metric]
            won = summaries["learned"][metric] - summaries["none"][metric]
            out[f"gap_closed{suffix}"] = round(won / gap, 4) if gap > 0 else None
            if "clairvoyant" in summaries:
                perfect = summaries["clairvoyant"][metric] - summaries["none"][metric]
                out[f"gap_closed_by_a_perfect_model{suffix}"] = (
                    round(perfect / gap, 4) if gap > 0 else None
                )
    return out
