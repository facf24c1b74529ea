"""Bounded state and bounded answers on the real service process: order records kept only for the
session retention, and the worst route hint measured against the event loop.

Memory and stalls are measured and printed, never asserted as numbers (the machines are noisy);
what is asserted is what the store holds and what the service refuses."""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:
    from tests.e2e.conftest import ServiceProcess

pytestmark = pytest.mark.slow

RETENTION_SECONDS = 100.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def post(client: httpx.Client, events: list[dict[str, Any]]) -> None:
    r = client.post("/v1/events", json={"events": events})
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()["accepted"]) == len(events), r.text[:300]


def test_distinct_order_ids_are_kept_for_the_retention_only(
    service_factory: Callable[..., ServiceProcess],
) -> None:
    # Few remembered event ids, so that what grows is the orders' records, not the dedupe ring.
    svc = service_factory(
        env={
            "KVP_SESSION_RETENTION_SECONDS": str(RETENTION_SECONDS),
            "KVP_DEDUPE_MAX_IDS": "20000",
            "KVP_LOG_FSYNC": "false",
        }
    )
    svc.start()
    assert svc.proc is not None
    n, batch, step = 200_000, 10_000, 0.005  # 1,000 s of event time: ten retentions
    t0 = time.time() - 2000.0
    with httpx.Client(base_url=svc.url, timeout=60) as client:
        post(
            client,
            [
                {
                    "type": "order_progress",
                    "event_id": "warm",
                    "ts": t0 - 1.0,
                    "order_id": "warm",
                    "status": "accepted",
                }
            ],
        )
        before = rss_mib(svc.proc.pid)
        for start in range(0, n, batch):
            post(
                client,
                [
                    {
                        "type": "order_progress",
                        "event_id": f"e{i}",
                        "ts": t0 + i * step,
                        "order_id": f"order-{i:08d}-{'x' * 24}",
                        "status": "accepted",
                    }
                    for i in range(start, start + batch)
                ],
            )
        after = rss_mib(svc.proc.pid)
        held = client.get("/readyz").json()["stats"]["orders"]
    newest = t0 + (n - 1) * step
    kept = sum(1 for i in range(n) if t0 + i * step >= newest - RETENTION_SECONDS)
    print(
        f"\n{n} order_progress events, distinct order ids, over {n * step:.0f} s of event time "
        f"(retention {RETENTION_SECONDS:.0f} s): "
        f"RSS {before:.1f} MiB before, {after:.1f} MiB after "
        f"(+{after - before:.1f} MiB); orders held {held} (those of the last retention: {kept})"
    )
    assert held == kept


def test_the_worst_route_hint_is_bounded_and_the_loop_keeps_answering(
    service_factory: Callable[..., ServiceProcess],
) -> None:
    svc = service_factory(env={"KVP_LOG_FSYNC": "false"})
    svc.start()
    n_blocks, n_candidates = 65_536, 64
    context = list(range(10**9, 10**9 + n_blocks))
    candidates = [f"gpu-{k}" for k in range(n_candidates)]
    with httpx.Client(base_url=svc.url, timeout=120) as client:
        post(
            client,
            [
                {
                    "type": "request_routed",
                    "event_id": "r",
                    "ts": 1.0,
                    "session_id": "s",
                    "request_id": "q",
                    "instance_id": "gpu-0",
                    "prompt_tokens": n_blocks * 16,
                    "block_tokens": 16,
                    "block_hashes": context,
                },
                {
                    "type": "kv_blocks_stored",
                    "event_id": "p",
                    "ts": 1.0,
                    "tier": "pool",
                    "block_hashes": context,
                },
            ],
        )
        post(
            client,
            [
                {
                    "type": "kv_blocks_stored",
                    "event_id": f"h{k}",
                    "ts": 1.0,
                    "tier": "hbm",
                    "instance_id": c,
                    "block_hashes": context[: 1024 * (k + 1)],
                }
                for k, c in enumerate(candidates[:8])
            ],
        )
        # More candidates than the cap: refused by name before any work.
        r = client.post(
            "/v1/route-hint", json={"session_id": "s", "candidates": [*candidates, "gpu-64"]}
        )
        assert r.status_code == 422 and r.json()["field"] == "candidates", r.text[:300]

        waits: list[float] = []
        stop, probing = threading.Event(), threading.Event()

        def probe() -> None:
            with httpx.Client(base_url=svc.url, timeout=120) as c:
                while not stop.is_set():
                    started = time.perf_counter()
                    c.get("/healthz")
                    waits.append(time.perf_counter() - started)
                    probing.set()
                    time.sleep(0.005)

        prober = threading.Thread(target=probe)
        prober.start()
        # The hints can be done before a first probe: measure /healthz beside them, not after.
        assert probing.wait(60)
        took = []
        try:
            for _ in range(20):
                started = time.perf_counter()
                r = client.post(
                    "/v1/route-hint", json={"session_id": "s", "candidates": candidates}
                )
                took.append(time.perf_counter() - started)
                assert r.status_code == 200, r.text[:300]
        finally:
            stop.set()
            prober.join()
    body = r.json()
    print(
        f"\nroute hint over {n_blocks} blocks and {n_candidates} candidates, 20 times: "
        f"median {statistics.median(took) * 1000:.1f} ms, "
        f"max {max(took) * 1000:.1f} ms a hint over HTTP; "
        f"/healthz meanwhile ({len(waits)} probes): "
        f"median {statistics.median(waits) * 1000:.1f} ms, "
        f"max {max(waits) * 1000:.1f} ms"
    )
    assert body["recommended"] == "gpu-7"  # holds the longest prefix: 8 x 1024 blocks
    assert body["candidates"][7]["resident_bytes"] == 8 * 1024 * 16 * 327_680


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _healthz_ms(url: str, n: int = 20) -> list[float]:
    waits = []
    with httpx.Client(base_url=url, timeout=60) as c:
        for _ in range(n):
            started = time.perf_counter()
            assert c.get("/healthz").status_code == 200
            waits.append((time.perf_counter() - started) * 1000)
    return waits


def test_distinct_instance_ids_stay_at_the_cap_and_are_forgotten_past_their_retention(
    service_factory: Callable[..., ServiceProcess], tmp_path: Path
) -> None:
    from tests.e2e.test_auth_e2e import make_token

    cap, retention = 1000, 100.0
    tokens_file = tmp_path / "tokens.toml"
    agent = make_token(tokens_file, "agent-flood", "agent")
    svc = service_factory(
        env={
            "KVP_TOKENS_FILE": str(tokens_file),
            "KVP_MAX_INSTANCES": str(cap),
            "KVP_INSTANCE_RETENTION_SECONDS": str(retention),
            "KVP_LOG_FSYNC": "false",
        }
    )
    svc.start()
    assert svc.proc is not None
    headers = {"authorization": f"Bearer {agent}"}
    posts, batch = 15, 2000
    t0 = time.time() - 1000.0

    def stored(i: int, ts: float) -> dict[str, Any]:
        return {
            "type": "kv_blocks_stored",
            "event_id": f"k{i}",
            "ts": ts,
            "instance_id": f"gpu-{i:06d}-{'x' * 16}",
            "block_hashes": [i, i + 1],
        }

    def held(client: httpx.Client) -> tuple[int, int]:
        stats = client.get("/readyz").json()["stats"]
        return stats["instances"], stats["locations"]

    with httpx.Client(base_url=svc.url, timeout=120, headers=headers) as client:
        before = rss_mib(svc.proc.pid)
        accepted = refused = 0
        for p in range(posts):
            r = client.post(
                "/v1/events",
                json={"events": [stored(p * batch + k, t0) for k in range(batch)]},
            )
            body = r.json()
            accepted += len(body["accepted"])
            refused += body.get("rejected_events", 0)
            assert r.status_code == (200 if accepted <= cap and not refused else 422), r.text[:300]
            assert all(x["field"].endswith(".instance_id") for x in body["rejected"])
        assert (accepted, refused) == (cap, posts * batch - cap)
        assert held(client) == (cap, cap)
        flooded = rss_mib(svc.proc.pid)
        cpu0, idle0 = _cpu_seconds(svc.proc.pid), time.monotonic()
        time.sleep(3.0)
        idle_cpu = (_cpu_seconds(svc.proc.pid) - cpu0) / (time.monotonic() - idle0)
        at_cap = _healthz_ms(svc.url)
        # Past the retention (event time), the flood is forgotten and new instances are taken.
        later = t0 + 2 * retention
        r = client.post(
            "/v1/events", json={"events": [stored(10**6 + k, later) for k in range(cap)]}
        )
        assert r.status_code == 200 and len(r.json()["accepted"]) == cap, r.text[:300]
        assert held(client) == (cap, cap)
        pages, cursor, seen = 0, None, []
        while True:
            params = {"limit": 300, **({"cursor": cursor} if cursor else {})}
            page = client.get("/v1/locations", params=params).json()
            seen += [loc["location"] for loc in page["locations"]]
            cursor, pages = page["next_cursor"], pages + 1
            if cursor is None:
                break
        assert seen == [f"hbm@gpu-{10**6 + k:06d}-{'x' * 16}" for k in range(cap)]
    # The log replays within the cap (the refused events were never logged).
    svc.restart()
    with httpx.Client(base_url=svc.url, timeout=120, headers=headers) as client:
        assert held(client) == (cap, cap)
    print(
        f"\n{posts} posts of {batch} kv_blocks_stored at distinct instance ids (agent token), "
        f"cap {cap}: RSS {before:.1f} MiB before, {flooded:.1f} MiB after "
        f"(+{flooded - before:.1f} MiB); idle CPU after {idle_cpu * 100:.1f}% of a core; "
        f"/healthz at the cap: median {statistics.median(at_cap):.1f} ms, "
        f"max {max(at_cap):.1f} ms; /v1/locations in {pages} page(s)"
    )
