"""Memory per tracked session in the MemoryStore, with and without the remembered event ids.

Each measurement runs in a fresh child process (`python -m bench.memory --worker ...`) so that
one does not inherit another's heap: it builds an empty MemoryStore, measures, loads `sessions`
whole sessions through the service's own parse path (JSON bytes -> batch_adapter.validate_json
-> MemoryStore.apply, so every string and int is the object the service would hold), measures
again, and divides the difference by the number of sessions.

- tracemalloc: bytes the Python heap holds for the store (exact, no allocator slack);
- rss: the process's resident set (psutil), what the machine pays, allocator slack included.

"including event ids" is the store as configured by default (it remembers up to 2,000,000 event
ids for idempotency); "excluding event ids" is the same load into a store that remembers one id
(dedupe_max_ids=1), so the difference is the dedupe set. That set is capped by dedupe_max_ids,
not by the number of sessions: `bytes_per_event_id` prices the cap.

Sessions are those of bench._util.Traffic with 2-4 turns each, routed + started + finished per
turn, 15-40 block hashes (ints in the millions, prefix-chained) like the Mooncake trace. Block
residency (kv_blocks_stored) is not per session (it is bounded by the tiers' capacity, since
engines evict) and is left out.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench._util import REPO, child_env, info, machine

TARGET_BYTES_PER_SESSION = 2048
DEFAULT_DEDUPE_MAX_IDS = 2_000_000


def _traffic(seed: int):
    from bench._util import Traffic

    return Traffic(seed=seed, first_blocks=(15, 30), blocks_per_turn=(1, 4), max_blocks=40)


def measure(sessions: int, method: str, keep_ids: bool, seed: int = 0) -> dict[str, Any]:
    """One measurement, in this process (meant to be a fresh one)."""
    import orjson
    import psutil

    from app.core.config import Settings
    from app.state.memory import MemoryStore
    from kvprefetch_client.events import batch_adapter

    settings = Settings(_env_file=None)
    store = MemoryStore(
        bytes_per_token=settings.bytes_per_token,
        block_tokens=settings.block_tokens,
        dedupe_max_ids=DEFAULT_DEDUPE_MAX_IDS if keep_ids else 1,
    )
    # The bodies are serialised before the baseline (tracemalloc would slow their making 5x) and
    # kept until after the last measurement, so they weigh the same in both.
    bodies = [orjson.dumps({"events": chunk}) for chunk in _traffic(seed).session_chunks(sessions)]
    warm = MemoryStore(bytes_per_token=1, block_tokens=1)
    warm.apply(
        batch_adapter.validate_json(bodies[0]).events
    )  # every lazy thing warm before the baseline
    del warm
    proc = psutil.Process()
    if method == "tracemalloc":
        import tracemalloc

        tracemalloc.start()
    gc.collect()

    def now() -> int:
        if method == "tracemalloc":
            return tracemalloc.get_traced_memory()[0]
        return int(proc.memory_info().rss)

    before = now()
    events = turns = hashes = 0
    for body in bodies:
        batch = batch_adapter.validate_json(body)
        store.apply(batch.events)
        events += len(batch.events)
        for e in batch.events:
            if e.type == "request_finished":
                turns += 1
                hashes += len(e.block_hashes or ())
        del batch
    gc.collect()
    after = now()
    stats = store.stats()
    if stats["sessions"] != sessions:
        raise RuntimeError(f"loaded {stats['sessions']} sessions, expected {sessions}")
    return {
        "method": method,
        "keep_ids": keep_ids,
        "sessions": sessions,
        "events": events,
        "turns": turns,
        "block_hashes_per_context": hashes / turns,
        "remembered_event_ids": stats["remembered_event_ids"],
        "bytes": after - before,
    }


def _child(sessions: int, method: str, keep_ids: bool, seed: int) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "bench.memory",
        "--worker",
        "--sessions",
        str(sessions),
        "--method",
        method,
        "--seed",
        str(seed),
        "--keep-ids" if keep_ids else "--drop-ids",
    ]
    done = subprocess.run(cmd, cwd=REPO, env=child_env({}), capture_output=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[2:])} failed ({done.returncode}):\n{done.stderr.decode()[-3000:]}"
        )
    return json.loads(done.stdout)


def run(*, sessions: int = 100_000, jobs: int = 2, seed: int = 0) -> dict[str, Any]:
    if sessions < 1:
        raise ValueError("sessions must be at least 1")
    plan = [(m, k) for m in ("tracemalloc", "rss") for k in (False, True)]
    info(
        f"bench memory: {sessions:,} sessions, {len(plan)} measurements in fresh processes "
        f"({jobs} at a time)"
    )
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = list(pool.map(lambda mk: _child(sessions, mk[0], mk[1], seed), plan))
    by = {(r["method"], r["keep_ids"]): r for r in results}
    for r in results:
        info(
            f"  {r['method']:11s} ids {'kept   ' if r['keep_ids'] else 'dropped'}: "
            f"{r['bytes'] / sessions:,.0f} bytes/session ({r['bytes'] / 2**20:,.1f} MiB)"
        )

    def per_session(method: str, keep: bool) -> float:
        return round(by[(method, keep)]["bytes"] / sessions, 1)

    kept = by[("tracemalloc", True)]
    ids = kept["remembered_event_ids"]
    id_bytes = {
        m: (by[(m, True)]["bytes"] - by[(m, False)]["bytes"]) for m in ("tracemalloc", "rss")
    }
    excluding = per_session("tracemalloc", False)
    return {
        "sessions": sessions,
        "events": kept["events"],
        "events_per_session": round(kept["events"] / sessions, 2),
        "turns_per_session": round(kept["turns"] / sessions, 2),
        "block_hashes_per_context": round(kept["block_hashes_per_context"], 1),
        "bytes_per_session": {
            "excluding_event_ids": excluding,
            "including_event_ids": per_session("tracemalloc", True),
        },
        "rss_bytes_per_session": {
            "excluding_event_ids": per_session("rss", False),
            "including_event_ids": per_session("rss", True),
        },
        "remembered_event_ids": ids,
        "bytes_per_event_id": {m: round(b / ids, 1) for m, b in id_bytes.items()},
        "dedupe_max_ids": DEFAULT_DEDUPE_MAX_IDS,
        "target_bytes_per_session_excluding_ids": TARGET_BYTES_PER_SESSION,
        "within_target": excluding <= TARGET_BYTES_PER_SESSION,
        **machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description="one measurement of bench memory (see `kvprefetch bench memory`)"
    )
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--sessions", type=int, required=True)
    parser.add_argument("--method", choices=["tracemalloc", "rss"], required=True)
    parser.add_argument("--seed", type=int, default=0)
    ids = parser.add_mutually_exclusive_group(required=True)
    ids.add_argument("--keep-ids", dest="keep_ids", action="store_true")
    ids.add_argument("--drop-ids", dest="keep_ids", action="store_false")
    args = parser.parse_args()
    print(json.dumps(measure(args.sessions, args.method, args.keep_ids, args.seed)))


if __name__ == "__main__":
    main()
