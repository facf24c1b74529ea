"""The retraining child process's entry point (training/retrain_job.py): which log segments it
reads, what it writes, and how it fails."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest

from app.ingest.eventlog import segment_path
from training.retrain_job import main, select_segments


def test_the_newest_segments_up_to_the_byte_budget_and_the_newest_always(tmp_path: Path) -> None:
    for number, size in ((1, 300), (2, 200), (3, 100)):
        segment_path(tmp_path, number).write_bytes(b"x" * size)
    (tmp_path / "notes.txt").write_text("not a segment")
    names = [p.name for p in select_segments(tmp_path, 300)]
    assert names == ["events-00000002.jsonl", "events-00000003.jsonl"]
    assert [p.name for p in select_segments(tmp_path, 10)] == ["events-00000003.jsonl"]
    assert len(select_segments(tmp_path, 10_000)) == 3
    assert select_segments(tmp_path / "missing", 10_000) == []


def test_it_trains_on_the_log_and_names_the_model(
    tmp_path: Path, tiny_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log_dir = tmp_path / "events"
    log_dir.mkdir()
    shutil.copy(tiny_log, segment_path(log_dir, 1))
    out = tmp_path / ".r1.partial"
    code = main(["--log-dir", str(log_dir), "--out", str(out), "--name", "r1", "--max-rounds", "5"])
    assert code == 0
    metrics = json.loads(capsys.readouterr().out)
    card = json.loads((out / "card.json").read_text())
    assert card["name"] == "r1"  # the version the service will show, not the partial name
    assert card["data"]["logs"] == ["events-00000001.jsonl"]
    assert card["data"]["valid_fraction"] == 0.2  # split by time (training/train.py)
    assert card["metrics_valid"] == metrics
    assert card["retrain"]["segments"] == 1
    assert (out / "model.txt").exists()


def test_a_log_with_nothing_to_learn_from_exits_1_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["--log-dir", str(tmp_path / "nothing"), "--out", str(out), "--name", "r"]) == 1
    assert "no event log segments" in capsys.readouterr().err
    assert not out.exists()


def test_the_service_starts_the_child_by_this_module() -> None:
    # app/predict/retrain.py names it as text (the service never imports training).
    from app.predict.retrain import RETRAIN_JOB_MODULE

    job = importlib.import_module(RETRAIN_JOB_MODULE)
    assert job.main is main
