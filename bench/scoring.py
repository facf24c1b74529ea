"""The service's own scoring path, as `kvprefetch bench predict` and `bench plan` measure it.

A real MemoryStore holds `n` live sessions, built from events as ingestion applies them (1-6
turns each, contexts of 2-80 blocks on 16 instances, one session in 50 with a fresh signal, a few
running or queued); the engine's Scorer (app/decide/scorer.py) scores it with the bundled
model as the serving model (and, when asked, the same model as the shadow), its ledger and a
scheduler taking the advice, as the service wires them:

- `pass_live`, `pass_live_and_shadow`: `Scorer.tick()` with `every_live` (what the service runs:
  KVP_SCORE_ALL_LIVE): every live session in chunks, after `churn` of them had an event since
  the last pass (re-read in bulk first); wall and CPU (on a shared machine the CPU time is the
  steadier figure). Its longest chunk is what holds the event loop in one piece.
- `table_p_within_ms`: the table path alone, the serving model's `p_within_table` over the same
  table at the advisor's horizons: what the pass adds to it is the advice, the ledger and the
  scheduler's intake.
- `pass_in_loop`: the pass as the service's loop runs it (`Scorer.run`, back to back), on a quiet
  loop and while batches come in (paced: LOOP_SHARE), median wall ms.
- `refresh_read`: a pass's re-read of one slice of changed rows (`StateStore.sessions`, no
  residency, as the Scorer reads) beside the same read with residency (`session()`'s views).
- `pages_path_live_ms`: the page path it replaced, `ceil(n / 256)` ticks of 256 sessions read
  from the store as views (what covering every session took before), measured as one tick of all
  `n` (a page's cost scales with its sessions: a listing, views, the advisor).
"""

from __future__ import annotations

import random
import time
from typing import Any

from bench._util import START_TS

INSTANCES = 16
BLOCK_TOKENS = 512
PAGE_SESSIONS = 256


def build_store(n: int, seed: int = 0, *, into: Any = None) -> tuple[Any, float]:
    """A MemoryStore (or the store `into`) of `n` sessions, and the time to score it at."""
    from app.state import MemoryStore
    from kvprefetch_client.events import (
        InstanceStatus,
        KvBlocksStored,
        RequestFinished,
        RequestRouted,
        SessionSignal,
    )

    rng = random.Random(seed)
    store = (
        into
        if into is not None
        else MemoryStore(bytes_per_token=4096, block_tokens=BLOCK_TOKENS, dedupe_max_ids=1)
    )
    now = START_TS + 1200.0
    events: list[Any] = []
    block = 0
    for i in range(n):
        sid = f"s{i}"
        instance = f"gpu-{i % INSTANCES}"
        turns = rng.randint(1, 6)
        t = now - rng.uniform(10.0, 1100.0)  # the last turn's finish: idle for up to ~18 min
        starts = [t]
        for _ in range(turns - 1):
            starts.append(starts[-1] - rng.lognormvariate(4.0, 0.8))
        starts.reverse()
        blocks = rng.randint(2, 80)
        hashes = list(range(block, block + blocks))
        block += blocks
        for k, routed in enumerate(starts):
            rid = f"{sid}-r{k}"
            events.append(
                RequestRouted(
                    event_id=f"{rid}-a",
                    ts=routed - 20.0,
                    session_id=sid,
                    request_id=rid,
                    instance_id=instance,
                    prompt_tokens=blocks * BLOCK_TOKENS - 300,
                    block_hashes=hashes,
                )
            )
            last_turn = k == len(starts) - 1
            if last_turn and i % 97 == 0:
                continue  # still running
            events.append(
                RequestFinished(
                    event_id=f"{rid}-f",
                    ts=routed,
                    session_id=sid,
                    request_id=rid,
                    instance_id=instance,
                    output_tokens=300,
                )
            )
        if i % 50 == 0:
            events.append(
                SessionSignal(
                    event_id=f"{sid}-g",
                    ts=now - rng.uniform(0.0, 20.0),
                    session_id=sid,
                    kind=rng.choice(("opened", "typing", "tool_finished")),
                )
            )
        if len(events) >= 5_000:
            store.apply(events)
            events = []
    # Every context in the pool (a prefetch has a source), each instance with room to take some.
    for start in range(0, block, 50_000):
        events.append(
            KvBlocksStored(
                event_id=f"pool-{start}",
                ts=START_TS,
                tier="pool",
                block_hashes=list(range(start, min(start + 50_000, block))),
            )
        )
    for k in range(INSTANCES):
        events.append(
            InstanceStatus(
                event_id=f"status-{k}",
                ts=now - 1.0,
                instance_id=f"gpu-{k}",
                free_kv_bytes=2_000 * BLOCK_TOKENS * 4096,
            )
        )
    store.apply(events)
    return store, now


def scorer(store: Any, now: float, *, shadow: bool, every_live: bool, page: int) -> Any:
    """The engine's wiring of a Scorer (app/engine.py), with a manual clock at `now`."""
    from app.core.bundle import DEFAULT_MODEL_DIR
    from app.core.clock import ManualClock
    from app.decide.routing import SameInstanceEstimate
    from app.decide.scheduler import Scheduler, SchedulerConfig
    from app.decide.scorer import Scorer
    from app.observe.ledger import AdviceLedger
    from app.predict.features import DeploymentSignals
    from app.predict.slots import ModelSlots

    ledger = AdviceLedger()
    deployment = DeploymentSignals()
    models = ModelSlots(DEFAULT_MODEL_DIR, ledger=ledger, deployment=deployment)
    if shadow:
        models.set_shadow(DEFAULT_MODEL_DIR)
    scheduler = Scheduler(store, SchedulerConfig(bytes_per_block=BLOCK_TOKENS * 4096))
    return Scorer(
        store,
        models,
        ledger,
        ManualClock(now),
        sessions_per_tick=page,
        scheduler=scheduler,
        routes=SameInstanceEstimate(),
        deployment=deployment,
        every_live=every_live,
    )


def churn_events(store: Any, n: int, share: float, step: int, now: float) -> list[Any]:
    """Events for `share` of the `n` sessions (a finished turn each, a few seconds ago), applied
    to the store: what ingestion changed between two passes."""
    from kvprefetch_client.events import RequestFinished, RequestRouted

    rng = random.Random(step)
    out: list[Any] = []
    for i in rng.sample(range(n), int(n * share)):
        sid, rid = f"s{i}", f"s{i}-c{step}"
        ctx = store.context(sid)
        hashes = list(ctx.block_hashes) if ctx is not None else [10**9 + i]
        out.append(
            RequestRouted(
                event_id=f"{rid}-a",
                ts=now - 8.0,
                session_id=sid,
                request_id=rid,
                instance_id=f"gpu-{i % INSTANCES}",
                prompt_tokens=len(hashes) * BLOCK_TOKENS - 300,
                block_hashes=hashes,
            )
        )
        out.append(
            RequestFinished(
                event_id=f"{rid}-f",
                ts=now - 2.0,
                session_id=sid,
                request_id=rid,
                instance_id=f"gpu-{i % INSTANCES}",
                output_tokens=300,
            )
        )
    store.apply(out)
    return out


def _table_p_within(s: Any, now: float, rounds: int) -> float:
    """The table path alone: the serving model's `p_within_table` over every row of the pass's
    table at the advisor's horizons (no advice, no ledger, no scheduler)."""
    import statistics

    advisor = s._advisor(s.models.serving.predictor)
    predictor = advisor.predictor
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        predictor.p_within_table(s.table, now, advisor._grid)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def _in_loop(store: Any, now: float, passes: int) -> dict[str, Any]:
    """The pass as the service's loop runs it (`Scorer.run`, passes back to back; the serving
    model, and with a shadow too): median wall ms of `passes` passes on a quiet loop (no
    ingest: a step is followed by a yield) and while batches come in (every 20 ms an observed
    batch, empty so that the pass's work is the same: each step is followed by a wait as long,
    LOOP_SHARE)."""
    import asyncio
    import statistics

    async def passes_of(s: Any, busy: bool) -> list[float]:
        out: list[float] = []
        last = s.last_pass
        task = asyncio.create_task(s.run(0.0))
        try:
            while len(out) < passes:
                if busy:
                    s.observe([])
                await asyncio.sleep(0.02)
                if s.last_pass is not last:
                    last = s.last_pass
                    out.append(last.seconds * 1000)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return out

    out: dict[str, Any] = {"passes": passes}
    for label, shadow in (("live", False), ("live_and_shadow", True)):
        s = scorer(store, now, shadow=shadow, every_live=True, page=PAGE_SESSIONS)
        s.tick()  # the table built, as in the service after its first pass
        quiet = asyncio.run(passes_of(s, False))
        busy = asyncio.run(passes_of(s, True))
        out[label] = {
            "quiet_ms": round(statistics.median(quiet), 1),
            "ingesting_ms": round(statistics.median(busy), 1),
        }
    return out


def _refresh_read(store: Any, rounds: int) -> dict[str, Any]:
    """The pass's re-read of a slice of dirty rows (REFRESH_SESSIONS ids in one bulk read),
    as the Scorer reads it (no residency) beside the full views (`session()`'s, with each
    block's locations): median ms, alternating, in the same rounds."""
    import statistics

    from app.decide.scorer import REFRESH_SESSIONS

    ids = [v.session_id for v in store.live_sessions(REFRESH_SESSIONS)]
    ms: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(max(3, rounds)):
        for resident in (True, False):
            started = time.perf_counter()
            store.sessions(ids, resident=resident)
            ms[resident].append((time.perf_counter() - started) * 1000)
    full, bare = statistics.median(ms[True]), statistics.median(ms[False])
    return {
        "sessions": len(ids),
        "ms": round(bare, 2),
        "with_residency_ms": round(full, 2),
        "with_residency_over_ms": round(full / bare, 2) if bare else None,
    }


def measure(
    n: int,
    *,
    rounds: int,
    churn: float = 0.01,
    seed: int = 0,
    store: Any = None,
    pages: bool = True,
) -> dict[str, Any]:
    """At `n` live sessions: the pass with the serving model alone and with a shadow too (median
    wall and CPU ms over `rounds` passes after a first that builds the table; the longest chunk;
    sessions advised and handed on), the table path alone, and (`pages`) the page path's time
    for all `n` (median of up to 3 ticks: 256-session pages add up to it). `store`: score this
    store (built with `build_store`) instead of a new MemoryStore."""
    import statistics

    from app.core.runtime import tune_gc

    tune_gc()  # as the service runs (app/core/runtime.py)
    if store is None:
        store, now = build_store(n, seed)
    else:
        now = START_TS + 1200.0
    out: dict[str, Any] = {"sessions": n, "churn_share": churn}
    step = 0
    for label, shadow in (("live", False), ("live_and_shadow", True)):
        s = scorer(store, now, shadow=shadow, every_live=True, page=PAGE_SESSIONS)
        started, cpu = time.perf_counter(), time.process_time()
        s.tick()  # the first pass builds the table from the store
        first = ((time.perf_counter() - started) * 1000, (time.process_time() - cpu) * 1000)
        wall, cpu_ms, chunk, handed = [], [], [], []
        for _ in range(rounds):
            now += 1.0
            step += 1
            s.clock.set(now)
            s.observe(churn_events(store, n, churn, step, now))
            cpu = time.process_time()
            s.tick()
            cpu_ms.append((time.process_time() - cpu) * 1000)
            stats = s.last_pass
            wall.append(stats.seconds * 1000)
            chunk.append(stats.longest_chunk_seconds * 1000)
            handed.append(stats.handed)
        out[f"pass_{label}"] = {
            "ms": round(statistics.median(wall), 1),
            "cpu_ms": round(statistics.median(cpu_ms), 1),
            "ms_max": round(max(wall), 1),
            "longest_chunk_ms": round(statistics.median(chunk), 1),
            "longest_chunk_ms_max": round(max(chunk), 1),
            "chunks": stats.chunks,
            "table_rows": stats.sessions,
            "advised": stats.advised,
            "handed_to_scheduler": int(statistics.median(handed)),
            "first_pass_ms": round(first[0], 1),
            "first_pass_cpu_ms": round(first[1], 1),
        }
        if not shadow:
            out["table_p_within_ms"] = round(_table_p_within(s, now, rounds), 1)
            out["advisor_horizons"] = len(s._advisor(s.models.serving.predictor)._grid)
    out["refresh_read"] = _refresh_read(store, rounds)
    out["pass_in_loop"] = _in_loop(store, now, max(3, min(rounds, 5)))
    live = out["pass_live"]["ms"]
    out["ratios"] = {
        "pass_live_over_table_p_within": round(live / out["table_p_within_ms"], 2),
        "pass_live_and_shadow_over_live": round(out["pass_live_and_shadow"]["ms"] / live, 2),
    }
    if pages:
        # The page path it replaced: the store's sessions read as views and advised, all `n`.
        old = scorer(store, now, shadow=False, every_live=False, page=n)
        page_ms = []
        for _ in range(max(1, min(rounds, 3))):
            started = time.perf_counter()
            old.tick()
            page_ms.append((time.perf_counter() - started) * 1000)
        out["pages_path_live_ms"] = round(statistics.median(page_ms), 1)
        out["ratios"]["pages_path_over_pass_live"] = round(out["pages_path_live_ms"] / live, 2)
    return out


def measure_plan(n: int, *, rounds: int, churn: float = 0.01, seed: int = 0) -> dict[str, Any]:
    """The service's scoring and planning at `n` live sessions: each round a pass (the serving
    model) hands the scheduler what changed, then the scheduler plans (`plan`, as the planning
    loop does); medians over `rounds` after the first pass (which hands on every session)."""
    import statistics

    from app.core.runtime import tune_gc

    tune_gc()
    store, now = build_store(n, seed)
    s = scorer(store, now, shadow=False, every_live=True, page=PAGE_SESSIONS)
    s.tick()
    started = time.perf_counter()
    first = s.scheduler.plan(now)
    first_plan_ms = (time.perf_counter() - started) * 1000
    pass_ms, pass_cpu_ms, plan_ms, handed, orders = [], [], [], [], 0
    for step in range(1, rounds + 1):
        now += 1.0
        s.clock.set(now)
        s.observe(churn_events(store, n, churn, step, now))
        cpu = time.process_time()
        s.tick()
        pass_cpu_ms.append((time.process_time() - cpu) * 1000)
        pass_ms.append(s.last_pass.seconds * 1000)
        handed.append(s.last_pass.handed)
        started = time.perf_counter()
        plan = s.scheduler.plan(now)
        plan_ms.append((time.perf_counter() - started) * 1000)
        orders += len(plan.orders)
    table_ms = _table_p_within(s, now, rounds)
    live = statistics.median(pass_ms)
    return {
        "sessions": n,
        "churn_share": churn,
        "pass_live_ms": round(live, 3),
        "pass_live_cpu_ms": round(statistics.median(pass_cpu_ms), 3),
        "table_p_within_ms": round(table_ms, 3),
        "pass_live_over_table_p_within": round(live / table_ms, 2) if table_ms > 0 else None,
        "handed_to_scheduler": int(statistics.median(handed)),
        "plan_after_pass_ms": round(statistics.median(plan_ms), 3),
        "plan_after_pass_ms_max": round(max(plan_ms), 3),
        "first_plan_ms": round(first_plan_ms, 3),
        "first_plan_orders": len(first.orders),
        "orders_per_plan": round(orders / rounds, 2),
        "tracked_by_scheduler": s.scheduler.tracked_sessions,
        "candidates": s.scheduler.candidates,
    }
