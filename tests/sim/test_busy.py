"""The `busy` scenario (data/scenarios/busy.toml): requests queue for an instance, and the
summary's queue wait (`queue_seconds_p50`) says how long."""

from __future__ import annotations

import functools
from typing import Any

from sim.replay import replay
from sim.scenario import load_scenario
from sim.traces import TraceRequest
from tests.sim.test_cluster import TRACE_FILES, trace_prefix


def test_queue_wait_is_arrival_to_admission() -> None:
    """One slot, three requests at once: they wait 0, one and two requests' compute."""
    scenario = load_scenario("default").model_copy(
        update={"instances": 1, "max_running_requests": 1}
    )
    trace = [TraceRequest(i, 0.0, 512, 100, (10 * i,)) for i in range(3)]
    result = replay(trace, scenario)
    waits = [r.admitted_at - r.arrival for r in result.requests]  # type: ignore[operator]
    assert waits[0] == 0.0 and 0 < waits[1] < waits[2]
    assert result.summary["queue_seconds_p50"] == round(waits[1], 4)


def test_no_queue_in_the_default_scenario() -> None:
    summary = replay(trace_prefix(TRACE_FILES[0], 300), load_scenario("default")).summary
    assert summary["queue_seconds_p50"] == 0.0


@functools.cache
def busy(policy: str) -> dict[str, Any]:
    return replay(trace_prefix(TRACE_FILES[0], None), load_scenario("busy"), policy=policy).summary


def test_busy_queues_for_seconds_on_the_conversation_trace() -> None:
    scenario = load_scenario("busy")
    default = load_scenario("default")
    # Only the concurrency limit differs from the default cluster.
    assert scenario.max_running_requests < default.max_running_requests
    assert scenario.model_dump(exclude={"name", "description", "max_running_requests"}) == (
        default.model_dump(exclude={"name", "description", "max_running_requests"})
    )
    assert busy("none")["queue_seconds_p50"] >= 1.0


def test_lookahead_has_something_to_do_in_busy() -> None:
    none, lookahead = busy("none"), busy("lookahead")
    assert lookahead["bytes_prefetched"] > 0
    assert lookahead["byte_hit_rate"] > none["byte_hit_rate"]
    assert lookahead["stall_seconds_total"] < none["stall_seconds_total"]
