"""One scheduled retraining run, as a child process of the service (app/predict/retrain.py).

    python -m training.retrain_job --log-dir var/events --out models/retrained/.r1.partial \
        --name r1 [--max-log-bytes N] [--valid-fraction 0.2] [--max-rounds 300]

Trains on the newest segments of the service's own event log (up to --max-log-bytes; at least
the newest), split by time as `kvprefetch train` is (the older part trains, the newest
--valid-fraction stops it early; never at random), and writes model.txt and card.json to --out
with `name` the model's version. Its own process so that minutes of CPU stay off the service's
event loop, and so that the service package never imports training (tests/test_layout.py).
Prints the validation metrics as one JSON line on stdout; exits 1 with the reason on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from app.core.errors import KvpError
from app.ingest.eventlog import list_segments


def select_segments(log_dir: Path, max_bytes: int) -> list[Path]:
    """The newest segments whose sizes add up to at most `max_bytes` (the newest always)."""
    chosen: list[Path] = []
    total = 0
    for _, path in reversed(list_segments(log_dir)):
        size = path.stat().st_size
        if chosen and total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    return list(reversed(chosen))


def run(
    log_dir: Path,
    out: Path,
    name: str,
    *,
    max_log_bytes: int,
    valid_fraction: float,
    max_rounds: int,
    seed: int,
) -> dict[str, object]:
    from training.dataset import build_dataset
    from training.train import save_model, train

    segments = select_segments(log_dir, max_log_bytes)
    if not segments:
        raise ValueError(f"no event log segments in {log_dir}")
    # A directory of links to the chosen segments reads as a log (the newest one's partial last
    # line, a batch being appended now, is skipped as recovery would).
    with tempfile.TemporaryDirectory(prefix="kvp-retrain-") as tmp:
        for path in segments:
            (Path(tmp) / path.name).symlink_to(path.resolve())
        rows = build_dataset([Path(tmp)])
    model = train(rows, valid_fraction=valid_fraction, seed=seed, num_boost_round=max_rounds)
    model.data["logs"] = [p.name for p in segments]
    save_model(
        model,
        out,
        extra={
            "name": name,
            "retrain": {
                "segments": len(segments),
                "bytes": sum(p.stat().st_size for p in segments),
            },
        },
    )
    return dict(model.metrics)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.retrain_job")
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--max-log-bytes", type=int, default=256 * 1024 * 1024)
    parser.add_argument("--valid-fraction", type=float, default=0.2)
    parser.add_argument("--max-rounds", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        metrics = run(
            args.log_dir,
            args.out,
            args.name,
            max_log_bytes=args.max_log_bytes,
            valid_fraction=args.valid_fraction,
            max_rounds=args.max_rounds,
            seed=args.seed,
        )
    except (KvpError, ValueError, OSError) as exc:
        print(f"retraining failed: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
