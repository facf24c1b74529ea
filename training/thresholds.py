"""Choose the planner's thresholds on a window inside the training part, never on the judged part.

    python -m training.thresholds --model DIR --trace T.jsonl [--trace ...] [--window 0.5 0.7]
        [--router sticky] [--policy learned|heuristic] [--setting '{"keep_min_p": 0.3}' ...]
        [--json]

The model must have been trained on data before the window (e.g. `python -m training.bundle
--train-fraction 0.5 --out DIR`); each trace is replayed up to the window's end and only the
requests arriving inside it are counted. Each setting is a set of the planner's thresholds
(app.decide.advisor.Thresholds, by their settings' names); `{}` is the planner's defaults, and
`none` (plain LRU) is the baseline row.
The setting with the best mean byte hit rate across traces is the one to ship.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sim.replay import replay
from sim.scenario import load_scenario
from sim.traces import load_trace
from training.evaluate import judged_from_seconds

DEFAULT_SETTINGS: tuple[dict[str, float], ...] = (
    {},
    {"keep_min_p": 0.1},
    {"keep_min_p": 0.3},
    {"keep_horizon_seconds": 120.0},
    {"keep_horizon_seconds": 600.0},
    {"demote_max_p": 0.2},
)


def compare_settings(
    model_dir: Path | str,
    traces: Sequence[Path | str],
    settings: Sequence[dict[str, float]],
    *,
    window: tuple[float, float] = (0.5, 0.7),
    router: str = "sticky",
    scenario: str = "default",
    policy: str = "learned",
) -> list[dict[str, Any]]:
    """One row per setting (the first is `none`): byte hit rate and stall per trace, and their
    means.
    `policy`: the planner's driver, `learned` (advice straight to the cluster) or `scheduled`."""
    scen = load_scenario(scenario)
    runs: list[tuple[str, dict[str, float] | None]] = [
        ("none", None),
        *((policy, s) for s in settings),
    ]
    rows: list[dict[str, Any]] = [{"policy": p, "setting": s, "traces": {}} for p, s in runs]
    for trace_path in traces:
        trace = load_trace(trace_path)
        start, end = judged_from_seconds(trace, window[0]), judged_from_seconds(trace, window[1])
        head = [r for r in trace if r.arrival_seconds < end]
        for row, (policy, setting) in zip(rows, runs):
            s = replay(
                head,
                scen,
                policy=policy,
                router=router,
                model_dir=str(model_dir),
                measure_from_seconds=start,
                planner_options=setting,
            ).summary
            row["traces"][Path(trace_path).name] = {
                "byte_hit_rate": s["byte_hit_rate"],
                "stall_seconds_total": s["stall_seconds_total"],
                "bytes_prefetched": s["bytes_prefetched"],
                "bytes_prefetched_unused": s["bytes_prefetched_unused"],
            }
    for row in rows:
        per = row["traces"].values()
        row["mean_byte_hit_rate"] = round(statistics.fmean(t["byte_hit_rate"] for t in per), 4)
        row["mean_stall_seconds_total"] = round(
            statistics.fmean(t["stall_seconds_total"] for t in per), 3
        )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--trace", type=Path, action="append", required=True)
    parser.add_argument("--window", type=float, nargs=2, default=(0.5, 0.7), metavar=("FROM", "TO"))
    parser.add_argument("--router", default="sticky")
    parser.add_argument("--policy", default="learned", choices=("learned", "heuristic"))
    parser.add_argument("--scenario", default="default")
    parser.add_argument(
        "--setting",
        action="append",
        type=json.loads,
        help="Advisor keyword arguments as JSON; repeat. Default: a small grid.",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = compare_settings(
        args.model,
        args.trace,
        args.setting or DEFAULT_SETTINGS,
        window=tuple(args.window),
        router=args.router,
        scenario=args.scenario,
        policy=args.policy,
    )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    names = list(rows[0]["traces"])
    print(f"{'policy':<9} {'setting':<36}" + "".join(f"  {n[:28]:>28}" for n in names) + "  mean")
    for row in rows:
        setting = "-" if row["setting"] is None else json.dumps(row["setting"])
        cells = "".join(f"  {row['traces'][n]['byte_hit_rate']:>28.4f}" for n in names)
        print(f"{row['policy']:<9} {setting:<36}{cells}  {row['mean_byte_hit_rate']:.4f}")


if __name__ == "__main__":
    main()
