"""`kvprefetch train`: a model from event logs, and clear errors for bad logs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.ingest.eventlog import encode_events
from app.predict.predictors import LearnedPredictor
from kvprefetch_cli import cli
from sim.commands import events_from_trace
from sim.replay import replay
from sim.scenario import load_scenario
from sim.traces import load_trace
from tests.conftest import TRACES, trace_slice

ROUNDS = ["--max-rounds", "30"]  # a short run: these tests are about the command, not the model


def test_train_writes_a_model_the_service_can_load(tmp_path: Path) -> None:
    trace = load_trace(TRACES / "mooncake_synthetic.jsonl")[:1500]
    log = tmp_path / "events.jsonl"
    log.write_bytes(encode_events(replay(trace, load_scenario("default"), keep_events=True).events))
    args = ["train", "--events", str(log), "--json", *ROUNDS]
    result = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)
    assert 0 < metrics["brier"] < 1 and metrics["rows"] > 0
    card = json.loads((tmp_path / "m" / "card.json").read_text())
    assert card["data"]["logs"] == ["events.jsonl"] and card["calibration_valid"]
    assert LearnedPredictor(tmp_path / "m").version == "m"
    # The same data and seed give the same model.
    again = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "m2")])
    assert (tmp_path / "m" / "model.txt").read_text() == (tmp_path / "m2" / "model.txt").read_text()
    assert json.loads(again.stdout) == metrics


def flat(output: str) -> str:
    """The CLI's error box, unwrapped."""
    return "".join(output.replace("│", "").split())


def test_bad_logs_are_named_with_their_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = CliRunner().invoke(
        cli, ["train", "--events", str(empty), "--out", str(tmp_path / "m")]
    )
    assert result.exit_code != 0 and "empty.jsonl:thelogholdsnoevents" in flat(result.output)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"type": "session_closed", "event_id": "a", "ts": 1, "session_id": "s"}\n'
        '{"type": "session_closed"}\n'
    )
    result = CliRunner().invoke(cli, ["train", "--events", str(bad), "--out", str(tmp_path / "m")])
    assert result.exit_code != 0 and "bad.jsonl:2:" in flat(result.output)


@pytest.fixture(scope="module")
def tiny_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The event log of the synthetic trace's first 300 requests."""
    folder = tmp_path_factory.mktemp("tiny-log")
    log = folder / "synthetic300.events.jsonl"
    events_from_trace(trace_slice(folder, "synthetic", 300), log, "default", "sticky", "none", None)
    return log


# rich draws bars when it believes stderr is an interactive terminal; these say it is.
TERMINAL = {"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"}


def test_bars_go_to_stderr_and_leave_json_alone(tiny_log: Path, tmp_path: Path) -> None:
    args = ["train", "--events", str(tiny_log), "--out", str(tmp_path / "m"), "--json", *ROUNDS]
    drawn = CliRunner(env=TERMINAL).invoke(cli, args)
    assert drawn.exit_code == 0, drawn.output
    assert (
        "replaying synthetic300.events.jsonl" in drawn.stderr and "boosting rounds" in drawn.stderr
    )
    quiet = CliRunner(env=TERMINAL).invoke(cli, [*args, "--quiet"])
    assert quiet.exit_code == 0 and quiet.stderr == ""
    piped = CliRunner().invoke(cli, args)  # not a terminal: no bars, and --json says nothing else
    assert piped.exit_code == 0 and piped.stderr == ""
    assert json.loads(drawn.stdout) == json.loads(quiet.stdout) == json.loads(piped.stdout)


def test_tune_is_deterministic_and_recorded_in_the_card(tiny_log: Path, tmp_path: Path) -> None:
    cards = []
    for name in ("a", "b"):
        result = CliRunner().invoke(
            cli,
            [
                "train",
                "--events",
                str(tiny_log),
                "--out",
                str(tmp_path / name),
                "--tune",
                "2",
                "--seed",
                "7",
                "--json",
                *ROUNDS,
            ],
        )
        assert result.exit_code == 0, result.output
        json.loads(result.stdout)
        cards.append(json.loads((tmp_path / name / "card.json").read_text()))
    tuning = cards[0]["tuning"]
    assert tuning["n_trials"] == 2 and len(tuning["trials"]) == 2 and tuning["seed"] == 7
    assert {k: cards[0]["params"][k] for k in tuning["best_params"]} == tuning["best_params"]
    assert cards[1]["tuning"] == tuning


def test_tune_without_optuna_names_the_extra(
    tiny_log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "optuna", None)
    result = CliRunner().invoke(
        cli, ["train", "--events", str(tiny_log), "--out", str(tmp_path / "m"), "--tune", "2"]
    )
    assert result.exit_code != 0 and "kvprefetch[tune]" in flat(result.output)
    assert not (tmp_path / "m").exists()
