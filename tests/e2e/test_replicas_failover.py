"""Three replicas of the real service on one Redis, one planning under the lease (decisions.md,
23): routers stream through the real client to all three, the planning replica is killed with
SIGKILL mid-stream, and another takes over. Every acknowledged event is applied once, no order
is issued twice fleet-wide, and planning resumes within the bound of decision 23. And a planner
SIGSTOPped past its lease, then resumed, steps down.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import redis

from app.decide.lease import lease_key
from app.decide.scheduler import TERM_GENERATIONS
from kvprefetch_client.orders import Cancel, Order, from_json
from tests.e2e import streams
from tests.e2e.streams import (
    SESSIONS,
    EventSource,
    Router,
    drain,
    expected_turns,
    ids_of,
    log_ids_from_iter_log,
    readyz_stats,
    session_views,
    start_routers,
    wait_until,
)

if TYPE_CHECKING:
    from tests.e2e.conftest import ServiceProcess

pytestmark = pytest.mark.slow

LEASE_SECONDS = 1.5
SCORE_SECONDS = 0.5
PLAN_SECONDS = 0.1
# Decision 23's bound: the lease runs out at most LEASE_SECONDS after the holder's last renewal,
# a survivor tries every third of it; then one scoring tick to learn the sessions it did not
# ingest itself, and one planning tick.
FAILOVER_BOUND_SECONDS = LEASE_SECONDS * 4 / 3 + SCORE_SECONDS + PLAN_SECONDS
ROUTER_RATE = 1000  # events a second each: their stamps (1 ms apart) keep up with the clock
HIGH_WATER = 5000
INSTANCE = "gpu-0"
TURN_GAP_SECONDS = 10.0


class StickySource(EventSource):
    """The routers' stream with each session on one instance: with the stock stream's random
    instance per turn, the route tracker learns that returns land anywhere and nothing is worth
    prefetching, the waves' sessions included."""

    def next_batch(self) -> list[dict[str, Any]]:
        batch = super().next_batch()
        for e in batch:
            e["instance_id"] = f"i{int(e['session_id'][1:]) % 8}"
        return batch


def order_sessions(tag: str, now: float, first_block: int) -> list[dict[str, Any]]:
    """Three sessions on INSTANCE the planner orders prefetched (tests/e2e/streams.py
    regular_sessions, as tests/e2e/test_agent_e2e.py uses)."""
    sessions = {
        f"{tag}-s{k}": list(range(first_block + 100 * k, first_block + 100 * k + 8))
        for k in range(3)
    }
    return streams.regular_sessions(
        sessions,
        now,
        instance_id=INSTANCE,
        turn_gap_seconds=TURN_GAP_SECONDS,
        room_event_id=f"{tag}-room",
    )


def stream_entries(r: redis.Redis, prefix: str) -> list[tuple[float, Order | Cancel]]:
    """Every message in every instance's orders stream: (Redis's time of the XADD, message)."""
    out = []
    for key in r.scan_iter(match=f"{prefix}:sink:orders:*"):
        for entry_id, fields in r.xrange(key):
            ms = int(entry_id.decode().split("-")[0])
            out.append((ms / 1000, from_json(fields[b"msg"])))
    return sorted(out, key=lambda x: x[0])


def term_of(order_id: str) -> int:
    return int(order_id.rsplit("-", 1)[1]) // TERM_GENERATIONS


def test_the_planner_killed_9_is_taken_over_once_and_in_bound(
    service_factory: Callable[..., ServiceProcess],
    redis_url: str,
    clean_redis: str,
    tmp_path: Path,
) -> None:
    prefix = clean_redis
    r = redis.Redis.from_url(redis_url)
    replicas = []
    for n in range(3):
        svc = service_factory(
            env={
                "KVP_STORE": "redis",
                "KVP_REDIS_URL": redis_url,
                "KVP_REDIS_PREFIX": prefix,
                "KVP_REPLICA_ID": f"r{n}",
                "KVP_ORDER_SINK": "redis",
                "KVP_PLANNING_LEASE_SECONDS": str(LEASE_SECONDS),
                "KVP_SCORE_INTERVAL_SECONDS": str(SCORE_SECONDS),
                "KVP_PLAN_INTERVAL_SECONDS": str(PLAN_SECONDS),
                "KVP_DASHBOARD_SAMPLE_SECONDS": "0",
                "KVP_LOG_FSYNC": "false",
                "KVP_MODEL_DIR": str(tmp_path / "no-model"),
            }
        )
        svc.start()
        replicas.append(svc)

    def holder() -> str | None:
        value = r.get(lease_key(prefix))
        return value.decode() if value else None

    first = holder()
    assert first is not None and first.startswith("r0|"), first  # the first to start took it
    planner = replicas[0]
    others = replicas[1:]

    routers = [
        Router(f"c{n}", 11, svc.url, rate=ROUTER_RATE, high_water=HIGH_WATER)
        for n, svc in enumerate(replicas)
    ]
    for n, router in enumerate(routers):
        router.source = StickySource(f"c{n}", 11)
        router.source.ts = time.time() - 1.0
    extra: list[dict[str, Any]] = []
    try:
        start_routers(routers)
        # Wave A, posted to a replica that does not plan: the planner orders its contexts.
        wave_a = order_sessions("a", time.time(), 10_000)
        resp = httpx.post(f"{others[0].url}/v1/events", json={"events": wave_a}, timeout=10)
        assert resp.status_code == 200, resp.text
        extra += wave_a
        try:
            wait_until(
                lambda: sum(isinstance(m, Order) for _, m in stream_entries(r, prefix)) >= 3,
                "the planner to order wave A",
            )
        except AssertionError:
            for svc in replicas:
                print(httpx.get(f"{svc.url}/v1/scheduler").text, svc.log_tail(2000))
            raise
        before_kill = stream_entries(r, prefix)
        assert {term_of(m.order_id) for _, m in before_kill if isinstance(m, Order)} == {1}

        planner.kill()
        killed_at = time.time()
        # Wave B, to a survivor: only the next planner can order it.
        wave_b = order_sessions("b", time.time(), 20_000)
        resp = httpx.post(f"{others[1].url}/v1/events", json={"events": wave_b}, timeout=10)
        assert resp.status_code == 200, resp.text
        extra += wave_b

        wait_until(lambda: (holder() or "r0|").split("|")[0] != "r0", "a survivor to take over")
        taken_over = time.time() - killed_at

        def resumed() -> float | None:
            later = [
                ts
                for ts, m in stream_entries(r, prefix)
                if isinstance(m, Order) and term_of(m.order_id) > 1
            ]
            return min(later) if later else None

        wait_until(lambda: resumed() is not None, "the new planner to order wave B")
        resumed_after = resumed() - killed_at  # type: ignore[operator]
        print(
            f"lease taken over {taken_over:.2f} s and the first order of the new term added "
            f"{resumed_after:.2f} s after the SIGKILL (bound {FAILOVER_BOUND_SECONDS:.2f} s)"
        )
        # The bound is printed, not asserted: on a busy machine the processes' scheduling adds
        # to it without limit. The lease's timing is asserted on an injected clock
        # (tests/decide/test_lease.py); here, that a survivor takes over and orders in a new term.

        # The killed replica comes back (its router's unacknowledged events go there again); it
        # does not plan, since the lease is another's.
        planner.start()
        time.sleep(1.0)
        stats = drain(routers, timeout=60)
    finally:
        for router in routers:
            router.stop.set()

    # Every event sent acknowledged, and applied once fleet-wide.
    sent = [e for rt in routers for e in rt.sent]
    told = Counter(
        i for rt in routers for a in rt.answers for i in (*a.accepted, *a.duplicates, *a.rejected)
    )
    assert not [i for i, n in told.items() if n > 1], "an event was answered for twice"
    assert set(told) == set(ids_of(sent))
    assert sum(s.rejected + s.dropped + s.queued for s in stats) == 0, stats
    logged = Counter(i for svc in replicas for i in log_ids_from_iter_log(svc.events_dir))
    assert not [i for i, n in logged.items() if n > 1], "an event is in two replicas' logs"
    assert set(logged) == set(ids_of(sent)) | set(ids_of(extra))
    turns = expected_turns(sent)
    views = session_views(others[0].url, [f"s{n}" for n in range(SESSIONS)])
    wrong = {
        s: v["turns"] if v else None
        for s, v in views.items()
        if (v or {}).get("turns") != turns.get(s)
    }
    assert not wrong, f"sessions whose turns are wrong: {dict(list(wrong.items())[:10])}"
    assert readyz_stats(others[0].url)["remembered_event_ids"] == len(sent) + len(extra)

    # No order issued twice fleet-wide: no id twice in the streams, no context ordered again
    # while an earlier order for it was open (not cancelled), and each term's orders after the
    # term before it (the fencing).
    messages = stream_entries(r, prefix)
    orders = [m for _, m in messages if isinstance(m, Order)]
    assert orders
    ids = Counter(o.order_id for o in orders)
    assert not [i for i, n in ids.items() if n > 1], ids
    open_for: dict[tuple[str, str, tuple[Any, ...]], str] = {}
    for _, m in messages:
        if isinstance(m, Cancel):
            open_for = {k: v for k, v in open_for.items() if v != m.order_id}
            continue
        key = (m.kind, m.instance_id, tuple(m.block_hashes))
        assert key not in open_for, f"{m.order_id} orders what {open_for[key]} still does"
        open_for[key] = m.order_id
    terms = [term_of(o.order_id) for o in orders]
    assert terms == sorted(terms) and terms[-1] >= 2, terms
    # Wave A's orders were taken over, not ordered again; wave B's were ordered by the new term.
    wave_a_blocks = {tuple(range(10_000 + 100 * k, 10_000 + 100 * k + 8)) for k in range(3)}
    assert {tuple(o.block_hashes) for o in orders if term_of(o.order_id) == 1} == wave_a_blocks
    # The hand-over gave the next term every order still open at the kill: wave A's, less those
    # the planner cancelled before it (on a busy machine the test may reach the kill after their
    # sessions' predicted turn has passed). A term after it may lapse too, and the next adopts
    # what is open then: counted where each was adopted, at least those in all.
    cancelled = {m.order_id for ts, m in messages if isinstance(m, Cancel) and ts < killed_at}
    open_at_kill = {o.order_id for o in orders if term_of(o.order_id) == 1} - cancelled
    adopted = [gauge(s, "kvprefetch_planning_adopted_orders_total") or 0.0 for s in others]
    print(
        f"orders adopted by the survivors: {adopted}; open at the kill: {len(open_at_kill)}; "
        f"terms: {sorted(set(terms))}"
    )
    assert sum(adopted) >= len(open_at_kill), (adopted, sorted(open_at_kill))


# Longer than the failover test's: r1 must renew through whatever stalls a busy machine, so that
# the lease stays its own while r0's stepping down is watched.
PAUSE_LEASE_SECONDS = 3.0


def gauge(svc: ServiceProcess, name: str) -> float | None:
    for line in httpx.get(f"{svc.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return None


def test_a_planner_paused_past_its_lease_steps_down_when_it_resumes(
    service_factory: Callable[..., ServiceProcess],
    redis_url: str,
    clean_redis: str,
    tmp_path: Path,
) -> None:
    """The planner is SIGSTOPped until another replica holds the lease, then SIGCONTed: it finds
    its lease lapsed and steps down (its gauge 0, so the fleet's sum is 1), sends nothing of its
    old term after the new one began, and its open orders are the new planner's, taken over
    once."""
    prefix = clean_redis
    r = redis.Redis.from_url(redis_url)
    replicas = []
    for n in range(2):
        svc = service_factory(
            env={
                "KVP_STORE": "redis",
                "KVP_REDIS_URL": redis_url,
                "KVP_REDIS_PREFIX": prefix,
                "KVP_REPLICA_ID": f"r{n}",
                "KVP_ORDER_SINK": "redis",
                "KVP_PLANNING_LEASE_SECONDS": str(PAUSE_LEASE_SECONDS),
                "KVP_SCORE_INTERVAL_SECONDS": str(SCORE_SECONDS),
                "KVP_PLAN_INTERVAL_SECONDS": str(PLAN_SECONDS),
                "KVP_DASHBOARD_SAMPLE_SECONDS": "0",
                "KVP_LOG_FSYNC": "false",
                "KVP_MODEL_DIR": str(tmp_path / "no-model"),
            }
        )
        svc.start()
        replicas.append(svc)
    planner, other = replicas
    leader = "kvprefetch_planning_leader"
    # Deadlines only: generous multiples of the lease, polled for the condition.
    limit = 20 * PAUSE_LEASE_SECONDS

    def holder() -> str:
        value = r.get(lease_key(prefix))
        return value.decode().split("|")[0] if value else ""

    assert holder() == "r0"
    wait_until(lambda: gauge(planner, leader) == 1.0, "r0 to count itself the planner", limit)
    assert gauge(other, leader) == 0.0

    wave_a = order_sessions("a", time.time(), 10_000)
    resp = httpx.post(f"{other.url}/v1/events", json={"events": wave_a}, timeout=10)
    assert resp.status_code == 200, resp.text
    wait_until(
        lambda: sum(isinstance(m, Order) for _, m in stream_entries(r, prefix)) >= 3,
        "the planner to order wave A",
        limit,
    )
    assert planner.proc is not None
    os.kill(planner.proc.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: holder() == "r1", "r1 to take the lapsed lease over", limit)
        taken_at = time.time()
        wave_b = order_sessions("b", time.time(), 20_000)
        resp = httpx.post(f"{other.url}/v1/events", json={"events": wave_b}, timeout=10)
        assert resp.status_code == 200, resp.text
    finally:
        os.kill(planner.proc.pid, signal.SIGCONT)
    resumed = time.monotonic()
    waited = wait_until(lambda: gauge(planner, leader) == 0.0, "r0 to step down", limit)
    print(f"r0 stepped down {waited:.2f} s after SIGCONT (lease {PAUSE_LEASE_SECONDS} s)")
    wait_until(lambda: gauge(other, leader) == 1.0, "r1 to count itself the planner", limit)
    # A few of r0's own ticks later it still does not plan, nor count itself the planner.
    wait_until(
        lambda: time.monotonic() - resumed > PAUSE_LEASE_SECONDS, "a lease past the resume", limit
    )
    assert gauge(planner, leader) == 0.0 and holder() == "r1"
    assert planner.log_text().count("stepping down") == 1, planner.log_tail()

    messages = stream_entries(r, prefix)
    orders = [(ts, m) for ts, m in messages if isinstance(m, Order)]
    late = [m.order_id for ts, m in orders if term_of(m.order_id) == 1 and ts > taken_at]
    assert not late, f"the old term's orders sent after the new one began: {late}"
    terms = [term_of(m.order_id) for _, m in orders]
    assert terms == sorted(terms), terms
    assert gauge(other, "kvprefetch_planning_adopted_orders_total") == 3.0
    assert gauge(planner, "kvprefetch_planning_adopted_orders_total") == 0.0
