"""training.thresholds: planner settings compared on a window inside the training part."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.core.bundle import DEFAULT_MODEL_DIR
from tests.conftest import trace_slice
from training.thresholds import compare_settings, main


def test_rows_per_setting_with_none_first(tmp_path: Path) -> None:
    trace = trace_slice(tmp_path, "conversation_first60", 400)
    rows = compare_settings(
        DEFAULT_MODEL_DIR, [trace], [{}, {"keep_min_p": 0.9}], window=(0.5, 1.0)
    )
    assert [(r["policy"], r["setting"]) for r in rows] == [
        ("none", None),
        ("learned", {}),
        ("learned", {"keep_min_p": 0.9}),
    ]
    for row in rows:
        cell = row["traces"][trace.name]
        assert 0.0 <= cell["byte_hit_rate"] <= 1.0
        assert row["mean_byte_hit_rate"] == cell["byte_hit_rate"]


def test_cli_prints_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = trace_slice(tmp_path, "synthetic", 300)
    main(
        [
            "--model",
            str(DEFAULT_MODEL_DIR),
            "--trace",
            str(trace),
            "--window",
            "0.6",
            "1.0",
            "--setting",
            '{"demote_max_p": 0.0}',
            "--json",
        ]
    )
    rows = json.loads(capsys.readouterr().out)
    assert [r["setting"] for r in rows] == [None, {"demote_max_p": 0.0}]
