"""Planning time per tick: the scheduler with 100,000 tracked sessions on 16 instances.

    kvprefetch bench plan [--sessions 100000] [--instances 16] [--ticks 200] [--page 256]
        [--pass-sessions 10000,100000] [--json]

What a service tick does (app/decide/scheduler.py): take the advice for one page of freshly
scored sessions (`advise`), then `plan`: retire landed orders, drop stale advice, cancel what
fell, decide pins and demotes for the page, and order prefetches for the candidates within the
links and the room. Measured per tick, p50 and p99 over `ticks` ticks, with `sessions` sessions'
advice held. Scoring the page itself (the model) is `kvprefetch bench predict`'s business; its
cost for one page is reported here too, with the bundled model, so the two add up to a tick.

The baseline, in the same run: a planner that keeps nothing between ticks and so re-reads every
tracked session's advice each tick (`advise` of all of them, then `plan`).

`service` (in the same run, at each of `pass_sessions`): the service's own path, the Scorer's pass
over every live session of a real MemoryStore (KVP_SCORE_ALL_LIVE) handing the scheduler the
advice that changed, then `plan`; beside it the table path alone (the serving model's
`p_within_table` over the same sessions): bench/scoring.py `measure_plan`.

The state: every session's context (10 blocks) is in the pool; a share `resident_share` is in
its instance's HBM; instances report their free KV bytes. Chances are drawn so that about
`candidate_share` of sessions are prefetch candidates (P(back within 30 s) >= 0.5) at any time,
and a page's refreshed advice moves some sessions in and out of that set.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

from bench._util import info, machine

TARGET_P99_MS = 50.0
BLOCKS_PER_SESSION = 10


def _advice(rng: random.Random, i: int, instances: int, candidate_share: float) -> Any:
    from app.decide.advisor import SessionAdvice

    p_soon = rng.uniform(0.5, 0.95) if rng.random() < candidate_share else rng.uniform(0.0, 0.2)
    p_keep = min(1.0, p_soon + rng.uniform(0.0, 0.4))
    retention = "keep" if p_keep >= 0.2 else ("demote" if p_keep <= 0.05 else "lru")
    blocks = tuple(range(i * BLOCKS_PER_SESSION, (i + 1) * BLOCKS_PER_SESSION))
    return SessionAdvice(
        f"s{i}",
        f"gpu-{i % instances}",
        blocks,
        retention,  # type: ignore[arg-type]
        300.0 if retention == "keep" else 0.0,
        p_keep,
        p_soon,
        p_keep,
        p_soon >= 0.5,
    )


def _store(
    sessions: int, instances: int, resident_share: float, bytes_per_block: int, seed: int
) -> Any:
    from app.state import MemoryStore
    from kvprefetch_client.events import InstanceStatus, KvBlocksStored

    rng = random.Random(seed)
    store = MemoryStore(bytes_per_token=bytes_per_block // 512, block_tokens=512, dedupe_max_ids=1)
    total = sessions * BLOCKS_PER_SESSION
    chunk = 50_000
    events: list[Any] = []
    for start in range(0, total, chunk):
        events.append(
            KvBlocksStored(
                event_id=f"pool-{start}",
                ts=0.0,
                tier="pool",
                instance_id=None,
                block_hashes=list(range(start, min(start + chunk, total))),
            )
        )
    resident: dict[int, list[int]] = {k: [] for k in range(instances)}
    for i in range(sessions):
        if rng.random() < resident_share:
            resident[i % instances].extend(
                range(i * BLOCKS_PER_SESSION, (i + 1) * BLOCKS_PER_SESSION)
            )
    for k, blocks in resident.items():
        for start in range(0, len(blocks), chunk):
            events.append(
                KvBlocksStored(
                    event_id=f"hbm-{k}-{start}",
                    ts=0.0,
                    tier="hbm",
                    instance_id=f"gpu-{k}",
                    block_hashes=blocks[start : start + chunk],
                )
            )
        events.append(
            InstanceStatus(
                event_id=f"status-{k}",
                ts=0.0,
                instance_id=f"gpu-{k}",
                free_kv_bytes=2_000 * bytes_per_block,
            )
        )
    store.apply(events)
    return store


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(round(q * (len(xs) - 1)), len(xs) - 1)]


def run(
    *,
    sessions: int = 100_000,
    instances: int = 16,
    ticks: int = 200,
    page: int = 256,
    baseline_ticks: int = 5,
    candidate_share: float = 0.005,
    resident_share: float = 0.5,
    seed: int = 0,
    pass_sessions: tuple[int, ...] = (10_000, 100_000),
    pass_rounds: int = 5,
) -> dict[str, Any]:
    from app.decide.scheduler import Scheduler, SchedulerConfig
    from bench.predict import _sessions

    load_before = os.getloadavg()[0]
    bytes_per_block = 512 * 327_680
    info(
        f"building the state: {sessions:,} sessions x {BLOCKS_PER_SESSION} blocks "
        f"on {instances} instances"
    )
    store = _store(sessions, instances, resident_share, bytes_per_block, seed)
    rng = random.Random(seed)
    config = SchedulerConfig(bytes_per_block=bytes_per_block)
    advice = [_advice(rng, i, instances, candidate_share) for i in range(sessions)]

    tick_seconds = 0.1
    sched = Scheduler(store, config, advice_ttl_seconds=1e9)
    sched.advise(advice, 0.0)
    sched.plan(0.0)  # the first tick orders for every candidate at once; steady state is after it
    info(f"{ticks} ticks of a {page}-session page")
    tick_ms, orders = [], 0
    now = 0.0
    for _ in range(ticks):
        now += tick_seconds
        fresh = [
            _advice(rng, rng.randrange(sessions), instances, candidate_share) for _ in range(page)
        ]
        started = time.perf_counter()
        sched.advise(fresh, now)
        plan = sched.plan(now)
        tick_ms.append((time.perf_counter() - started) * 1000)
        orders += len(plan.orders)

    info(f"baseline: {baseline_ticks} ticks re-reading all {sessions:,} sessions")
    base = Scheduler(store, config, advice_ttl_seconds=1e9)
    base_ms = []
    for t in range(baseline_ticks):
        started = time.perf_counter()
        base.advise(advice, now + t * tick_seconds)
        base.plan(now + t * tick_seconds)
        base_ms.append((time.perf_counter() - started) * 1000)

    score_ms = None
    try:
        from app.core.bundle import DEFAULT_MODEL_DIR
        from app.decide.advisor import Advisor
        from app.predict.predictors import LearnedPredictor

        planner = Advisor(LearnedPredictor(DEFAULT_MODEL_DIR))
        views = _sessions(page, seed)
        at = max(v.last_activity_ts for v in views) + 30.0
        times = []
        for _ in range(7):
            started = time.perf_counter()
            planner.advise(views, at)
            times.append((time.perf_counter() - started) * 1000)
        score_ms = round(sorted(times)[len(times) // 2], 3)
    except Exception as exc:  # the scheduler's figures stand without it
        info(f"scoring a page was not measured: {exc}")

    from bench.scoring import measure_plan

    service = {}
    for n in pass_sessions:
        info(f"the service's pass and plan over {n:,} live sessions, {pass_rounds} rounds")
        service[str(n)] = measure_plan(n, rounds=pass_rounds, seed=seed)

    p50, p99 = _percentile(tick_ms, 0.5), _percentile(tick_ms, 0.99)
    base_p50 = _percentile(base_ms, 0.5)
    return {
        "sessions_tracked": sched.tracked_sessions,
        "instances": instances,
        "page_sessions": page,
        "ticks": ticks,
        "open_orders": len(sched.open_orders()),
        "orders_per_tick": round(orders / ticks, 2),
        "plan_tick_ms": {"p50": round(p50, 3), "p99": round(p99, 3), "max": round(max(tick_ms), 3)},
        "baseline_reread_all_ms": {"p50": round(base_p50, 3), "rounds": baseline_ticks},
        "speedup_p50": round(base_p50 / p50, 1) if p50 > 0 else None,
        "score_page_ms_median": score_ms,
        "target_p99_ms": TARGET_P99_MS,
        "service": service,
        # Other jobs on a shared machine inflate every figure.
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        **machine(),
    }
