"""`kvprefetch bench predict` prints one JSON object with its figures (no timing thresholds)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from app.cli import cli


def test_bench_predict_reports_the_service_beside_the_booster() -> None:
    result = CliRunner().invoke(cli, ["bench", "predict", "--sessions", "50", "--rounds", "1", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout.strip().splitlines()[-1])
    assert (doc["sessions"], doc["horizons"], doc["rows"]) == (50, 9, 450)
    assert set(doc["batch_ms"]) == {"service_p_within", "features_only", "booster_only"}
    assert all(v > 0 for v in [*doc["batch_ms"].values(), *doc["single_session_ms"].values()])
