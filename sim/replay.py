"""Replay a trace through the cluster model and the real engine, and measure what was saved.

The engine here is the service's own: its MemoryStore takes every event the cluster emits
(through the same event models the HTTP API validates), under a simulated clock, and the
heuristic and learned policies read their sessions from it.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from app.core.clock import ManualClock
from app.ingest.eventlog import encode_events
from kvprefetch_client.events import Event, event_adapter
from app.state import MemoryStore
from app.state.base import SessionView
from sim.cluster import Cluster, SimRequest
from sim.policy_registry import make_policy
from sim.routers import make_router
from sim.scenario import Scenario
from sim.sessions import derive_sessions
from sim.traces import TraceRequest


@dataclass
class ReplayResult:
    summary: dict[str, Any]
    requests: list[SimRequest] = field(repr=False)
    events: list[Event] = field(default_factory=list, repr=False)


def build_requests(trace: Sequence[TraceRequest]) -> list[SimRequest]:
    sessions = derive_sessions(trace)
    return [SimRequest(index=r.index, session_id=sid, arrival=r.arrival_seconds, input_tokens=r.input_tokens,
                       output_tokens=r.output_tokens, hash_ids=r.hash_ids)
            for r, sid in zip(trace, sessions.session_ids)]


class Engine(Protocol):
    """Where a replay's events go and where its policies read sessions.

    EngineFeed is the in-process engine (the default); sim.remote.RemoteEngine is a running
    service reached over HTTP.
    """

    events: list[Event]  # what was emitted, when the engine was asked to keep it

    def emit(self, kind: str, ts: float, fields: dict[str, Any]) -> None: ...

    def session(self, session_id: str) -> SessionView | None: ...


class EngineFeed:
    """Turns the cluster's happenings into events and applies them to the engine's store."""

    def __init__(self, store: MemoryStore, clock: ManualClock, keep_events: bool = False) -> None:
        self.store = store
        self.clock = clock
        self.keep_events = keep_events
        self.events: list[Event] = []
        self._ids = itertools.count()

    def __call__(self, kind: str, ts: float, fields: dict[str, Any]) -> None:
        if ts > self.clock.now():
            self.clock.set(ts)
        event = event_adapter.validate_python({"type": kind, "event_id": f"sim-{next(self._ids)}", "ts": ts,
                                               **fields})
        self.store.apply([event])
        if self.keep_events:
            self.events.append(event)

    emit = __call__

    def session(self, session_id: str) -> SessionView | None:
        return self.store.session(session_id)


def replay(trace: Sequence[TraceRequest], scenario: Scenario, *, policy: str = "none", router: str = "sticky",
           model_dir: str | None = None, measure_from_seconds: float = 0.0, keep_events: bool = False,
           progress: Callable[[int], None] | None = None, engine: Engine | None = None,
           planner_options: dict[str, float] | None = None) -> ReplayResult:
    """`engine`: where events go and sessions come from; default a fresh in-process EngineFeed.
    `planner_options`: the planner's thresholds, for the heuristic and learned policies.

    An injected engine keeps events if it was built to (`keep_events` only builds the default).
    """
    started = time.perf_counter()
    requests = build_requests(trace)
    if engine is None:
        store = MemoryStore(bytes_per_token=scenario.bytes_per_token, block_tokens=scenario.block_tokens)
        engine = EngineFeed(store, ManualClock(0.0), keep_events=keep_events)
    pol = make_policy(policy, session_view=engine.session, model_dir=model_dir, planner_options=planner_options,
                      store=getattr(engine, "store", None), scenario=scenario)
    rtr = make_router(router, store=getattr(engine, "store", None), scenario=scenario)
    cluster = Cluster(scenario, requests, rtr, pol, emit=engine.emit)
    cluster.run(progress=progress)
    summary = summarize(cluster, requests, measure_from_seconds)
    summary.update({"policy": policy, "router": router, "scenario": scenario.name,
                    "wall_seconds": round(time.perf_counter() - started, 3)})
    return ReplayResult(summary=summary, requests=requests, events=engine.events)


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    k = min(int(round(q * (len(sorted_values) - 1))), len(sorted_values) - 1)
    return sorted_values[k]


def summarize(cluster: Cluster, requests: Sequence[SimRequest], measure_from_seconds: float = 0.0) -> dict[str, Any]:
    measured = [r for r in requests if r.arrival >= measure_from_seconds]
    reuse = [r for r in measured if r.reused_blocks]
    reused_blocks = sum(r.reused_blocks for r in reuse)
    hit_blocks = sum(r.hit_blocks for r in reuse)
    stalls = sorted(r.stall_seconds for r in reuse)
    busy = sum((r.finished_at or 0.0) - (r.admitted_at or 0.0) for r in measured)
    stall_total = sum(r.stall_seconds for r in measured)
    block_bytes = cluster.block_bytes
    return {
        "requests": len(measured),
        "sessions": len({r.session_id for r in measured}),
        "reuse_requests": len(reuse),
        "hit_rate": round(sum(r.hit_blocks == r.reused_blocks for r in reuse) / len(reuse), 4) if reuse else 0.0,
        "byte_hit_rate": round(hit_blocks / reused_blocks, 4) if reused_blocks else 0.0,
        "reused_bytes": reused_blocks * block_bytes,
        "stall_seconds_total": round(stall_total, 3),
        "stall_seconds_p50": round(statistics.median(stalls), 4) if stalls else 0.0,
        "stall_seconds_p99": round(_percentile(stalls, 0.99), 4),
        "bytes_loaded_on_demand": sum(r.loaded_bytes for r in measured),
        "bytes_prefetched": int(cluster.totals.bytes_prefetched),
        "bytes_prefetched_unused": int(cluster.totals.bytes_prefetched_unused),
        "recompute_tokens": sum(r.recompute_tokens for r in measured),
        "gpu_wait_fraction": round(stall_total / busy, 4) if busy else 0.0,
        "simulated_seconds": round(max((r.finished_at or 0.0) for r in requests), 3) if requests else 0.0,
    }


def write_events(result: ReplayResult, path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_events(result.events))
    return len(result.events)
