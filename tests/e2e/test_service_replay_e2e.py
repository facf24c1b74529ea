"""The closed loop over HTTP: `kvprefetch replay --via URL --speed X --policy service` against a
real service (its own process), its clock at the replay's pace (KVP_CLOCK_SPEED), signals on.

The service's own orders drive the simulated cluster (sim/served.py): its scheduler issues
prefetches, the cluster pulls them (GET /v1/orders), moves the blocks over its simulated links
and reports progress, and the sessions come back where the blocks landed. The service's totals
(GET /v1/scheduler, /metrics) show them issued, completed and used. The same slice replayed with
the `none` policy (the simulator's LRU; nobody carries the service's orders out) shows no order
started or reported, and the cluster prefetches nothing.

The model is one trained here, in a second, on the signals of an earlier slice of the same trace
(with a single LightGBM thread: on a loaded 2-core machine two threads took 50 times longer).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.ingest.eventlog import encode_events
from sim.remote import replay_via
from sim.replay import replay
from sim.scenario import Scenario, load_scenario
from sim.signals import SignalSettings
from sim.traces import TraceRequest, load_trace
from tests.conftest import TRACES
from tests.e2e.conftest import ServiceProcess
from training.dataset import build_dataset
from training.train import save_model, train

pytestmark = pytest.mark.slow

TRAIN_REQUESTS = 800  # the model learns from these (267 s of the trace)
# And the loop runs on the next ones (243 s): in two runs of them 19 and 17 prefetches were
# ordered, 14 and 12 landed, 64 and 47 GB were used. On the first 500 alone one run ordered 8,
# landed 6 and used 12 GB, and one test run in eleven on the loaded 2-core machine failed.
RUN_REQUESTS = 700
# About 12 s of wall time. A second of the machine's lag is SPEED seconds of the service's: at
# 40x, with four busy loops on the 2 cores, the cluster's first progress report came after the
# session had arrived and the scheduler withdrew 15 of 16 prefetches (2 runs in 3 failed); at
# 20x, 3 of 3 passed.
SPEED = 20.0
# Four instances with half the default HBM: contexts are evicted between turns, so there is
# something to prefetch, and room enough that a prefetch lands and stays until its turn comes.
HBM_KV_BYTES = 160_000_000_000


@pytest.fixture(scope="module")
def trace() -> list[TraceRequest]:
    return load_trace(TRACES / "mooncake_conversation_first60.jsonl")[
        : TRAIN_REQUESTS + RUN_REQUESTS
    ]


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    # The signal setting: half the returning turns signalled, 5 s ahead, and as many
    # false alarms as true signals.
    signals = SignalSettings(coverage=0.5, lead_median_seconds=5.0, false_alarms=1.0)
    return load_scenario("default").model_copy(
        update={"name": "half-hbm", "hbm_kv_bytes": HBM_KV_BYTES, "signals": signals}
    )


@pytest.fixture(scope="module")
def model_dir(
    tmp_path_factory: pytest.TempPathFactory, trace: list[TraceRequest], scenario: Scenario
) -> Path:
    out = tmp_path_factory.mktemp("signal-model")
    logged = replay(trace[:TRAIN_REQUESTS], scenario, policy="none", keep_events=True)
    log = out / "events.jsonl"
    log.write_bytes(encode_events(logged.events))
    model = train(build_dataset([log]), {"num_threads": 1}, num_boost_round=100)
    return save_model(model, out / "model")


def serve(
    factory: Callable[..., ServiceProcess], model_dir: Path, speed: float = SPEED
) -> ServiceProcess:
    svc = factory(
        env={
            "KVP_MODEL_DIR": str(model_dir),
            "KVP_CLOCK_SPEED": str(speed),
            "KVP_LOG_FSYNC": "false",
            # The default, 60 s of the service's clock, was 1.5 s of wall time at 40x: on a
            # loaded machine the cluster's reports came later than that and the scheduler gave
            # its prefetches up as overdue (8 busy loops on the 2 cores: 14 of 15 cancelled, the
            # test failed 1 run in 2; with 600 s, 15 s of wall time, it passed 3 in 3).
            "KVP_ORDER_OVERDUE_SECONDS": "600",
        }
    )
    svc.start()
    return svc


def counters(url: str) -> dict[str, float]:
    """Each kvprefetch counter summed over its labels, and the order_progress events taken
    (`order_progress_events`)."""
    out: dict[str, float] = {"order_progress_events": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name.startswith("kvprefetch_") and sample.name.endswith("_total"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
            if (
                sample.name == "kvprefetch_events_ingested_total"
                and sample.labels.get("type") == "order_progress"
            ):
                out["order_progress_events"] += sample.value
    return out


def landed_on_the_dashboard(url: str) -> tuple[int, int]:
    """The dashboard's prefetch bytes landed: now, and the most its series has drawn."""
    now = httpx.get(f"{url}/v1/dashboard/now", timeout=10).json()
    series = httpx.get(f"{url}/v1/dashboard/series?since_seconds=3600", timeout=10).json()
    return now["prefetch"]["landed_bytes"], max(series["series"]["landed_bytes"], default=0)


def run(
    url: str, trace: list[TraceRequest], scenario: Scenario, policy: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, float]]:
    """The run's summary, then the service's scheduler totals and counters."""
    result = replay_via(url, trace[TRAIN_REQUESTS:], scenario, policy=policy, speed=SPEED)
    totals = httpx.get(f"{url}/v1/scheduler", timeout=10).json()
    return result.summary, totals, counters(url)


def test_the_services_orders_are_issued_land_and_are_used(
    service_factory: Callable[..., ServiceProcess],
    model_dir: Path,
    trace: list[TraceRequest],
    scenario: Scenario,
) -> None:
    svc = serve(service_factory, model_dir)
    summary, totals, metrics = run(svc.url, trace, scenario, "service")

    assert summary["signals_emitted"] > 0
    # The cluster carried the service's prefetches out: pulled, started, landed, reported.
    done = summary["service_orders"]
    assert done["pulled"]["prefetch"] > 0
    assert done["completed"] > 0 and done["bytes_landed"] > 0
    assert summary["bytes_prefetched"] == done["bytes_landed"]
    # The service's own books: issued, completed (by the progress reported), and used by the
    # sessions that came back where the blocks landed.
    assert totals["orders"]["prefetch"] > 0 and totals["bytes_ordered"] > 0
    assert totals["completed"] > 0, f"{totals} {done}"  # a string: pytest shortens a tuple
    assert totals["bytes_used"] > 0, f"{totals} {done}"
    # Every progress report the cluster made was taken: accepted, then completed (or failed).
    assert metrics["order_progress_events"] == done["accepted"] + done["completed"] + done["failed"]
    assert metrics["kvprefetch_orders_completed_total"] > 0
    assert metrics["kvprefetch_prefetch_used_bytes_total"] > 0
    # The dashboard's prefetch figures and chart move.
    now, drawn = landed_on_the_dashboard(svc.url)
    assert now > 0 and drawn > 0


def test_with_a_policy_that_carries_no_order_out_nothing_lands(
    service_factory: Callable[..., ServiceProcess],
    model_dir: Path,
    trace: list[TraceRequest],
    scenario: Scenario,
) -> None:
    svc = serve(service_factory, model_dir)
    summary, totals, metrics = run(svc.url, trace, scenario, "none")

    assert summary["signals_emitted"] > 0
    assert "service_orders" not in summary
    # The scheduler may still plan, but nobody pulls its orders: none is started or reported,
    # and the cluster prefetches nothing. (An order whose blocks a demand load brought is
    # withdrawn, not completed: app/decide/scheduler.py.)
    assert summary["bytes_prefetched"] == 0
    assert metrics["order_progress_events"] == 0
    assert totals["bytes_wasted"] == 0
    assert landed_on_the_dashboard(svc.url) == (0, 0)
