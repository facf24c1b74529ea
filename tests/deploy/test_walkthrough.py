"""`make walkthrough` (deploy/walkthrough.sh), the data scientist's round trip the docs show
(docs/data-science/walkthrough.md includes the script itself): from an event log to two models
trained, tracked in a real MLflow store, compared, registered, one shadowing the other in a real
service under traffic, then promoted; every result naming the data and the model it came from.

A slice of the trace at a high speed keeps it to a minute or two; the documented run is the same
script on the whole trace.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TRACES
from tests.ports import is_in_use, retry_in_use

pytestmark = pytest.mark.slow

SCRIPT = REPO / "deploy" / "walkthrough.sh"
# 200 s of the trace at 120x; the service's keep horizon (the judge's) 60 s, so the shadow's
# pairs of the first 140 s are judged (at the default 300 s the slice would have to be longer).
REQUESTS = 600
SPEED = 120
KEEP_HORIZON_SECONDS = 60
SCRIPT_TIMEOUT_SECONDS = 900


def test_the_walkthrough_trains_tracks_compares_shadows_and_promotes(tmp_path: Path) -> None:
    trace = tmp_path / "slice.jsonl"
    with (TRACES / "mooncake_conversation_first60.jsonl").open() as f:
        trace.write_text("".join(line for _, line in zip(range(REQUESTS), f)))

    def run(port: int) -> tuple[Path, str]:
        walk = tmp_path / f"walk-{port}"
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("KVP_", "MLFLOW_"))},
            "VENV": str(Path(sys.executable).parent.parent),
            "KVP_PORT": str(port),
            "WALK_TRACE": str(trace),
            "WALK_DIR": str(walk),
            "WALK_SPEED": str(SPEED),
            "KVP_KEEP_HORIZON_SECONDS": str(KEEP_HORIZON_SECONDS),
        }
        done = subprocess.run(
            ["bash", str(SCRIPT)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=SCRIPT_TIMEOUT_SECONDS,
            check=False,
        )
        if done.returncode != 0 and is_in_use(done.stderr):
            raise RuntimeError(f"port {port}: address in use")
        assert done.returncode == 0, done.stderr[-4000:]
        return walk, done.stdout

    walk, stdout = retry_in_use(run)

    # Each card names its log by path and content hash, and the span of event time it covers.
    log = walk / "events.jsonl"
    digest = hashlib.sha256(log.read_bytes()).hexdigest()
    for name in ("a", "b"):
        card = json.loads((walk / "models" / name / "card.json").read_text())
        (record,) = card["data"]["log_files"]
        assert record["path"] == str(log.resolve()) and record["sha256"] == digest
        assert card["data"]["span"]["first_event_ts"] < card["data"]["span"]["last_event_ts"]

    # The comparison names each model by its directory and card, and the split it judged on.
    result = json.loads((walk / "evaluate.json").read_text())
    named = {m["label"]: m["model"] for m in result["models"]}
    assert set(named) == {"default", "a", "b"}
    assert Path(named["b"]["dir"]).resolve() == (walk / "models" / "b").resolve()
    card_b = (walk / "models" / "b" / "card.json").read_bytes()
    assert named["b"]["card_sha256"] == hashlib.sha256(card_b).hexdigest()
    assert result["split"]["holdout"] == 0.3 and result["split"]["measure_from_seconds"] > 0

    # The shadow was judged beside the serving model on the same sessions before the promote.
    before = json.loads((walk / "model-before-promote.json").read_text())
    assert before["version"] == "a" and before["shadow"]["version"] == "b"
    assert before["comparison"]["paired"] > 0 and before["comparison"]["judged"] > 0
    # Both hit rates scored, though at 60x a request reaches the service ticks after its stamp.
    for slot in ("live", "shadow"):
        assert before[slot]["hits"] + before[slot]["misses"] > 0, before[slot]

    # The registry's last word: b holds the serving alias, a none.
    versions = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"name"')]
    assert versions[-2:] == [
        {**versions[-2], "version": 1, "aliases": []},
        {**versions[-1], "version": 2, "aliases": ["serving"]},
    ]

    # The service's event log has every model change, so outcomes join to the model that served.
    changes = [
        json.loads(line)
        for segment in sorted((walk / "service" / "events").iterdir())
        for line in segment.read_text().splitlines()
        if '"model_changed"' in line
    ]
    assert [(c["slot"], c["action"], c["version"]) for c in changes] == [
        ("shadow", "loaded", "b"),
        ("serving", "promoted", "b"),
        ("shadow", "cleared", None),
    ]
