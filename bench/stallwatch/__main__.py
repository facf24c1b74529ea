"""`python -m bench.stallwatch DIR`: for each poller file of the hung-Redis test in DIR, its
slowest /healthz answers while Redis was stopped and what the service met meanwhile: its own
stalls (a sleeping thread woke late: the whole process stood still), its garbage collections,
and how long its event loop's thread ran and waited on the kernel's run queue (kept off the CPU
by other processes). Then, under `loop_holds`, for each service file: the holds of its event
loop over 40 ms and what ran in the longest (any run of the service: `bench load` too)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

WORST = 3
MARGIN_SECONDS = 0.05  # what came just before an answer counts too


def _window(service: dict[str, Any], start: float, end: float) -> dict[str, Any]:
    stalls = [s for s in service["stalls"] if s[0] < end and s[0] + s[1] / 1e3 > start]
    gcs = [g for g in service["gc"] if g[0] < end and g[0] + g[1] / 1e3 > start - MARGIN_SECONDS]
    sched = [x for x in service["sched"] if start - MARGIN_SECONDS <= x[0] <= end + MARGIN_SECONDS]
    out: dict[str, Any] = {"stalls_ms": [s[1] for s in stalls], "gc": gcs}
    if len(sched) >= 2:
        (t0, ran0, waited0), (t1, ran1, waited1) = sched[0], sched[-1]
        out["loop_thread"] = {
            "over_ms": round((t1 - t0) * 1e3, 1),
            "ran_ms": round((ran1 - ran0) / 1e6, 1),
            "waited_for_cpu_ms": round((waited1 - waited0) / 1e6, 1),
        }
    return out


def report(directory: Path) -> dict[str, Any]:
    services = [json.loads(p.read_text()) for p in sorted(directory.glob("service-*.json"))]
    out: dict[str, Any] = {}
    for path in sorted(directory.glob("poller-*.json")):
        poller = json.loads(path.read_text())
        if not poller["stopped"]:
            continue
        stopped_at, cont_at = poller["stopped"]
        # The service that ran while this poller did: its run-queue samples span the stop.
        service = next(
            (
                s
                for s in services
                if s["sched"] and s["sched"][0][0] <= stopped_at <= s["sched"][-1][0]
            ),
            None,
        )
        health = [
            a for a in poller["answers"] if a[0] == "/healthz" and stopped_at <= a[1] <= cont_at
        ]
        worst = sorted(health, key=lambda a: a[1] - a[2])[:WORST]
        entry: dict[str, Any] = {
            "healthz_answers_while_stopped": len(health),
            "healthz_max_ms": round(max((e - s for _, s, e, _ in health), default=0.0) * 1e3, 1),
        }
        if service is not None:
            entry["while_stopped"] = _window(service, stopped_at, cont_at)
            entry["slowest"] = [
                {"healthz_ms": round((e - s) * 1e3, 1), **_window(service, s, e)}
                for _, s, e, _ in worst
            ]
        out[path.stem.removeprefix("poller-")] = entry
    return out


def loop_holds(directory: Path, longest: int = 5) -> dict[str, Any]:
    """Per service file: how often its event loop was held over 40 ms and over 100 ms, and the
    `longest` holds with what the main thread was seen running in them."""
    out: dict[str, Any] = {}
    for path in sorted(directory.glob("service-*.json")):
        holds = json.loads(path.read_text()).get("holds", [])
        out[path.stem] = {
            "over_40_ms": len(holds),
            "over_100_ms": sum(1 for h in holds if h[1] > 100),
            "longest": [
                {"at": at, "ms": ms, "ran": dict(seen)}
                for at, ms, seen in sorted(holds, key=lambda h: -h[1])[:longest]
            ],
        }
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m bench.stallwatch DIR")
    directory = Path(sys.argv[1])
    print(json.dumps({**report(directory), "loop_holds": loop_holds(directory)}, indent=2))
