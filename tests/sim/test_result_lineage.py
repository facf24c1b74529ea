"""Results name the model `learned` ran and the time split (issue 30): replay and targets JSON."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.core.bundle import DEFAULT_MODEL_DIR, model_identity
from kvprefetch_cli import cli
from sim import targets as targets_module
from sim.targets import Case
from tests.conftest import trace_slice


def test_replay_json_names_the_model_and_where_it_measured(tmp_path: Path) -> None:
    trace = trace_slice(tmp_path, "synthetic", 200)
    model = tmp_path / "mine"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    args = ["replay", "--trace", str(trace), "--measure-from", "30", "--json"]
    result = CliRunner().invoke(cli, [*args, "--compare", "none,learned", "--model", str(model)])
    assert result.exit_code == 0, result.output
    none, learned = json.loads(result.stdout)["compare"]
    assert none["measure_from_seconds"] == learned["measure_from_seconds"] == 30.0
    assert "model" not in none  # it ran no model
    assert learned["model"] == {**model_identity(model), "serving": "learned (mine)"}


def test_a_model_that_does_not_load_is_not_named(tmp_path: Path) -> None:
    """The engine serves the heuristic then: the summary says so rather than name the dir."""
    trace = trace_slice(tmp_path, "synthetic", 100)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.txt").write_text("not a model\n")
    args = ["replay", "--trace", str(trace), "--policy", "learned", "--json"]
    result = CliRunner().invoke(cli, [*args, "--model", str(broken)])
    assert result.exit_code == 0, result.output
    named = json.loads(result.stdout)["model"]
    assert named["dir"] is None and named["card_sha256"] is None
    assert named["serving"].startswith("heuristic")


def test_targets_json_names_the_model_and_each_cases_split(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = trace_slice(tmp_path, "synthetic", 200)
    small = Case(trace.name, "sticky", ("none", "learned", "clairvoyant", "oracle"))
    monkeypatch.setattr(targets_module, "cases", lambda: [small])
    model = tmp_path / "mine"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    args = ["targets", "--traces", str(tmp_path), "--model", str(model), "--seeds", "1"]
    result = CliRunner().invoke(cli, [*args, "--jobs", "1", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["model"] == model_identity(model)
    assert doc["train_fraction"] == 0.7
    [case] = doc["cases"]
    requests = targets_module.load(trace.name, tmp_path)
    cut = targets_module.judged_from_seconds(requests, 0.7)
    assert case["measure_from_seconds"] == cut
    assert case["results"]["learned"]["model"]["card_sha256"] == doc["model"]["card_sha256"]
