"""Rebuild the bundled default model (`make model`): both shared traces, first 70% by time, each
replayed without signals and with a few signal settings (mixed logs).

    python -m training.bundle [--out models/default] [--traces DIR] [--train-fraction 0.7]
                              [--logs var/bundle-logs]

Each trace's first `train_fraction` of its time span is replayed (policy none, sticky router,
default scenario) into the event log the routers and engines would have posted: once as it is
(a deployment that sends no signals), and once for each of SIGNAL_SETTINGS_PER_TRACE signal
settings (sim/signals.py) drawn for that trace by `signal_settings`. The deployment's own
features (app/predict/features.py, DeploymentSignals) tell the two kinds of log apart: the rows
with no signals in their deployment train one model, the others another, and the two are joined
into one model.txt that picks by those features (SPLIT_BY). The rest
of each trace is left for judging (training/evaluate.py). The logs are kept (`--logs`, default
var/bundle-logs/): the card names each by its path and SHA-256, and the replays are
deterministic, so a rebuild from the same code writes the same bytes.

Beside them, generated agent tasks (sim/workloads.py, `agent_trace`), so the tool features
(app/predict/tool_durations.py, TOOL_FEATURES) are learned from calls whose tools signal their
start and finish: one trace per AGENT_SEEDS seed, its first `train_fraction` by time, replayed
closed-loop in the `agents` scenario with AGENT_TOOL_SHARE of its sessions instrumented (they go
to the signalled part). The seeds (1000 and up) are disjoint from the ones `kvprefetch targets`
judges its agent-task traces on (sim/targets.py: 0 to 3), so no judged draw is trained on.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd

from app.ingest.eventlog import encode_events
from sim.replay import replay
from sim.scenario import Scenario, load_scenario
from sim.signals import with_signals
from sim.traces import TraceRequest, load_trace
from sim.workloads import AgentWorkload, agent_trace
from training.dataset import build_dataset
from training.evaluate import judged_from_seconds
from training.train import save_model, train_split

REPO = Path(__file__).resolve().parent.parent
BUNDLE_LOGS = REPO / "var" / "bundle-logs"
SHARED_TRACES = REPO.parent / "shared" / "traces"
TRACE_FILES = ("mooncake_conversation_first60.jsonl", "mooncake_synthetic.jsonl")
# Signal settings per trace, one level of each axis apiece (a Latin square: every coverage, lead
# and false-alarm level is used once per trace, in an order drawn per trace), so the model sees a
# spread of deployments rather than the few settings the README's tables judge.
COVERAGES = (0.25, 0.5, 0.75, 1.0)
LEAD_MEDIANS_SECONDS = (2.0, 4.0, 8.0, 16.0)
FALSE_ALARMS = (0.0, 0.5, 1.0, 2.0)
SIGNAL_SETTINGS_PER_TRACE = len(COVERAGES)
# Rows of a deployment that sends no signals (0 signals per arrival: every plain log's) train
# one model, the signalled rows another, joined into one model.txt that routes each row by this
# feature (training/train.py, train_split): the signalled logs cannot move what the model says
# where no signals come, which is then the model trained on the plain logs alone.
SPLIT_BY = ("deployment_signals_per_arrival", 1e-9)
# Generated agent-task traces (the generator's defaults), one per seed: disjoint from the seeds
# `kvprefetch targets` draws its judged agent traces from (0 to 3).
AGENT_SEEDS = (1000, 1001)
# Of an agent trace's sessions, the share whose tool calls are signalled (as an instrumented
# framework would: sim/signals.py `tools`).
AGENT_TOOL_SHARE = 0.8
AGENT_SCENARIO = "agents"


def agent_head(seed: int, train_fraction: float) -> list[TraceRequest]:
    """The generated agent trace of `seed`, its first `train_fraction` by time."""
    trace = agent_trace(AgentWorkload(seed=seed))
    cut = judged_from_seconds(trace, train_fraction)
    return [r for r in trace if r.arrival_seconds < cut]


def signal_settings(trace_index: int, seed: int = 0) -> list[dict[str, float | int]]:
    """The signal settings (sim/signals.py field names) a trace is replayed with: deterministic
    for (trace_index, seed), a different draw for each trace."""
    rng = random.Random(1000 * seed + trace_index)
    leads, alarms = list(LEAD_MEDIANS_SECONDS), list(FALSE_ALARMS)
    rng.shuffle(leads)
    rng.shuffle(alarms)
    return [
        {
            "coverage": coverage,
            "lead_median_seconds": lead,
            "false_alarms": alarm,
            "seed": 100 * trace_index + k + 1,
        }
        for k, (coverage, lead, alarm) in enumerate(zip(COVERAGES, leads, alarms))
    ]


def _logged_rows(
    head: list[TraceRequest], scenario: Scenario, log: Path, signals: dict[str, dict[str, int]]
) -> pd.DataFrame:
    """`head` replayed (policy none, sticky) into the event log at `log`, and its rows; each
    signal kind's counts added to `signals`."""
    result = replay(head, scenario, policy="none", router="sticky", keep_events=True)
    log.write_bytes(encode_events(result.events))
    data = build_dataset([log])
    for kind, counts in data.attrs["signals"].items():
        total = signals.setdefault(kind, {"signals": 0, "followed": 0})
        total["signals"] += counts["signals"]
        total["followed"] += counts["followed"]
    return data


def repo_relative(record: dict[str, Any]) -> dict[str, Any]:
    """A card's log record with its path relative to the checkout where it lies inside it (a
    bundled card names the logs as any clone would find them)."""
    path = Path(record["path"])
    if path.is_relative_to(REPO):
        return {**record, "path": str(path.relative_to(REPO))}
    return record


def build(
    out: Path,
    traces_dir: Path = SHARED_TRACES,
    train_fraction: float = 0.7,
    seed: int = 0,
    logs_dir: Path = BUNDLE_LOGS,
    command: str | None = None,
) -> Path:
    started = time.perf_counter()
    scenario = load_scenario("default")
    logs_used: list[dict[str, Any]] = []
    logs_dir.mkdir(parents=True, exist_ok=True)
    frames = []
    signals: dict[str, dict[str, int]] = {}
    for t, name in enumerate(TRACE_FILES):
        trace = load_trace(traces_dir / name)
        cut = judged_from_seconds(trace, train_fraction)
        head = [r for r in trace if r.arrival_seconds < cut]
        settings: list[dict[str, float | int] | None] = [None, *signal_settings(t, seed)]
        for k, setting in enumerate(settings):
            scen = scenario
            if setting is not None:
                scen = scenario.model_copy(
                    update={"signals": with_signals(scenario.signals, setting)}
                )
            log = logs_dir / f"{Path(name).stem}.{'plain' if setting is None else k}.jsonl"
            frames.append(_logged_rows(head, scen, log, signals))
            logs_used.append({"log": log.name, "signals": setting})
    agents = load_scenario(AGENT_SCENARIO)
    for agent_seed in AGENT_SEEDS:
        tools = {"tools": AGENT_TOOL_SHARE, "seed": agent_seed}
        scen = agents.model_copy(update={"signals": with_signals(agents.signals, tools)})
        head = agent_head(agent_seed, train_fraction)
        log = logs_dir / f"agent-tasks.{agent_seed}.jsonl"
        frames.append(_logged_rows(head, scen, log, signals))
        logs_used.append({"log": log.name, "agent_seed": agent_seed, "signals": tools})
    dataset = pd.concat(frames, ignore_index=True)
    dataset.attrs["signals"] = signals
    # concat keeps attrs only where all frames' agree: each log's lineage gathered here.
    dataset.attrs["logs"] = [r for f in frames for r in f.attrs.get("logs", [])]
    model = train_split(dataset, *SPLIT_BY, seed=seed)
    model.data["log_files"] = [repo_relative(r) for r in model.data["log_files"]]
    return save_model(
        model,
        out,
        command=command,
        extra={
            "trained_on": {
                "traces": list(TRACE_FILES),
                # Generated (sim/workloads.py's defaults), replayed closed-loop in this scenario.
                "agent_traces": {
                    "seeds": list(AGENT_SEEDS),
                    "scenario": AGENT_SCENARIO,
                    "tool_share": AGENT_TOOL_SHARE,
                },
                "train_fraction": train_fraction,
                "scenario": scenario.name,
                "router": "sticky",
                # Each trace's head, plain and with these signal settings (sim/signals.py).
                "logs": logs_used,
                "split_by": {"feature": SPLIT_BY[0], "threshold": SPLIT_BY[1]},
                "build_seconds": round(time.perf_counter() - started, 1),
            }
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "models" / "default")
    parser.add_argument("--traces", type=Path, default=SHARED_TRACES)
    parser.add_argument("--train-fraction", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--logs", type=Path, default=BUNDLE_LOGS, help="where the replayed event logs are kept"
    )
    args = parser.parse_args()
    # As typed (`python -m training.bundle ...`), not the module file's path.
    command = shlex.join(["python", "-m", "training.bundle", *sys.argv[1:]])
    path = build(args.out, args.traces, args.train_fraction, args.seed, args.logs, command)
    card = json.loads((path / "card.json").read_text())
    rows = card["data"]["rows_train"] + card["data"]["rows_valid"]
    seconds = card["trained_on"]["build_seconds"]
    print(f"wrote {path}/model.txt and card.json: {rows} rows, {seconds} s")


if __name__ == "__main__":
    main()
