"""Replay a trace through the cluster model and the real engine, and measure what was saved.

The engine here is the service's own (app/engine.py): every event the cluster emits goes through
its ingest (the same event models the HTTP API validates, dedupe, its MemoryStore, its
observers), under a simulated clock; the planner's policies (heuristic, learned, clairvoyant) run
its scoring and planning ticks and carry out its orders (sim/planned.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pydantic_settings import BaseSettings

from app.core.bundle import DEFAULT_MODEL_DIR, model_identity
from app.core.clock import ManualClock
from app.core.config import Settings
from app.decide.advisor import Thresholds
from app.decide.guard import GUARD_SETTINGS
from app.engine import Engine
from app.ingest.base import NullEventLog
from app.ingest.eventlog import encode_events
from app.state import MemoryStore
from app.state.base import SessionView
from kvprefetch_client.events import Event, event_adapter
from sim.cluster import Cluster, SimRequest
from sim.metrics import byte_hit_rate_unshared, latency_summary, percentile, shared_blocks
from sim.planned import ClusterSink
from sim.policies import PLANNER_POLICIES, SCHEDULED_ALIAS
from sim.policy_registry import make_policy
from sim.routers import make_router
from sim.scenario import Scenario
from sim.sessions import derive_sessions
from sim.signals import generate_signals
from sim.traces import TraceRequest


@dataclass
class ReplayResult:
    summary: dict[str, Any]
    requests: list[SimRequest] = field(repr=False)
    events: list[Event] = field(default_factory=list, repr=False)


def session_ids(trace: Sequence[TraceRequest]) -> list[str]:
    """Each request's session: the trace's own `session_id` where it carries them (an agent
    trace; sim/traces.py: all requests or none), else derived from the blocks (sim/sessions.py)."""
    labelled = [r.session_id for r in trace if r.session_id is not None]
    if not labelled:
        return derive_sessions(trace).session_ids
    if len(labelled) < len(trace):
        raise ValueError("session_id must be on every request of a trace or on none")
    return labelled


def build_requests(trace: Sequence[TraceRequest]) -> list[SimRequest]:
    return [
        SimRequest(
            index=r.index,
            session_id=sid,
            arrival=r.arrival_seconds,
            input_tokens=r.input_tokens,
            output_tokens=r.output_tokens,
            hash_ids=r.hash_ids,
            after_seconds=r.after_seconds,
            tool=r.tool,
        )
        for r, sid in zip(trace, session_ids(trace))
    ]


class ReplayBackend(Protocol):
    """Where a replay's events go and where its policies read sessions.

    EngineFeed feeds the in-process Engine (the default); sim.remote.RemoteService is a running
    service reached over HTTP.
    """

    events: list[Event]  # what was emitted, when the engine was asked to keep it

    def emit(self, kind: str, ts: float, fields: dict[str, Any]) -> None: ...

    def session(self, session_id: str) -> SessionView | None: ...


class ReplaySettings(Settings):
    """Settings from what the replay passes alone: no KVP_ environment, no .env file."""

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: Any, *sources: Any, **named: Any
    ) -> tuple[Any, ...]:
        return (init_settings,)


def sim_engine(
    scenario: Scenario,
    *,
    model_dir: str | None = None,
    planner_options: dict[str, float] | None = None,
    load_model: bool = True,
) -> Engine:
    """The service's Engine for a replay: a MemoryStore of the scenario's geometry keeping every
    session (no retention: a trace's own time is the only clock), a simulated clock from 0, the
    cluster's numbers, the model (`model_dir`, default the bundled one), the planner's thresholds
    (`planner_options`, by their Settings names), no event log (nothing lands in the data dir),
    and the cluster model as the order sink (sim/planned.py). Built from defaults alone: the
    environment's KVP_ settings do not change a replay. `load_model` False: the engine's
    registry serves the heuristic (for a policy that never scores with the loaded model)."""
    # The thresholds and the LRU guard's are settings: nothing else tunes the planner.
    names = (*Thresholds.__slots__, *GUARD_SETTINGS)
    unknown = sorted(set(planner_options or {}) - set(names))
    if unknown:
        raise ValueError(
            f"unknown planner option(s) {', '.join(unknown)}; choose from {', '.join(names)}"
        )
    options = dict(planner_options or {})
    fields: dict[str, Any] = {
        "bytes_per_token": scenario.bytes_per_token,
        "block_tokens": scenario.block_tokens,
        "pool_link_bytes_per_second": scenario.pool_link_bytes_per_second,
        "host_link_bytes_per_second": scenario.host_link_bytes_per_second,
        "prefill_tokens_per_second": scenario.prefill_tokens_per_second,
        "session_retention_seconds": math.inf,
        "model_dir": Path(model_dir or DEFAULT_MODEL_DIR),
        "replica_id": "replay",
        "score_interval_seconds": 0,
        "plan_interval_seconds": 0,
        "dashboard_sample_seconds": 0,
        # The cluster's pins hold room when the scenario's are hard: the planner prices them.
        "pins_hold_room": scenario.pins == "hard",
        **options,
    }
    settings = ReplaySettings(**fields)
    store = MemoryStore(
        bytes_per_token=scenario.bytes_per_token, block_tokens=scenario.block_tokens
    )
    return Engine(
        settings,
        store=store,
        clock=ManualClock(0.0),
        order_sink=ClusterSink(),
        event_log=NullEventLog(),
        recover=False,
        load_model=load_model,
    )


class EngineFeed:
    """Turns the cluster's happenings into events and hands them to the engine's ingest (the
    service's: validation, dedupe, the store, the observers), under its simulated clock."""

    def __init__(self, engine: Engine, keep_events: bool = False, drain_each: bool = False) -> None:
        """`drain_each`: tell the engine's observers of each event at once, rather than before the
        engine's next tick: for a policy whose scheduler a router reads between ticks (`hinted`
        asks it for the orders on their way)."""
        self.engine = engine
        self.drain_each = drain_each
        self.store = engine.store
        self.clock = engine.clock
        self.keep_events = keep_events
        self.events: list[Event] = []
        self._ids = itertools.count()

    def __call__(self, kind: str, ts: float, fields: dict[str, Any]) -> None:
        if ts > self.clock.now():
            self.clock.set(ts)  # type: ignore[attr-defined]
        event = event_adapter.validate_python(
            {"type": kind, "event_id": f"sim-{next(self._ids)}", "ts": ts, **fields}
        )
        self.engine.ingest([event])
        if self.drain_each:
            self.engine.drain()
        if self.keep_events:
            self.events.append(event)

    emit = __call__

    def session(self, session_id: str) -> SessionView | None:
        return self.store.session(session_id)


def _run_coroutine(coroutine: Any) -> Any:
    """asyncio.run, also where this thread already runs an event loop (a Jupyter kernel's, an
    async caller's), where asyncio.run refuses: there on a thread and a loop of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def replay(
    trace: Sequence[TraceRequest],
    scenario: Scenario,
    *,
    policy: str = "none",
    router: str = "sticky",
    model_dir: str | None = None,
    measure_from_seconds: float = 0.0,
    keep_events: bool = False,
    progress: Callable[[int], None] | None = None,
    engine: ReplayBackend | None = None,
    planner_options: dict[str, float] | None = None,
) -> ReplayResult:
    """`engine`: where events go and sessions come from; default a fresh in-process EngineFeed
    over sim_engine(). `planner_options`: the planner's thresholds (Settings names), for the
    heuristic, learned and scheduled policies.

    An injected engine keeps events if it was built to (`keep_events` only builds the default),
    and is its caller's to close.
    """
    started = time.perf_counter()
    requests = build_requests(trace)
    built = engine is None
    if engine is None:
        # Only `learned` scores with the model loaded: the others' replays do not pay for it.
        engine = EngineFeed(
            sim_engine(
                scenario,
                model_dir=model_dir,
                planner_options=planner_options,
                load_model=policy in ("learned", SCHEDULED_ALIAS),
            ),
            keep_events=keep_events,
            drain_each=(policy in PLANNER_POLICIES or policy == SCHEDULED_ALIAS)
            and router == "hinted",
        )
    app_engine = getattr(engine, "engine", None)
    pol = make_policy(
        policy,
        session_view=engine.session,
        engine=app_engine,
        # A running service as the engine (sim/remote.py): the `service` policy takes its orders.
        remote=engine if hasattr(engine, "pull_orders") else None,  # type: ignore[arg-type]
    )
    rtr = make_router(router, store=getattr(engine, "store", None), scenario=scenario)
    signals = generate_signals(requests, scenario.signals)
    cluster = Cluster(scenario, requests, rtr, pol, emit=engine.emit, signals=signals)
    try:
        cluster.run(progress=progress)
    finally:
        closing = getattr(pol, "close", None)
        if closing is not None:
            closing()
        if app_engine is not None:
            if built:
                _run_coroutine(app_engine.close())
            else:  # the caller's to close; what its observers derive is caught up
                app_engine.drain()
    summary = summarize(cluster, requests, measure_from_seconds)
    policy_summary = getattr(pol, "summary", None)
    if policy_summary is not None:  # what a policy reports of its own (sim/served.py)
        summary.update(policy_summary())
    if scenario.signals.enabled:  # absent otherwise: a replay without signals is as it was
        summary.update(
            {
                "signals": scenario.signals.model_dump(),
                "signals_true": sum(s.true for s in signals),
                "signals_false": sum(not s.true for s in signals),
                "signals_emitted": cluster.totals.signals_emitted,
                "signals_dropped": cluster.totals.signals_dropped,
            }
        )
    summary.update(
        {
            "policy": policy,
            "router": router,
            "scenario": scenario.name,
            # How a prefetch lands (sim/cluster.py): an assumption of the replay's, so said.
            "landing": scenario.landing,
            "chunk_tokens": scenario.chunk_tokens,
            # How running requests share a GPU (sim/compute.py): an assumption, so said.
            "compute": scenario.compute,
            # Closed: an agent trace's calls came when their predecessors finished here.
            "arrivals": "closed" if cluster.closed_loop else "open",
            # The time split: requests arriving before it warmed the cluster up, uncounted.
            "measure_from_seconds": measure_from_seconds,
            "wall_seconds": round(time.perf_counter() - started, 3),
        }
    )
    if policy in ("learned", SCHEDULED_ALIAS):
        summary["model"] = served_model(app_engine)
    return ReplayResult(summary=summary, requests=requests, events=engine.events)


def served_model(app_engine: Engine | None) -> dict[str, Any]:
    """The model that scored a replay (app.core.bundle.model_identity), or, where the engine
    fell back to the heuristic (a model that would not load) or is a remote service's, why no
    model is named: `dir` None and `serving` saying what served."""
    serving = app_engine.models.serving if app_engine is not None else None
    predictor = getattr(serving, "predictor", None)
    model_dir = getattr(predictor, "model_dir", None)
    if model_dir is None:
        what = serving.description if serving is not None else "a remote service's model"
        return {"dir": None, "card_sha256": None, "model_sha256": None, "serving": what}
    return {**model_identity(model_dir), "serving": serving.description}  # type: ignore[union-attr]


def summarize(
    cluster: Cluster, requests: Sequence[SimRequest], measure_from_seconds: float = 0.0
) -> dict[str, Any]:
    measured = [r for r in requests if r.arrival >= measure_from_seconds]
    reuse = [r for r in measured if r.reused_blocks]
    reused_blocks = sum(r.reused_blocks for r in reuse)
    hit_blocks = sum(r.hit_blocks for r in reuse)
    stalls = sorted(r.stall_seconds for r in reuse)
    queued = [(r.admitted_at or r.arrival) - r.arrival for r in measured]
    busy = sum((r.finished_at or 0.0) - (r.admitted_at or 0.0) for r in measured)
    stall_total = sum(r.stall_seconds for r in measured)
    block_bytes = cluster.block_bytes
    shared = shared_blocks(requests)
    return {
        "requests": len(measured),
        "sessions": len({r.session_id for r in measured}),
        "reuse_requests": len(reuse),
        "hit_rate": round(sum(r.hit_blocks == r.reused_blocks for r in reuse) / len(reuse), 4)
        if reuse
        else 0.0,
        "byte_hit_rate": round(hit_blocks / reused_blocks, 4) if reused_blocks else 0.0,
        # The same, without the blocks most requests carry (sim/metrics.py), from the whole trace.
        "byte_hit_rate_unshared": byte_hit_rate_unshared(reuse, shared),
        "shared_blocks": len(shared),
        "reused_bytes": reused_blocks * block_bytes,
        "stall_seconds_total": round(stall_total, 3),
        "stall_seconds_p50": round(statistics.median(stalls), 4) if stalls else 0.0,
        "stall_seconds_p99": round(percentile(stalls, 0.99), 4),
        # Arrival to admission: waiting for a slot or for room in HBM.
        "queue_seconds_p50": round(statistics.median(queued), 4) if queued else 0.0,
        "bytes_loaded_on_demand": sum(r.loaded_bytes for r in measured),
        "bytes_prefetched": int(cluster.totals.bytes_prefetched),
        "bytes_prefetched_unused": int(cluster.totals.bytes_prefetched_unused),
        "recompute_tokens": sum(r.recompute_tokens for r in measured),
        "gpu_wait_fraction": round(stall_total / busy, 4) if busy else 0.0,
        "simulated_seconds": round(max((r.finished_at or 0.0) for r in requests), 3)
        if requests
        else 0.0,
        **latency_summary(requests, measure_from_seconds),
        **_gpu_shares(cluster),
    }


def _gpu_shares(cluster: Cluster) -> dict[str, float]:
    """With shared compute: the share of the instances' busy GPU time that prefill (and
    recompute) took, and how busy they were over the replay."""
    computes = [inst.compute for inst in cluster.instances if inst.compute is not None]
    if not computes:
        return {}
    busy = sum(c.busy_seconds for c in computes)
    span = max(cluster.now, 1e-9) * len(computes)
    return {
        "prefill_gpu_share": round(sum(c.prefill_seconds for c in computes) / busy, 4)
        if busy
        else 0.0,
        "gpu_busy_share": round(busy / span, 4),
    }


def write_events(result: ReplayResult, path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_events(result.events))
    return len(result.events)
