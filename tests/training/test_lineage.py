"""The model card's lineage (issue 30): the logs' paths, hashes and span, the rows of every horizon,
the command and the code version; and every horizon of the data validated."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.core.bundle import DEFAULT_MODEL_DIR
from app.predict.predictors import LearnedPredictor
from kvprefetch_cli import cli
from sim.commands import events_from_trace
from tests.conftest import trace_slice
from training import build_dataset, train
from training.dataset import load_events
from training.lineage import CODE_PATHS, git_dirty

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def log_1000(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A log whose last 20% of time (about 58 s) is shorter than its 180 s horizon."""
    folder = tmp_path_factory.mktemp("log-1000")
    log = folder / "synthetic1000.events.jsonl"
    events_from_trace(
        trace_slice(folder, "synthetic", 1000), log, "default", "sticky", "none", None
    )
    return log


def test_every_horizon_of_the_rows_is_validated(log_1000: Path) -> None:
    rows = build_dataset([log_1000])
    horizons = {str(int(h)) for h in rows.horizon_seconds.unique()}
    assert "180" in horizons
    model = train(rows, num_boost_round=20)
    # Split against the whole span, the 180 s rows all fell in the training part.
    assert set(model.metrics["per_horizon"]) == horizons
    counts = model.data["rows_per_horizon"]
    assert set(counts) == horizons
    assert all(c["valid"] > 0 and c["train"] > 0 for c in counts.values())
    assert sum(c["train"] + c["valid"] for c in counts.values()) == len(rows)


def test_the_card_names_its_logs_span_command_and_code(
    tiny_log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log_dir = tmp_path / "logdir"
    log_dir.mkdir()
    shutil.copy(tiny_log, log_dir / "events-00000001.jsonl")
    out = tmp_path / "m"
    args = ["train", "--events", str(tiny_log), "--events", str(log_dir)]
    result = CliRunner().invoke(cli, [*args, "--out", str(out), "--max-rounds", "20", "--json"])
    assert result.exit_code == 0, result.output
    card = json.loads((out / "card.json").read_text())
    events = load_events(tiny_log)
    file_record, dir_record = card["data"]["log_files"]
    digest = hashlib.sha256(tiny_log.read_bytes()).hexdigest()
    assert file_record["path"] == str(tiny_log.resolve())
    assert file_record["sha256"] == digest
    assert file_record["events"] == len(events)
    assert (file_record["first_event_ts"], file_record["last_event_ts"]) == (
        events[0].ts,
        events[-1].ts,
    )
    # A log directory: its segments' bytes in order, each segment named.
    assert dir_record["path"] == str(log_dir.resolve())
    assert dir_record["sha256"] == digest
    assert dir_record["segments"] == [{"path": "events-00000001.jsonl", "sha256": digest}]
    assert card["data"]["span"] == {
        "first_event_ts": events[0].ts,
        "last_event_ts": events[-1].ts,
    }
    assert set(card["data"]["rows_per_horizon"]) == set(card["metrics_valid"]["per_horizon"])
    assert card["command"] == (
        f"kvprefetch train --events {tiny_log} --events {log_dir} --out {out} --max-rounds 20 "
        "--json"
    )
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS],
        capture_output=True,
        text=True,
        cwd=REPO,
    ).stdout.strip()
    assert card["code_version"] == {
        "git_commit": head,
        "git_dirty": bool(dirty),
        "kvprefetch": "0.1.0",
    }
    assert card["git_commit"] == head  # kept where older readers look


def test_a_change_anywhere_in_the_code_reads_dirty_from_the_package_folder(tmp_path: Path) -> None:
    """git_dirty runs from training/ (the package's folder): a change to app/ counts, a change
    to the docs does not."""

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    for path in ("app/engine.py", "training/train.py", "docs/index.md"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    assert git_dirty(tmp_path / "training") is False
    (tmp_path / "docs/index.md").write_text("changed\n")
    assert git_dirty(tmp_path / "training") is False
    (tmp_path / "app/engine.py").write_text("x = 2\n")
    assert git_dirty(tmp_path / "training") is True


def test_a_card_without_lineage_still_loads(tmp_path: Path) -> None:
    """Cards written before the lineage fields (the bundled one among them) serve as before."""
    old = tmp_path / "old"
    shutil.copytree(DEFAULT_MODEL_DIR, old)
    card = json.loads((old / "card.json").read_text())
    for key in ("code_version", "command"):
        card.pop(key, None)
    for key in ("log_files", "span", "rows_per_horizon"):
        card["data"].pop(key, None)
    (old / "card.json").write_text(json.dumps(card))
    predictor = LearnedPredictor(old, backend="booster")
    assert predictor.card["data"]["rows_train"] == card["data"]["rows_train"]
