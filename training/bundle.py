"""Rebuild the bundled default model (`make model`): both shared traces, first 70% by time.

    python -m training.bundle [--out models/default] [--traces DIR] [--train-fraction 0.7]

Each trace's first `train_fraction` of its time span is replayed (policy none, sticky router,
default scenario) into the event log the routers and engines would have posted; the model is
trained on those logs. The rest of each trace is left for judging (training/evaluate.py).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from app.ingest.eventlog import encode_events
from sim.replay import replay
from sim.scenario import load_scenario
from sim.traces import load_trace
from training.dataset import build_dataset
from training.evaluate import judged_from_seconds
from training.train import save_model, train

REPO = Path(__file__).resolve().parent.parent
SHARED_TRACES = REPO.parent / "shared" / "traces"
TRACE_FILES = ("mooncake_conversation_first60.jsonl", "mooncake_synthetic.jsonl")


def build(
    out: Path, traces_dir: Path = SHARED_TRACES, train_fraction: float = 0.7, seed: int = 0
) -> Path:
    scenario = load_scenario("default")
    with tempfile.TemporaryDirectory() as tmp:
        logs = []
        for name in TRACE_FILES:
            trace = load_trace(traces_dir / name)
            cut = judged_from_seconds(trace, train_fraction)
            head = [r for r in trace if r.arrival_seconds < cut]
            result = replay(head, scenario, policy="none", router="sticky", keep_events=True)
            log = Path(tmp) / f"{Path(name).stem}.events.jsonl"
            log.write_bytes(encode_events(result.events))
            logs.append(log)
        model = train(build_dataset(logs), seed=seed)
    return save_model(
        model,
        out,
        extra={
            "trained_on": {
                "traces": list(TRACE_FILES),
                "train_fraction": train_fraction,
                "scenario": scenario.name,
                "router": "sticky",
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
    args = parser.parse_args()
    path = build(args.out, args.traces, args.train_fraction, args.seed)
    print(f"wrote {path}/model.txt and card.json")


if __name__ == "__main__":
    main()
