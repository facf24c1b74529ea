"""`kvprefetch train`: a model from event logs, and clear errors for bad logs."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from app.cli import cli
from app.engine.eventlog import encode_events
from app.engine.predictor import LearnedPredictor
from sim.replay import replay
from sim.scenario import load_scenario
from sim.traces import load_trace
from tests.conftest import TRACES


def test_train_writes_a_model_the_service_can_load(tmp_path: Path) -> None:
    trace = load_trace(TRACES / "mooncake_synthetic.jsonl")[:1500]
    log = tmp_path / "events.jsonl"
    log.write_bytes(encode_events(replay(trace, load_scenario("default"), keep_events=True).events))
    result = CliRunner().invoke(cli, ["train", "--events", str(log), "--out", str(tmp_path / "m"), "--json"])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)
    assert 0 < metrics["brier"] < 1 and metrics["rows"] > 0
    card = json.loads((tmp_path / "m" / "card.json").read_text())
    assert card["data"]["logs"] == ["events.jsonl"] and card["calibration_valid"]
    assert LearnedPredictor(tmp_path / "m").version == "m"
    # The same data and seed give the same model.
    again = CliRunner().invoke(cli, ["train", "--events", str(log), "--out", str(tmp_path / "m2"), "--json"])
    assert (tmp_path / "m" / "model.txt").read_text() == (tmp_path / "m2" / "model.txt").read_text()
    assert json.loads(again.stdout) == metrics


def flat(output: str) -> str:
    """The CLI's error box, unwrapped."""
    return "".join(output.replace("│", "").split())


def test_bad_logs_are_named_with_their_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = CliRunner().invoke(cli, ["train", "--events", str(empty), "--out", str(tmp_path / "m")])
    assert result.exit_code != 0 and "empty.jsonl:thelogholdsnoevents" in flat(result.output)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "session_closed", "event_id": "a", "ts": 1, "session_id": "s"}\n{"type": "session_closed"}\n')
    result = CliRunner().invoke(cli, ["train", "--events", str(bad), "--out", str(tmp_path / "m")])
    assert result.exit_code != 0 and "bad.jsonl:2:" in flat(result.output)
