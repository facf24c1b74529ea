"""What each unit of the service's state costs in RSS, measured on the bench's own traffic.

`calibrate()` runs one fresh process per unit (`python -m bench.load.calibrate --mode M`): most
build the service's Engine (app/engine.py: every ingest observer; no loops, no HTTP), ingest
this traffic, and report RSS before and after with the store's counts. The units: a tracked
session, a resident block, a removal tombstone, a session the scheduler tracks with its advice,
and, for the pull sink, an order it holds and an order id it remembers. With the memory store,
besides: a remembered event id (the store's dedupe ring alone taking fresh ids, young), and the
ring at its configured size, run through its cycle. Each unit's RSS step is one process's, never
a difference between two processes: that difference is as small as the unit's share and as noisy
as both processes' whole growth, and read 0 on a loaded machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

from bench._util import REPO, child_env
from bench.load.probes import redis_clean
from bench.load.processes import BenchError
from bench.load.traffic import BLOCK_TOKENS, BYTES_PER_BLOCK, Shard

MODES = ("sessions", "ids", "ring", "blocks", "tombstones", "advice", "orders")
# Measured with the memory store only: with Redis the ids are Redis keys, not the service's RSS.
MEMORY_STORE_MODES = ("ids", "ring")
# Fresh ids for `ids`, per calibration session: an RSS step far above a page (~130 bytes each).
IDS_PER_SESSION = 10
MIN_IDS = 100_000
# Nothing may expire while a unit is being counted: the calibration's events are stamped with
# the wall clock, and a long calibration would outlast the service's default windows.
_NEVER_SECONDS = 1e9


def _worker(
    mode: str, sessions: int, store: str, redis_url: str, dedupe_max_ids: int | None, seed: int
) -> dict[str, Any]:
    """In a fresh process: the service's Engine ingests this traffic; RSS before and after, with
    what grew.

    modes: `sessions` (request and close events, one remembered id), `ids` (fresh event ids
    remembered by the memory store's dedupe ring alone), `blocks` (kv_blocks_stored of fresh
    blocks only, one id), `tombstones` (fresh blocks stored and removed again: what a removal
    leaves behind), `advice` (the sessions ingested, then scored and planned as the service's
    loops do: what the scheduler and the advice ledger keep per session advised), `orders` (pin
    orders of this traffic's contexts held by the pull sink, as the scheduler makes them), `ring`
    (the memory store's dedupe ring alone, through its cycle)."""
    import asyncio

    import psutil

    from app.core.config import Settings

    if mode == "orders":
        return _orders(sessions, seed)
    if mode == "ring":
        return _ring(dedupe_max_ids or Settings.model_fields["dedupe_max_ids"].default)
    if mode == "ids":
        return _ids(max(MIN_IDS, IDS_PER_SESSION * sessions))

    from app.engine import Engine
    from kvprefetch_client.events import batch_adapter

    tmp = Path(tempfile.mkdtemp(prefix="kvp-bench-load-cal-"))
    prefix = f"kvp-bench-load-cal-{uuid.uuid4().hex[:12]}"
    overrides: dict[str, Any] = {
        "store": store,
        "redis_url": redis_url,
        "redis_prefix": prefix,
        "data_dir": tmp,
        "log_fsync": False,
        "score_interval_seconds": 0,
        "plan_interval_seconds": 0,
        "dashboard_sample_seconds": 0,
        "replica_id": "bench-load-calibrate",
        # Ids are priced by `ids` alone; here they would only blur the other units.
        "dedupe_max_ids": 1,
        "session_retention_seconds": _NEVER_SECONDS,
        "reorder_window_seconds": _NEVER_SECONDS,
    }
    settings = Settings(_env_file=None, **overrides)
    engine = Engine(settings)
    proc = psutil.Process()
    # A population smaller than the sessions ingested, so most of them live and end as in the run.
    kv = mode in ("blocks", "tombstones")
    shard = Shard(
        seed=seed,
        sessions=max(1, min(3000, sessions // 4)),
        instance_ids=[f"cal-{i:02d}" for i in range(16)],
        hbm_blocks=10 if mode == "tombstones" else 10**9,
        kv_events=kv,
        status_events=False,
    )

    tombstones_after: list[int] = []  # the shard's count once each body was made

    def bodies() -> list[bytes]:
        out: list[bytes] = []
        if kv:
            for _ in range(
                max(2, sessions // 10)
            ):  # as many blocks as the sessions run has hashes, roughly
                for inst in shard.instances:
                    shard.store(inst, [shard.rng.getrandbits(63) for _ in range(10)])
                out.append(orjson.dumps({"events": shard.take()}))
                tombstones_after.append(shard.tombstones_alive)
            return out
        while shard.sessions_started < sessions or len(out) < 2:
            out.append(shard.batch(1000)[0])
        return out

    def go() -> dict[str, Any]:
        store_ = engine.store
        # The planning side runs off the request (a backlog): hand it each batch at once, as the
        # service's loop does between requests.
        # Made before the baseline and kept until after, so they weigh in both.
        made = bodies()
        warm = made[0]
        engine.ingest(batch_adapter.validate_json(warm).events, warm)
        engine.drain()
        gc.collect()
        before_stats = store_.stats()
        before = proc.memory_info().rss
        for body in made[1:]:
            engine.ingest(batch_adapter.validate_json(body).events, body)
            engine.drain()
        if mode == "advice":
            return advise(int(store_.stats()["sessions"]))
        gc.collect()
        after = proc.memory_info().rss
        after_stats = store_.stats()
        growth = {k: after_stats[k] - before_stats.get(k, 0) for k in after_stats}
        growth["tombstones"] = tombstones_after[-1] - tombstones_after[0] if tombstones_after else 0
        return {"mode": mode, "bytes": after - before, "growth": growth}

    def advise(sessions: int) -> dict[str, Any]:
        """Every live session scored a page at a time, then one plan: the scheduler's latest
        advice and pins, the ledger's entries."""
        scheduler = engine.scheduler
        gc.collect()
        before, tracked = proc.memory_info().rss, scheduler.tracked_sessions
        for _ in range(2 + sessions // engine.scorer.sessions_per_tick):
            engine.score_tick()
        scheduler.plan(time.time())
        gc.collect()
        return {
            "mode": mode,
            "bytes": proc.memory_info().rss - before,
            "growth": {"tracked_sessions": scheduler.tracked_sessions - tracked},
        }

    try:
        return go()
    finally:
        asyncio.run(engine.close())
        shutil.rmtree(tmp, ignore_errors=True)
        if store == "redis":
            redis_clean(redis_url, prefix)


def _orders(n: int, seed: int) -> dict[str, Any]:
    """Order ids remembered by a sink's dedupe alone, then orders held by a pull sink (which
    remembers each one's id too)."""
    import psutil

    from app.deliver._dedupe import RecentIds
    from app.deliver.pull import PullQueue
    from kvprefetch_client.orders import Order, order_id_for

    shard = Shard(
        seed=seed,
        sessions=max(1, min(3000, n // 4)),
        instance_ids=[f"cal-{i:02d}" for i in range(16)],
        hbm_blocks=10**9,
        status_events=False,
    )
    for _ in range(n):  # contexts of a few turns, as pins name them
        shard.step()
    shard.take()
    convs = shard.idle + list(shard.running)
    ids = RecentIds(3600.0)
    sink = PullQueue()
    n_ids = 10 * n  # an id is small: more of them, for an RSS step well above a page
    proc = psutil.Process()
    gc.collect()
    before = proc.memory_info().rss
    for i in range(n_ids):
        ids.add(order_id_for("pin", "cal-00", "hbm", [i], i))
    gc.collect()
    mid = proc.memory_info().rss
    now = time.time()
    for i in range(n):
        c = convs[i % len(convs)]
        blocks = list(c.blocks)
        sink.submit_nowait(
            [
                Order(
                    order_id=order_id_for("pin", c.instance_id, "hbm", blocks, i),
                    kind="pin",
                    instance_id=c.instance_id,
                    block_hashes=blocks,
                    size_bytes=len(blocks) * BYTES_PER_BLOCK,
                    created_ts=now,
                    start_by_ts=now,
                    needed_by_ts=now,
                    ttl_seconds=300.0,
                    session_ids=[c.session_id],
                )
            ]
        )
    gc.collect()
    after = proc.memory_info().rss
    return {
        "mode": "orders",
        "bytes": after - mid,
        "bytes_ids": mid - before,
        "growth": {"orders": sink.held(), "order_ids": len(ids)},
    }


def _ring_store(max_ids: int) -> Any:
    from app.state.memory import MemoryStore

    return MemoryStore(
        bytes_per_token=BYTES_PER_BLOCK // BLOCK_TOKENS,
        block_tokens=BLOCK_TOKENS,
        dedupe_max_ids=max_ids,
    )


def _apply_ids(store: Any, prefix: str, first: int, n: int) -> None:
    """Events numbered first..first+n-1 applied, with ids like the run's (traffic.py's
    Shard._event_id). The cheapest event to apply: the ring is what is measured."""
    from kvprefetch_client.events import InstanceStatus

    store.apply(
        [
            InstanceStatus.model_construct(
                type="instance_status",
                event_id=f"{prefix}-{i:012x}",
                ts=1.7e9 + i * 1e-5,
                instance_id="cal",
                free_kv_bytes=0,
                total_kv_bytes=0,
                queue_depth=0,
                running_requests=0,
            )
            for i in range(first, first + n)
        ]
    )


def _ids(n: int) -> dict[str, Any]:
    """`n` fresh event ids remembered by the memory store's dedupe ring (docs/decisions.md 4),
    RSS before and after, in this one process. The ring holds them all (a young one, as the
    run's is until it turns over; after, `ring` prices it)."""
    import psutil

    chunk = 1000
    store = _ring_store(4 * (n + chunk))
    prefix = str(uuid.uuid4())[:23]
    proc = psutil.Process()
    # A chunk first, so the events' transient objects and the store's lazy ones weigh on both
    # sides.
    _apply_ids(store, prefix, 0, chunk)
    gc.collect()
    ids0, before = store.stats()["remembered_event_ids"], proc.memory_info().rss
    for first in range(chunk, chunk + n, chunk):
        _apply_ids(store, prefix, first, min(chunk, chunk + n - first))
    gc.collect()
    after = proc.memory_info().rss
    remembered = store.stats()["remembered_event_ids"] - ids0
    return {
        "mode": "ids",
        "bytes": after - before,
        "growth": {"remembered_event_ids": remembered, "ids_applied": n},
    }


def _ring(max_ids: int) -> dict[str, Any]:
    """The memory store's dedupe ring of `max_ids` (docs/decisions.md 4) run until just before
    its third turnover, with ids like the run's: the most RSS it reaches. From its second
    turnover on it holds two generations of ids and, until the next turnover, the set table of
    the generation it freed: a full ring costs more than its ids at their cost in a young one."""
    import psutil

    store = _ring_store(max_ids)
    prefix = str(uuid.uuid4())[:23]
    proc = psutil.Process()
    gc.collect()
    base = proc.memory_info().rss
    peak = n = 0
    end = 3 * ((max_ids + 1) // 2) - 1
    while n < end:
        k = min(1000, end - n)
        _apply_ids(store, prefix, n, k)
        n += k
        if n % 50_000 < k or n == end:
            peak = max(peak, proc.memory_info().rss - base)
    return {"mode": "ring", "bytes": peak, "growth": {"max_ids": max_ids, "ids_applied": n}}


def modes(store: str) -> list[str]:
    """The units measured: the event ids and the ring only where the service keeps them (the
    memory store)."""
    return [m for m in MODES if store == "memory" or m not in MEMORY_STORE_MODES]


def calibrate(
    sessions: int, store: str, redis_url: str, dedupe_max_ids: int | None, seed: int
) -> dict[str, Any]:
    """Bytes of RSS per unit of state, each unit measured in a fresh process."""
    results = {}
    for mode in modes(store):
        cmd = [
            sys.executable,
            "-m",
            "bench.load.calibrate",
            "--mode",
            mode,
            "--sessions",
            str(sessions),
            "--store",
            store,
            "--redis-url",
            redis_url,
            "--seed",
            str(seed),
        ]
        if dedupe_max_ids is not None:
            cmd += ["--dedupe-max-ids", str(dedupe_max_ids)]
        done = subprocess.run(cmd, cwd=REPO, env=child_env({}), capture_output=True, check=False)
        if done.returncode != 0:
            raise BenchError(
                f"calibration {mode} failed ({done.returncode}):\n{done.stderr.decode()[-3000:]}"
            )
        results[mode] = json.loads(done.stdout)
    s, b, t, a, o = (results[m] for m in ("sessions", "blocks", "tombstones", "advice", "orders"))
    n_sessions = max(1, s["growth"]["sessions"])
    per_id, n_ids = 0.0, 0  # with Redis: its keys, none of the service's RSS
    if "ids" in results:
        i = results["ids"]
        n_ids = i["growth"]["remembered_event_ids"]
        if n_ids != i["growth"]["ids_applied"]:
            raise BenchError(
                f"calibration ids: the store remembers {n_ids:,} of the "
                f"{i['growth']['ids_applied']:,} fresh ids it applied"
            )
        per_id = max(0, i["bytes"]) / n_ids
    n_blocks = max(1, b["growth"]["resident_blocks"])
    n_tombstones = max(1, t["growth"]["tombstones"])
    n_advised = max(1, a["growth"]["tracked_sessions"])
    n_orders, n_order_ids = max(1, o["growth"]["orders"]), max(1, o["growth"]["order_ids"])
    per_order_id = max(0, o["bytes_ids"]) / n_order_ids
    return {
        "bytes_per_session": round(max(0, s["bytes"]) / n_sessions, 1),
        "bytes_per_event_id": round(per_id, 1),
        "bytes_per_resident_block": round(max(0, b["bytes"]) / n_blocks, 1),
        "bytes_per_tombstone": round(max(0, t["bytes"]) / n_tombstones, 1),
        "bytes_per_advised_session": round(max(0, a["bytes"]) / n_advised, 1),
        # A held order's id is remembered too, and stays remembered after the order expires:
        # the two are priced apart.
        "bytes_per_held_order": round(max(0.0, max(0, o["bytes"]) / n_orders - per_order_id), 1),
        "bytes_per_remembered_order_id": round(per_order_id, 1),
        "dedupe_ring_peak_bytes": results["ring"]["bytes"] if "ring" in results else None,
        "measured_on": {
            "sessions": n_sessions,
            "event_ids": n_ids,
            "resident_blocks": n_blocks,
            "tombstones": n_tombstones,
            "advised_sessions": n_advised,
            "orders": n_orders,
            "order_ids": n_order_ids,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description="one unit of `kvprefetch bench load`'s calibration"
    )
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--sessions", type=int, required=True)
    parser.add_argument("--store", choices=["memory", "redis"], default="memory")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--dedupe-max-ids", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(
        json.dumps(
            _worker(
                args.mode, args.sessions, args.store, args.redis_url, args.dedupe_max_ids, args.seed
            )
        )
    )


if __name__ == "__main__":
    main()
