"""The Mooncake agent's time to last byte for one context, beside a plain `get` of it.

    python -m bench.mooncake [--context-bytes 33554432] [--blocks 1] [--rounds 7]

Starts a `mooncake_master` and a pool holder (bench/mooncake_cluster.py) on loopback TCP; the
holder puts the context as `blocks` objects. Each round, in this process:

- agent: `MooncakeTier.prefetch` of the context onto the tier's own segment (a copy task per
  block, `query_task` until done), its `seconds` being what the agent reports in
  `order_progress`; then a demote moves the replicas back, so the next round copies again.
- get: a second store client (no replica of its own) `get_batch`es the same keys into this
  process.

Prints one JSON object: medians, min and max of both, in seconds, and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._util import quiet_port
from bench.mooncake_cluster import Holder, Master, pattern
from kvprefetch_client.agent.mooncake import MooncakeSettings, MooncakeTier, store_key
from kvprefetch_client.orders import Order, OrderKind

NS = "bench"


def _order(order_id: str, kind: OrderKind, blocks: list[int], size_bytes: int) -> Order:
    now = time.time()
    return Order(
        order_id=order_id,
        kind=kind,
        instance_id="gpu-0",
        source_tier="pool" if kind == "prefetch" else None,
        block_hashes=blocks,
        size_bytes=size_bytes,
        created_ts=now,
        start_by_ts=now,
        needed_by_ts=now + 5.0,
    )


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def run(*, context_bytes: int = 32 << 20, blocks: int = 1, rounds: int = 7) -> dict[str, Any]:
    from mooncake.store import MooncakeDistributedStore

    block_bytes = context_bytes // blocks
    hashes = list(range(1, blocks + 1))
    keys = [store_key(NS, h) for h in hashes]
    segment_bytes = max(256 << 20, 4 * context_bytes)
    with tempfile.TemporaryDirectory(prefix="kvp-bench-mooncake-") as work:
        master = Master(Path(work))
        master.start()
        holder = Holder(master, Path(work), segment_bytes=segment_bytes)
        settings = MooncakeSettings(
            master_address=master.address,
            metadata_url=master.metadata_url,
            local_host=f"127.0.0.1:{quiet_port()}",
            segment_bytes=segment_bytes,
            buffer_bytes=max(64 << 20, 2 * context_bytes),
            namespace=NS,
        )
        tier = MooncakeTier("gpu-0", settings)
        reader = MooncakeDistributedStore()
        try:
            for key in keys:
                rc = holder.put(key, block_bytes)
                if rc != 0:
                    raise RuntimeError(f"the holder's put of {key} returned {rc}")
            rc = reader.setup(
                f"127.0.0.1:{quiet_port()}",
                master.metadata_url,
                0,  # a reader only: no segment, so every get crosses loopback
                max(64 << 20, 2 * context_bytes),
                "tcp",
                "",
                master.address,
            )
            if rc != 0:
                raise RuntimeError(f"the reader's setup returned {rc}")
            agent_s: list[float] = []
            order_s: list[float] = []
            get_s: list[float] = []
            for i in range(rounds):
                t0 = time.perf_counter()
                done = tier.prefetch(_order(f"p{i}", "prefetch", hashes, context_bytes), 0.0)
                order_s.append(time.perf_counter() - t0)
                if done.failure is not None or done.bytes != context_bytes:
                    raise RuntimeError(f"round {i}: prefetch {done}")
                agent_s.append(done.seconds)
                t0 = time.perf_counter()
                got = reader.get_batch(keys)
                get_s.append(time.perf_counter() - t0)
                if [len(g) for g in got] != [block_bytes] * blocks or got[0] != pattern(
                    keys[0], block_bytes
                ):
                    raise RuntimeError(f"round {i}: get_batch returned other bytes")
                back = tier.demote(_order(f"d{i}", "demote", hashes, context_bytes), 0.0)
                if back.failure is not None:
                    raise RuntimeError(f"round {i}: demote {back}")
        finally:
            reader.close()
            tier.close()
            holder.close()
            master.stop()
    return {
        "bench": "mooncake",
        "context_bytes": context_bytes,
        "blocks": blocks,
        "rounds": rounds,
        "transport": "tcp over loopback",
        "agent_ttlb_seconds": _spread(agent_s),
        "agent_order_seconds": _spread(order_s),
        "plain_get_seconds": _spread(get_s),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.mooncake", description=__doc__)
    p.add_argument("--context-bytes", type=int, default=32 << 20)
    p.add_argument("--blocks", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    print(json.dumps(run(context_bytes=a.context_bytes, blocks=a.blocks, rounds=a.rounds)))


if __name__ == "__main__":
    main()
