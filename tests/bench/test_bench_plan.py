"""`kvprefetch bench plan` prints one JSON object with its figures (no timing thresholds)."""

from __future__ import annotations

from tests.bench.conftest import positive, run_bench


def test_bench_plan_reports_tick_percentiles_beside_the_reread_baseline() -> None:
    doc = run_bench(
        "plan",
        "--sessions",
        "2000",
        "--instances",
        "4",
        "--ticks",
        "20",
        "--page",
        "50",
        "--pass-sessions",
        "80",
    )
    assert (doc["sessions_tracked"], doc["instances"], doc["page_sessions"], doc["ticks"]) == (
        2000,
        4,
        50,
        20,
    )
    assert all(positive(doc["plan_tick_ms"][k]) for k in ("p50", "p99", "max"))
    assert doc["plan_tick_ms"]["p50"] <= doc["plan_tick_ms"]["p99"] <= doc["plan_tick_ms"]["max"]
    assert positive(doc["baseline_reread_all_ms"]["p50"]) and positive(doc["speedup_p50"])
    assert positive(doc["score_page_ms_median"]) and doc["target_p99_ms"] == 50.0
    # The service's pass over every live session, then a plan, beside the table path.
    service = doc["service"]["80"]
    assert service["sessions"] == 80 and service["tracked_by_scheduler"] > 0
    assert all(
        positive(service[k])
        for k in ("pass_live_ms", "table_p_within_ms", "plan_after_pass_ms", "first_plan_ms")
    )
