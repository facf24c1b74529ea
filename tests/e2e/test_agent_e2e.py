"""The reference transfer agent as real processes: the service, Redis and two `kvprefetch agent`s.

The test writes orders into gpu-0's stream `<KVP_REDIS_PREFIX>:sink:orders:gpu-0` exactly as the
producer (app/deliver/redis_stream.py) does: one field `msg`, an Order's or a Cancel's JSON,
and a cancel key for a cancelled order. Both agents serve gpu-0; an order in gpu-1's stream is
never read by either. One of them takes an order whose
start_by is a few seconds away and holds it; it is not robbed while alive (its heartbeat), then
it is killed with SIGKILL while holding it unacked. The other agent claims it, waits for its
start time, moves the bytes, and the service shows one completion, the blocks at hbm@gpu-0, and
nothing left pending in the stream. The same run carries a bulk prefetch (its measured time to
last byte is printed), an order whose block is missing from the pool, an order cancelled before
its start by a Cancel entry, one cancelled by its cancel key alone, and a malformed entry.

The service's default sink is the pull queue (GET /v1/orders, leases): there the service plans
the orders itself, from the events of a few sessions it expects back soon, and two `kvprefetch
agent --source pull` pull them. The one that leased them is killed with SIGKILL before their
start; the other gets them once the lease has run out, and each completes once (the pins the
scheduler then orders for the landed contexts are orders of their own, each run once too).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import redis

from app.ingest.eventlog import iter_log
from app.state.redis import RedisStore
from kvprefetch_client.agent import GROUP, PoolDir, cancel_key, default_stream_prefix, stream_key
from kvprefetch_client.orders import Cancel, Order, order_id_for
from tests import agent_process
from tests.agent_process import AgentProcess
from tests.e2e import streams

if TYPE_CHECKING:
    from tests.e2e.conftest import ServiceProcess

pytestmark = pytest.mark.slow

INSTANCE = "gpu-0"
CLAIM_IDLE_SECONDS = 1.5
HOLD_START_IN_SECONDS = 7.0
MIB = 1 << 20
HOLD_BLOCKS = list(range(1000, 1004))  # 1 MiB each
BULK_BLOCKS = list(range(2000, 2008))  # 4 MiB each
WAIT_LIMIT_SECONDS = 20.0


def agent(
    name: str, work: Path, service_url: str, pool: Path, source_args: list[str], **env: str
) -> AgentProcess:
    """`kvprefetch agent` for INSTANCE on the buffer tier in `pool`."""
    return AgentProcess(
        name,
        work,
        [
            "-m",
            "kvprefetch_cli",
            "agent",
            "--instance-id",
            INSTANCE,
            "--pool-dir",
            str(pool),
            "--capacity-bytes",
            str(256 * MIB),
            "--service-url",
            service_url,
            "--poll-seconds",
            "0.1",
            *source_args,
        ],
        env,
    )


def stream_agent(
    name: str, work: Path, service_url: str, redis_url: str, redis_prefix: str, pool: Path
) -> AgentProcess:
    # The stream's Redis and prefix come as the service's own settings do.
    return agent(
        name,
        work,
        service_url,
        pool,
        ["--consumer-name", name, "--claim-idle-seconds", str(CLAIM_IDLE_SECONDS)],
        KVP_REDIS_URL=redis_url,
        KVP_REDIS_PREFIX=redis_prefix,
    )


def pull_agent(name: str, work: Path, service_url: str, pool: Path) -> AgentProcess:
    return agent(name, work, service_url, pool, ["--source", "pull"])


def wait_ready(a: AgentProcess) -> None:
    # The status file appears once the agent has joined the group and told the service its
    # buffer is empty.
    wait_for(a.status_path.exists, f"{a.name} to start", a)


def wait_for(condition: Callable[[], Any], what: str, *agents: AgentProcess) -> Any:
    return agent_process.wait_for(condition, what, *agents, limit_seconds=WAIT_LIMIT_SECONDS)


def prefetch(
    order_id: str, blocks: list[int], start_in: float, size_bytes: int, instance_id: str = INSTANCE
) -> Order:
    now = time.time()
    return Order(
        order_id=order_id,
        kind="prefetch",
        instance_id=instance_id,
        source_tier="pool",
        block_hashes=blocks,
        size_bytes=size_bytes,
        created_ts=now,
        start_by_ts=now + start_in,
        needed_by_ts=now + start_in + 2.0,
    )


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[list[AgentProcess]]:
    made: list[AgentProcess] = []
    yield made
    for a in made:
        a.kill()


@pytest.mark.redis
def test_agents_move_real_bytes_report_progress_and_survive_a_kill_9(
    service_factory: Callable[..., ServiceProcess],
    redis_url: str,
    clean_redis: str,
    tmp_path: Path,
    agents: list[AgentProcess],
) -> None:
    prefix = clean_redis
    svc = service_factory(
        env={
            "KVP_STORE": "redis",
            "KVP_REDIS_URL": redis_url,
            "KVP_REDIS_PREFIX": prefix,
            "KVP_SCORE_INTERVAL_SECONDS": "0",
        }
    )
    svc.start()
    pool = PoolDir(tmp_path / "pool")
    for h in HOLD_BLOCKS:
        pool.write(h, os.urandom(MIB))
    for h in BULK_BLOCKS:
        pool.write(h, os.urandom(4 * MIB))
    for name in ("agent-a", "agent-b"):
        agents.append(stream_agent(name, tmp_path, svc.url, redis_url, prefix, pool.directory))
        agents[-1].start()
    for a in agents:
        wait_ready(a)
    r = redis.Redis.from_url(redis_url)
    stream_prefix = default_stream_prefix(prefix)  # what the service's sink writes to by default
    key = stream_key(stream_prefix, INSTANCE)
    # Another instance's order, in its own stream: no gpu-0 agent reads it (checked at the end).
    other_key = stream_key(stream_prefix, "gpu-1")
    r.xgroup_create(other_key, GROUP, id="0", mkstream=True)
    r.xadd(other_key, {"msg": prefetch("for-gpu-1", HOLD_BLOCKS, 0.0, 4 * MIB, "gpu-1").to_json()})
    store = RedisStore.from_url(redis_url, prefix=prefix, bytes_per_token=327680, block_tokens=512)

    # 1. An order due in a few seconds: one agent takes it and holds it, unacked.
    hold = prefetch("hold", HOLD_BLOCKS, HOLD_START_IN_SECONDS, 4 * MIB)
    r.xadd(key, {"msg": hold.to_json()})

    def holder() -> str | None:
        pending = r.xpending_range(key, GROUP, "-", "+", 10)
        return pending[0]["consumer"].decode() if pending else None

    first = wait_for(holder, "an agent to take the order", *agents)
    victim = next(a for a in agents if a.name == first)
    survivor = next(a for a in agents if a.name != first)
    wait_for(
        lambda: victim.status()["pending_orders"] == ["hold"], "the holder to schedule it", victim
    )
    # Twice the claim idle time: the live holder's heartbeat keeps the other agent off it.
    time.sleep(2 * CLAIM_IDLE_SECONDS + 0.3)
    assert holder() == victim.name
    assert store.order("hold") is None  # not started: start_by is still ahead

    # 2. kill -9 while it holds the order unacked.
    victim.kill()
    killed_at = time.time()

    # 3. More work, which only the survivor can take now.
    bulk = prefetch("bulk", BULK_BLOCKS, 0.0, 32 * MIB)
    missing = prefetch("missing", [3000, 3001], 0.0, 2 * MIB)
    pool.write(3000, b"x" * 100)  # 3001 is not in the pool
    withdrawn = prefetch("withdrawn", [3000], 3.0, 100)
    # Cancelled as another agent would have seen it: only the sink's cancel key says so.
    elsewhere = prefetch("cancelled-elsewhere", [3000], 3.0, 100)
    for msg in (
        bulk.to_json(),
        missing.to_json(),
        b"{not an order",
        withdrawn.to_json(),
        Cancel(order_id="withdrawn", reason="session closed").to_json(),
        elsewhere.to_json(),
    ):
        r.xadd(key, {"msg": msg})
    r.set(cancel_key(stream_prefix, "cancelled-elsewhere"), "1", ex=60)

    def finished() -> bool:
        views = [store.order(o) for o in ("hold", "bulk", "missing")]
        return (
            all(v is not None and v.status != "accepted" for v in views)
            and r.xpending(key, GROUP)["pending"] == 0
        )

    wait_for(finished, "every order to end and be acked", survivor)

    # The held order was redelivered to the survivor and completed once, after its start_by.
    view = store.order("hold")
    assert view is not None and view.status == "completed", view
    assert view.bytes == 4 * MIB and view.seconds is not None and view.seconds > 0
    assert view.status_ts >= hold.start_by_ts - 0.1
    assert view.status_ts >= killed_at + CLAIM_IDLE_SECONDS - 0.1
    progress = Counter(
        (e.order_id, e.status) for _, e in iter_log(svc.events_dir) if e.type == "order_progress"
    )
    assert progress[("hold", "completed")] == 1 and progress[("hold", "accepted")] == 1
    assert progress[("bulk", "completed")] == 1
    assert not any(o in ("withdrawn", "cancelled-elsewhere") for o, _ in progress)

    failed = store.order("missing")
    assert failed is not None and failed.status == "failed" and "3001" in (failed.reason or "")
    bulk_view = store.order("bulk")
    assert bulk_view is not None and bulk_view.status == "completed" and bulk_view.bytes == 32 * MIB

    # The blocks are at the destination: in the service's picture and in the agent's buffer.
    locations = httpx.get(f"{svc.url}/v1/locations", timeout=5).json()["locations"]
    hbm = {loc["location"]: loc for loc in locations}[f"hbm@{INSTANCE}"]
    # The missing order moved nothing: its blocks are checked against the pool before any byte.
    assert hbm["blocks"] == len(HOLD_BLOCKS) + len(BULK_BLOCKS)
    # Its status file is written on the agent's next turn: waited for until it counts the three
    # orders the service has as ended, not read at once.
    status = wait_for(
        lambda: (s := survivor.status()).get("completed", 0) + s.get("failed", 0) >= 3 and s,
        "the survivor's status to count its orders",
        survivor,
    )
    assert sorted(status["buffer_blocks"]) == sorted(HOLD_BLOCKS + BULK_BLOCKS)
    assert (status["completed"], status["failed"], status["withdrawn"], status["malformed"]) == (
        2,
        1,
        2,
        1,
    )
    assert status["foreign"] == 0
    (other_group,) = r.xinfo_groups(other_key)
    assert (other_group["pending"], other_group["last-delivered-id"], other_group["consumers"]) == (
        0,
        b"0-0",
        0,
    )
    assert store.order("for-gpu-1") is None

    ttlb = bulk_view.seconds
    print(
        f"\nmeasured TTLB: bulk {bulk_view.bytes} bytes in {ttlb:.4f} s "
        f"({bulk_view.bytes / ttlb / 1e9:.2f} GB/s); "
        f"hold {view.bytes} bytes in {view.seconds:.4f} s"
    )
    r.close()
    store.close()


# -- the pull queue ---------------------------------------------------------------------------

LEASE_SECONDS = 4.0
PULL_SESSIONS = {f"pull-s{k}": list(range(100 * k, 100 * k + 8)) for k in range(1, 4)}
TURN_GAP_SECONDS = 10.0


def regular_sessions(now: float) -> list[dict[str, Any]]:
    """PULL_SESSIONS, each back every TURN_GAP_SECONDS, the last turn just finished."""
    return streams.regular_sessions(
        PULL_SESSIONS, now, instance_id=INSTANCE, turn_gap_seconds=TURN_GAP_SECONDS
    )


def test_pulled_orders_of_an_agent_killed_9_go_to_another_after_the_lease_and_complete_once(
    service_factory: Callable[..., ServiceProcess], tmp_path: Path, agents: list[AgentProcess]
) -> None:
    # The heuristic predictor (no model in KVP_MODEL_DIR) gives a regular session its fixed chance.
    svc = service_factory(
        env={
            "KVP_MODEL_DIR": str(tmp_path / "no-model"),
            "KVP_ORDER_LEASE_SECONDS": str(LEASE_SECONDS),
            "KVP_SCORE_INTERVAL_SECONDS": "0.5",
        }
    )
    svc.start()
    pool = PoolDir(tmp_path / "pool")
    for blocks in PULL_SESSIONS.values():
        for h in blocks:
            pool.write(h, os.urandom(64 * 1024))
    for name in ("agent-a", "agent-b"):
        agents.append(pull_agent(name, tmp_path, svc.url, pool.directory))
        agents[-1].start()
    for a in agents:
        wait_ready(a)

    posted_at = time.time()
    r = httpx.post(f"{svc.url}/v1/events", json={"events": regular_sessions(posted_at)}, timeout=10)
    assert r.status_code == 200, r.text

    # The first agent to pull leases every order (they are planned in one tick).
    def holder() -> AgentProcess | None:
        holding = [a for a in agents if a.status()["pending_orders"]]
        return (
            holding[0]
            if len(holding) == 1 and len(holding[0].status()["pending_orders"]) == 3
            else None
        )

    victim = wait_for(holder, "an agent to lease the three orders", *agents)
    held = victim.status()["pending_orders"]
    victim.kill()
    survivor = next(a for a in agents if a is not victim)
    assert survivor.status()["pending_orders"] == []
    progress = [e for _, e in iter_log(svc.events_dir) if e.type == "order_progress"]
    assert progress == []  # the victim had not started them: their start_by was ahead

    def completed() -> bool:
        done = {
            e.order_id
            for _, e in iter_log(svc.events_dir)
            if e.type == "order_progress" and e.status == "completed"
        }
        return set(held) <= done

    wait_for(completed, "the survivor to complete the orders", survivor)
    progress = [
        e for _, e in iter_log(svc.events_dir) if e.type == "order_progress" and e.order_id in held
    ]
    counts = Counter((e.order_id, e.status) for e in progress)
    assert counts == Counter({(o, s): 1 for o in held for s in ("accepted", "completed")}), counts
    # Handed out again only once the lease had run out: the victim's lease began after the post.
    accepted_at = min(e.ts for e in progress if e.status == "accepted")
    assert accepted_at >= posted_at + LEASE_SECONDS
    # Once a context has landed, the scheduler pins it (the planner's keep advice, once per idle
    # spell): a new order, its own id, planned at the next tick, so how many pins the survivor
    # has run by now depends on the machine's speed. Each is a pin of one of the three contexts.
    pins = {
        order_id_for("pin", INSTANCE, "hbm", b, 0).rsplit("-", 1)[0]: sid
        for sid, b in PULL_SESSIONS.items()
    }

    def completed_ids() -> set[str]:
        return {
            e.order_id
            for _, e in iter_log(svc.events_dir)
            if e.type == "order_progress" and e.status == "completed"
        }

    # Each id run once by the survivor: its own count of completions equals the ids completed in
    # the log (a second run of an id counts in the agent, not in the log: same event id, deduped).
    # The status lags the log by the service's answer, so read it between two equal reads.
    def settled() -> tuple[dict[str, Any], set[str]] | None:
        before, status, after = completed_ids(), survivor.status(), completed_ids()
        return (status, after) if before == after and status["completed"] == len(after) else None

    status, done = wait_for(
        settled, "the survivor's count of completions to match the log", survivor
    )
    assert status["failed"] == 0
    pinned = Counter(pins.get(o.rsplit("-", 1)[0]) for o in done - set(held))
    assert None not in pinned and all(n == 1 for n in pinned.values()), (done, held)
    assert sorted(status["buffer_blocks"]) == sorted(h for b in PULL_SESSIONS.values() for h in b)
    scheduler = httpx.get(f"{svc.url}/v1/scheduler", timeout=5).json()
    assert scheduler["orders"]["prefetch"] == 3 and scheduler["completed"] >= 3
    assert scheduler["orders"]["pin"] >= len(pinned)

    print(
        f"\npull queue: {len(held)} orders leased by {victim.name}, killed before their start; "
        f"{survivor.name} accepted them {accepted_at - posted_at:.2f} s "
        "after the events were posted "
        f"(lease {LEASE_SECONDS:.0f} s), each completed once; {len(pinned)} pins of them run"
    )
