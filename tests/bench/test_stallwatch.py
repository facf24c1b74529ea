"""`python -m bench.stallwatch`: a slow /healthz set beside what the service met meanwhile."""

from __future__ import annotations

import json
from pathlib import Path

from bench.stallwatch.__main__ import report


def test_the_slowest_answers_while_stopped_come_with_the_services_stalls_gc_and_cpu_wait(
    tmp_path: Path,
) -> None:
    answers = [
        ["/healthz", 10.0, 10.004, 200],  # before the stop: not counted
        ["/healthz", 11.0, 11.120, 200],  # slow, while stopped
        ["/metrics", 11.2, 11.9, 200],
        ["/healthz", 12.0, 12.005, 200],
    ]
    (tmp_path / "poller-a.json").write_text(json.dumps({"answers": answers, "stopped": [10.5, 13]}))
    (tmp_path / "poller-b.json").write_text(json.dumps({"answers": [], "stopped": None}))
    service = {
        "stalls": [[11.01, 100.0], [12.5, 40.0]],
        "gc": [[10.98, 15.0, 2, "MainThread"]],
        # (time, ns run, ns waited on the run queue) of the loop's thread
        "sched": [
            [10.0, 0, 0],
            [10.96, 1_000_000, 0],
            [11.14, 3_000_000, 110_000_000],
            [13.0, 9_000_000, 150_000_000],
        ],
    }
    (tmp_path / "service-1.json").write_text(json.dumps(service))
    r = report(tmp_path)
    assert set(r) == {"a"}
    a = r["a"]
    assert a["healthz_answers_while_stopped"] == 2 and a["healthz_max_ms"] == 120.0
    assert a["while_stopped"]["stalls_ms"] == [100.0, 40.0]
    slowest = a["slowest"][0]
    assert slowest["healthz_ms"] == 120.0 and slowest["stalls_ms"] == [100.0]
    assert slowest["gc"] == [[10.98, 15.0, 2, "MainThread"]]
    assert slowest["loop_thread"] == {"over_ms": 180.0, "ran_ms": 2.0, "waited_for_cpu_ms": 110.0}
    assert a["slowest"][1]["healthz_ms"] == 5.0 and a["slowest"][1]["stalls_ms"] == []
