"""`kvprefetch bench vllm-intake` runs end to end at a tiny size and prints the documented JSON
(no timing thresholds); its batches are vLLM's size by default."""

from __future__ import annotations

import msgspec
import pytest

from bench.vllm_intake import VLLM_EVENTS_PER_BATCH, payloads
from tests.bench.conftest import positive, run_bench

pytestmark = pytest.mark.slow


def test_bench_vllm_intake_prints_the_documented_json() -> None:
    r = run_bench("vllm-intake", "--rounds", "1", "--publishers", "2", "--batches", "3")
    for path in ("zmq", "http"):
        batches, events = r[f"{path}_batches_per_second"], r[f"{path}_events_per_second"]
        assert positive(batches) and batches <= events <= 2 * batches  # 1 or 2 events a batch
        (sample,) = r["samples"][path]
        assert sample == {"batches_per_second": batches, "events_per_second": events}
    ratio = r["zmq_batches_per_second"] / r["http_batches_per_second"]
    assert r["ratio_zmq_to_http"] == pytest.approx(ratio, abs=0.002)
    assert r["within_target"] is (r["zmq_batches_per_second"] >= r["target_batches_per_second"])
    assert (r["rounds"], r["publishers"], r["batches_per_publisher"]) == (1, 2, 3)
    assert r["events_per_batch"] == VLLM_EVENTS_PER_BATCH == 1.4
    assert isinstance(r["python"], str) and positive(r["cpu_count"])


def test_a_batch_holds_one_or_two_events_as_vllms_do_or_the_size_asked() -> None:
    sizes = [n for _, n in payloads("i", 2000, seed=1)]
    assert set(sizes) == {1, 2} and sum(sizes) / len(sizes) == pytest.approx(1.4, abs=0.05)
    sixteen = payloads("i", 20, seed=1, events_per_batch=16)
    assert {n for _, n in sixteen} == {16}
    for payload, n in sixteen[:3]:
        _, events, rank = msgspec.msgpack.decode(payload)
        assert len(events) == n and rank == 0
        # Every fourth event of a publisher's a removal, as the bench's mix has always been.
        assert [e["type"] for e in events].count("BlockRemoved") == 4
