"""The service's own scoring path, as `kvprefetch bench predict` and `bench plan` measure it.

A real MemoryStore holds `n` live sessions, built from events as ingestion applies them (1-6
turns each, contexts of 2-80 blocks on 16 instances, one session in 50 with a fresh signal, a few
running or queued); the engine's Scorer (app/decide/score_loop.py) scores it with the bundled
model as the serving model (and, when asked, the same model as the shadow), its ledger and a
scheduler taking the advice, as the service wires them:

- `pass`: `Scorer.tick()` with `every_live` (what the service runs: KVP_SCORE_ALL_LIVE): every
  live session in chunks, after `churn` of them had an event since the last pass (re-read in
  bulk first). Its longest chunk is what holds the event loop in one piece.
- `pages`: the page path it replaced, `ceil(n / 256)` ticks of 256 sessions read from the store
  as views (what covering every session took before), measured as one tick of all `n` (the
  page's own cost scales with its sessions: a page is a listing, views, the advisor).
"""

from __future__ import annotations

import random
import time
from typing import Any

from bench._util import START_TS

INSTANCES = 16
BLOCK_TOKENS = 512
PAGE_SESSIONS = 256


def build_store(n: int, seed: int = 0) -> tuple[Any, float]:
    """A MemoryStore of `n` sessions and the time to score it at (30 s after the newest)."""
    from app.state import MemoryStore
    from kvprefetch_client.events import (
        RequestFinished,
        RequestRouted,
        SessionSignal,
    )

    rng = random.Random(seed)
    store = MemoryStore(bytes_per_token=4096, block_tokens=BLOCK_TOKENS, dedupe_max_ids=1)
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
        if len(events) >= 50_000:
            store.apply(events)
            events = []
    store.apply(events)
    return store, now


def scorer(store: Any, now: float, *, shadow: bool, every_live: bool, page: int) -> Any:
    """The engine's wiring of a Scorer (app/engine.py), with a manual clock at `now`."""
    from app.core.bundle import DEFAULT_MODEL_DIR
    from app.core.clock import ManualClock
    from app.decide.routing import SameInstanceEstimate
    from app.decide.scheduler import Scheduler, SchedulerConfig
    from app.decide.score_loop import Scorer
    from app.observe.ledger import AdviceLedger
    from app.predict.features import DeploymentSignals
    from app.predict.registry import ModelRegistry

    ledger = AdviceLedger()
    deployment = DeploymentSignals()
    models = ModelRegistry(DEFAULT_MODEL_DIR, ledger=ledger, deployment=deployment)
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


def measure(
    n: int, *, rounds: int, shadow: bool, churn: float = 0.01, seed: int = 0
) -> dict[str, Any]:
    """The pass (median ms over `rounds` passes after a first that builds the table, longest
    chunk, sessions advised and handed on) and the page path's time for all `n`."""
    import statistics

    store, now = build_store(n, seed)
    s = scorer(store, now, shadow=shadow, every_live=True, page=PAGE_SESSIONS)
    started = time.perf_counter()
    s.tick()  # the first pass builds the table from the store
    first_ms = (time.perf_counter() - started) * 1000
    pass_ms, chunk_ms, refresh = [], [], []
    for r in range(rounds):
        now += 1.0
        s.clock.set(now)
        s.observe(churn_events(store, n, churn, r, now))
        s.tick()
        stats = s.last_pass
        pass_ms.append(stats.seconds * 1000)
        chunk_ms.append(stats.longest_chunk_seconds * 1000)
        refresh.append(stats.handed)
    stats = s.last_pass
    # The page path: the same store read as views and advised, every session once.
    old = scorer(store, now, shadow=shadow, every_live=False, page=n)
    page_ms = []
    for _ in range(max(1, min(rounds, 3))):
        started = time.perf_counter()
        old.tick()
        page_ms.append((time.perf_counter() - started) * 1000)
    return {
        "sessions": n,
        "table_rows": stats.sessions,
        "advised": stats.advised,
        "shadow": shadow,
        "churn_share": churn,
        "first_pass_ms": round(first_ms, 1),
        "pass_ms": round(statistics.median(pass_ms), 1),
        "pass_ms_max": round(max(pass_ms), 1),
        "chunks": stats.chunks,
        "longest_chunk_ms": round(statistics.median(chunk_ms), 1),
        "handed_to_scheduler": int(statistics.median(refresh)),
        "pages_path_ms": round(statistics.median(page_ms), 1),
        "pages_path_over_pass": round(statistics.median(page_ms) / statistics.median(pass_ms), 2),
    }
