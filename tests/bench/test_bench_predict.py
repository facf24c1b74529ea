"""`kvprefetch bench predict` prints one JSON object with its figures (no timing thresholds)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from app.predict import compiled
from app.predict.predictors import HORIZON_GRID
from bench.predict import PLANNER_HORIZONS
from kvprefetch_cli import cli
from tests.conftest import small_model_dir

BATCH = {
    "service_p_within",
    "table_p_within",
    "table_matrix",
    "compiled",
    "booster_1_thread",
    "booster_2_threads",
    "features_from_views",
    "features_reference",
    "table_from_views",
}


def test_bench_predict_reports_the_service_beside_the_booster_at_both_horizon_sets(
    tmp_path: Path,
) -> None:
    # A small model: the JSON is what is checked here, and the bundled model's cold compile
    # alone takes a minute or two (tests/predict/test_predictors_fast.py compiles that one).
    model = small_model_dir(tmp_path / "small")
    result = CliRunner().invoke(
        cli,
        [
            "bench",
            "predict",
            "--model",
            str(model),
            "--sessions",
            "50",
            "--rounds",
            "1",
            "--pass-sessions",
            "60,90",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout.strip().splitlines()[-1])
    assert doc["sessions"] == 50
    has_compiled = compiled.available()
    assert doc["backend"] == ("lleaves" if has_compiled else "booster")
    for name, horizons in (("planner", PLANNER_HORIZONS), ("grid", HORIZON_GRID)):
        part = doc[name]
        assert (part["horizons"], part["rows"]) == (list(horizons), 50 * len(horizons))
        assert set(part["batch_ms"]) == BATCH
        timed = {k: v for k, v in part["batch_ms"].items() if k != "compiled" or has_compiled}
        assert all(v > 0 for v in timed.values())
        assert all(v is None or v > 0 for v in part["ratios"].values())
    single = doc["single_session_ms"]
    assert set(single) == {
        "horizons",
        "service_p_within",
        "compiled",
        "booster_1_thread",
        "table_upsert",
    }
    assert all(v > 0 for k, v in single.items() if k != "compiled" or has_compiled)
    assert (
        doc["target"]["horizons"] == list(PLANNER_HORIZONS) and doc["target"]["met"] is None
    )  # not 10,000
    assert len(doc["load_average_1m"]) == 2
    if has_compiled:
        assert (
            doc["compiled_load_seconds"]["compile"] > 0
            and doc["compiled_load_seconds"]["from_cache"] > 0
        )
    # The service's own pass beside the table path, at each size asked, in the same run.
    service = doc["service"]["memory"]
    assert set(service) == {"60", "90"}
    for n, part in service.items():
        assert part["sessions"] == int(n)
        for label in ("pass_live", "pass_live_and_shadow"):
            figures = part[label]
            assert figures["table_rows"] == int(n) and figures["advised"] <= int(n)
            assert figures["advised"] > 0 and figures["chunks"] >= 1
            assert all(figures[k] > 0 for k in ("ms", "cpu_ms", "longest_chunk_ms"))
        assert part["table_p_within_ms"] > 0 and part["pages_path_live_ms"] > 0
        in_loop = part["pass_in_loop"]
        for label in ("live", "live_and_shadow"):
            assert in_loop[label]["quiet_ms"] > 0 and in_loop[label]["ingesting_ms"] > 0
        read = part["refresh_read"]
        assert read["sessions"] == int(n) and read["ms"] > 0 and read["with_residency_ms"] > 0
        assert all(v > 0 for v in part["ratios"].values())
