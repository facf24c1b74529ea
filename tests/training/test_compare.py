"""training.compare and `kvprefetch evaluate`: models judged side by side on a held-out end."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pandas as pd
import pytest
from typer.testing import CliRunner

import training.compare as compare_module
from app.core.bundle import DEFAULT_MODEL_DIR, model_identity
from kvprefetch_cli import cli
from tests.conftest import trace_slice
from training import save_model, train
from training.compare import compare


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return trace_slice(tmp_path_factory.mktemp("compare"), "synthetic", 300)


@pytest.fixture(scope="module")
def quick_model(tmp_path_factory: pytest.TempPathFactory, tiny_rows: pd.DataFrame) -> Path:
    """A second model, unlike the bundled one: a few rounds on the tiny log's rows."""
    model = train(tiny_rows, seed=0, num_boost_round=5)
    return save_model(model, tmp_path_factory.mktemp("quick") / "quick")


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> Counter[tuple[str, str | None]]:
    """Each replay run (jobs 1: in this process), by (policy, model dir)."""
    seen: Counter[tuple[str, str | None]] = Counter()
    real = compare_module.replay

    def counted(*args: Any, **kwargs: Any) -> Any:
        seen[(kwargs["policy"], kwargs["model_dir"])] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(compare_module, "replay", counted)
    return seen


def test_the_split_is_by_time_and_every_replay_and_row_is_judged_after_it(
    trace: Path, quick_model: Path, tiny_rows: pd.DataFrame, tmp_path: Path
) -> None:
    r = compare(
        [DEFAULT_MODEL_DIR, quick_model],
        trace,
        holdout=0.25,
        baselines=("none", "oracle"),
        jobs=1,
        plots_dir=tmp_path / "plots",
    )
    times = [orjson.loads(line)["timestamp"] / 1000 for line in trace.read_text().splitlines()]
    cut = times[0] + 0.75 * (times[-1] - times[0])
    assert r["split"]["holdout"] == 0.25
    assert r["split"]["measure_from_seconds"] == round(cut, 3)
    judged = sum(t >= cut for t in times)
    assert 0 < judged < len(times)
    for entry in (*r["baselines"].values(), *r["models"]):
        assert [s["requests"] for s in entry["per_seed"]] == [judged]
    # The rows the models are scored on: those of the same trace's event log (tiny_rows: the
    # none replay's events, as events-from-trace writes them) whose decision is after the cut.
    held_out = int((tiny_rows.decision_ts >= cut).sum())
    assert 0 < held_out < len(tiny_rows)
    assert r["split"]["held_out_rows"] == held_out
    assert [m["prediction"]["rows"] for m in r["models"]] == [held_out, held_out]
    assert r["models"][1]["prediction"]["per_horizon"]
    written = [Path(p) for p in r["plots"]]
    assert sorted(p.name for p in written) == [
        "byte_hit_rate_over_time.png",
        "calibration.png",
        "per_horizon.png",
    ]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)


def test_baselines_are_replayed_once_and_each_model_once(
    trace: Path, quick_model: Path, replays: Counter[tuple[str, str | None]]
) -> None:
    r = compare(
        [DEFAULT_MODEL_DIR, quick_model], trace, baselines=("none", "lookahead", "oracle"), jobs=1
    )
    assert replays == {
        ("none", None): 1,
        ("lookahead", None): 1,
        ("oracle", None): 1,
        ("learned", str(DEFAULT_MODEL_DIR)): 1,
        ("learned", str(quick_model)): 1,
    }
    assert r["replays"] == 5


def test_under_signals_a_baseline_reading_them_is_replayed_once_per_seed_with_paired_margins(
    trace: Path, quick_model: Path, replays: Counter[tuple[str, str | None]]
) -> None:
    r = compare(
        [DEFAULT_MODEL_DIR, quick_model],
        trace,
        baselines=("none", "heuristic"),
        signals="coverage=1,lead_median=5,false_alarms=1",
        seeds=2,
        jobs=1,
    )
    assert replays == {
        ("none", None): 1,  # reads no signal: one replay stands for both seeds
        ("heuristic", None): 2,
        ("learned", str(DEFAULT_MODEL_DIR)): 2,
        ("learned", str(quick_model)): 2,
    }
    assert r["seeds"] == [0, 1]
    first, second = r["models"]
    assert [s["seed"] for s in second["per_seed"]] == [0, 1]
    diffs = [
        b["byte_hit_rate"] - a["byte_hit_rate"]
        for a, b in zip(first["per_seed"], second["per_seed"])
    ]
    assert second["margin_vs_first"]["byte_hit_rate"]["mean"] == pytest.approx(sum(diffs) / 2)
    assert first["margin_vs_first"]["byte_hit_rate"] == {"mean": 0.0, "sd": 0.0}
    none = r["baselines"]["none"]["byte_hit_rate"]
    assert second["margin_vs_none"]["byte_hit_rate"]["mean"] == pytest.approx(
        second["byte_hit_rate"] - none
    )


def test_the_command_prints_json_naming_both_models_and_the_split(
    trace: Path, quick_model: Path
) -> None:
    result = CliRunner().invoke(
        cli,
        [
            "evaluate",
            "--models",
            f"{DEFAULT_MODEL_DIR},{quick_model}",
            "--trace",
            str(trace),
            "--holdout",
            "0.3",
            "--jobs",
            "2",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [m["model"] for m in doc["models"]] == [
        model_identity(DEFAULT_MODEL_DIR),
        model_identity(quick_model),
    ]
    assert [m["label"] for m in doc["models"]] == ["default", "quick"]
    assert doc["split"]["holdout"] == 0.3 and doc["split"]["measure_from_seconds"] > 0
    assert list(doc["baselines"]) == ["none", "lookahead", "heuristic", "clairvoyant", "oracle"]


def test_the_table_is_whole_markdown_when_stdout_is_not_a_terminal(
    trace: Path, quick_model: Path
) -> None:
    result = CliRunner().invoke(
        cli,
        [
            "evaluate",
            "--models",
            f"{DEFAULT_MODEL_DIR},{quick_model}",
            "--trace",
            str(trace),
            "--jobs",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("| model or policy"))
    assert header.count("|") == 11 and len(header) > 80
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ")}
    assert {"default", "quick", "none", "oracle"} <= rows.keys()
    assert "…" not in result.stdout
    assert rows["quick"].split("|")[4].strip().startswith(("+", "-"))  # the margin vs the first


def test_seeds_need_signals() -> None:
    result = CliRunner().invoke(
        cli, ["evaluate", "--models", "m", "--trace", "t.jsonl", "--seeds", "3"]
    )
    assert result.exit_code == 2 and "--signals" in result.output
