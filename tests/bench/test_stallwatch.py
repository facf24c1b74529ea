"""`python -m bench.stallwatch`: a slow /healthz set beside what the service met meanwhile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.stallwatch.__main__ import loop_holds, report
from tests.bench.conftest import REPO


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


def test_loop_holds_are_counted_and_the_longest_come_with_what_ran(tmp_path: Path) -> None:
    holds = [
        [10.0, 45.0, [["a > b", 3]]],
        [11.0, 180.0, [["Scorer.passes > _refresh", 5], ["post_events > ingest", 2]]],
        [12.0, 101.0, [["gc", 1]]],
    ]
    (tmp_path / "service-7.json").write_text(json.dumps({"stalls": [], "holds": holds}))
    (tmp_path / "service-8.json").write_text(json.dumps({"stalls": []}))  # an older file
    r = loop_holds(tmp_path, longest=2)
    assert r["service-8"] == {"over_40_ms": 0, "over_100_ms": 0, "longest": []}
    seven = r["service-7"]
    assert (seven["over_40_ms"], seven["over_100_ms"]) == (3, 2)
    assert [h["ms"] for h in seven["longest"]] == [180.0, 101.0]
    assert seven["longest"][0]["ran"] == {"Scorer.passes > _refresh": 5, "post_events > ingest": 2}


HOLDER = """
import asyncio, time

def hold_the_loop():
    time.sleep(0.15)  # blocks the event loop: its heartbeat cannot beat meanwhile

async def main():
    await asyncio.sleep(0.05)
    hold_the_loop()
    await asyncio.sleep(0.05)

asyncio.run(main())
"""


def test_a_process_that_holds_its_loop_is_caught_holding_it(tmp_path: Path) -> None:
    # Active only in a process whose arguments say `serve`, as `python -m kvprefetch_cli serve`'s
    # do.
    env = {**os.environ, "PYTHONPATH": str(REPO / "bench" / "stallwatch")}
    env["STALLWATCH_OUT"] = str(tmp_path)
    subprocess.run([sys.executable, "-c", HOLDER, "serve"], env=env, check=True, timeout=60)
    (service,) = loop_holds(tmp_path).values()
    assert service["over_100_ms"] >= 1, service
    longest = service["longest"][0]
    assert longest["ms"] >= 150.0
    assert any("hold_the_loop" in frames for frames in longest["ran"]), longest
