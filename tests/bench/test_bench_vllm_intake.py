"""`kvprefetch bench vllm-intake` runs end to end at a tiny size and prints the documented JSON
(no timing thresholds)."""

from __future__ import annotations

import pytest

from tests.bench.conftest import positive, run_bench

pytestmark = pytest.mark.slow


def test_bench_vllm_intake_prints_the_documented_json() -> None:
    r = run_bench("vllm-intake", "--rounds", "1", "--publishers", "2", "--batches", "3")
    assert positive(r["zmq_events_per_second"]) and positive(r["http_events_per_second"])
    ratio = r["zmq_events_per_second"] / r["http_events_per_second"]
    assert r["ratio_zmq_to_http"] == pytest.approx(ratio, abs=0.002)
    assert r["within_target"] is (r["zmq_events_per_second"] >= r["target_events_per_second"])
    assert (r["rounds"], r["publishers"], r["batches_per_publisher"]) == (1, 2, 3)
    assert r["events_per_batch"] == 16
    assert [len(r["samples"][k]) for k in ("zmq", "http")] == [1, 1]
    assert isinstance(r["python"], str) and positive(r["cpu_count"])
