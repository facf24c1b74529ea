"""A Redis outage under load: the service (KVP_STORE=redis, a real process) keeps a redis-server of
the test's own; two routers stream events to it through the real client; Redis is stopped for a
few seconds and started again on the same port and data dir.

While Redis is away the service refuses every batch with a 503 that names the store and carries
Retry-After (never a 500), stays alive (/healthz) and says it is not ready (/readyz); nothing is
acknowledged and nothing more is logged, and its background loops say so once rather than
failing with a traceback a tick. Once Redis is back the service acknowledges again, the clients
drain, and every event sent is acknowledged once and is in the log and in Redis exactly once.
Redis is stopped with SIGTERM (it flushes its append-only file) or SIGKILL (nothing lost either:
it fsyncs each write before answering it).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.e2e.streams import (
    CLIENT_BATCH,
    Router,
    StatusCounter,
    check_each_event_once,
    drain,
    log_ids_from_iter_log,
    post,
    readyz_stats,
    start_routers,
    wait_until,
)

if TYPE_CHECKING:
    from tests.e2e.conftest import RedisServer, ServiceProcess

pytestmark = pytest.mark.slow

CLIENTS = 2
# As in test_crash_recovery: more than the service takes, so each client always has a full batch
# to post, bounded so that nothing is dropped, with room added when Redis stops.
ROUTER_RATE = 100_000
HIGH_WATER = 10_000
OUTAGE_ALLOWANCE = 10_000
STREAM_BEFORE_SECONDS = 1.0
OUTAGE_SECONDS = 3.0
STREAM_AFTER_SECONDS = 0.5


def probe_event(n: int) -> dict[str, object]:
    return {
        "type": "request_routed",
        "event_id": f"probe-{n}",
        "ts": 1_700_000_000.0,
        "session_id": "probe",
        "request_id": f"probe-{n}",
        "instance_id": "i0",
        "prompt_tokens": 1,
    }


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_a_redis_outage_is_refused_with_503_then_caught_up_losing_and_doubling_nothing(
    service_factory: Callable[..., ServiceProcess],
    private_redis: RedisServer,
    routers: list[Router],
    stop: str,
) -> None:
    svc = service_factory(
        env={
            "KVP_STORE": "redis",
            "KVP_REDIS_URL": private_redis.url,
            "KVP_REDIS_PREFIX": "kvp-outage",
        }
    )
    svc.start()
    counters = [StatusCounter() for _ in range(CLIENTS)]
    routers += [
        Router(f"c{n}", 7, svc.url, rate=ROUTER_RATE, high_water=HIGH_WATER, transport=c)
        for n, c in enumerate(counters)
    ]
    start_routers(routers)
    with httpx.Client(base_url=svc.url, timeout=10.0) as http:
        wait_until(lambda: all(r.answers for r in routers), "the first acknowledgements")
        time.sleep(STREAM_BEFORE_SECONDS)

        if stop == "sigterm":
            private_redis.stop()
        else:
            private_redis.kill()
        sent_at_stop = sum(len(r.sent) for r in routers)
        for r in routers:
            r.high_water += OUTAGE_ALLOWANCE
        refused_in = wait_until(
            lambda: all(c.counts[503] for c in counters), "a 503 to each client"
        )
        # Answers read before each client's first 503 came before the outage.
        acked_at_stop = set().union(*(r.acknowledged() for r in routers))
        answers_at_stop = [len(r.answers) for r in routers]
        logged_at_stop = log_ids_from_iter_log(svc.events_dir)

        # The service says why, and how soon to come back; it is alive, and not ready.
        refusal = post(http, [probe_event(0)])
        assert refusal.status_code == 503, refusal.text
        assert refusal.json()["field"] == "store", refusal.text
        assert refusal.json()["detail"].startswith(
            "the state store is unavailable: Redis is unavailable"
        )
        assert refusal.headers["retry-after"] == "1"
        assert http.get("/healthz").status_code == 200
        ready = http.get("/readyz")
        assert ready.status_code == 503 and ready.json()["status"] == "unavailable", ready.text
        assert ready.json()["store_ok"] is False

        time.sleep(OUTAGE_SECONDS)  # the routers stream on, the clients retry
        assert svc.running, svc.log_tail()
        assert [len(r.answers) for r in routers] == answers_at_stop, (
            "acknowledged while Redis was down"
        )
        assert log_ids_from_iter_log(svc.events_dir) == logged_at_stop, (
            "logged while Redis was down"
        )
        refused = sum(c.counts[503] for c in counters)
        sent_down = sum(len(r.sent) for r in routers) - sent_at_stop
        assert sent_down > 0 and refused >= 2 * CLIENTS

        restarted = time.monotonic()
        private_redis.start()
        redis_up = time.monotonic() - restarted
        wait_until(
            lambda: all(len(r.answers) > n for r, n in zip(routers, answers_at_stop)),
            "the clients' first acknowledgement with Redis back",
        )
        first_ack = time.monotonic() - restarted
        assert http.get("/readyz").status_code == 200
        accepted = post(http, [probe_event(1)])
        assert accepted.status_code == 200 and accepted.json()["accepted"] == ["probe-1"], (
            accepted.text
        )
        time.sleep(STREAM_AFTER_SECONDS)
    stats = drain(routers)
    drained = time.monotonic() - restarted

    # The probe is an event too: counted aside.
    check_each_event_once(
        routers, stats, svc.url, svc.events_dir, extra_ids={"probe-1"}, extra_sessions=1
    )
    # Only the batch in flight when Redis went away can have been logged unacknowledged: its
    # retry found it applied (the log replayed into Redis first) and answered it duplicate.
    duplicates = set().union(*(r.duplicates() for r in routers))
    assert len(duplicates) <= CLIENT_BATCH
    assert duplicates <= set(logged_at_stop) - acked_at_stop
    statuses: Counter[int | str] = sum((c.counts for c in counters), start=Counter())
    assert set(statuses) <= {200, 503}, f"answers other than 200 and 503: {statuses}"
    assert sum(c.missing_retry_after for c in counters) == 0, "a 503 without Retry-After"
    # The background loops rode it out: planning said at most once that it paused (a tick with
    # nothing to plan reads nothing of the store, so whether one failed depends on the timing),
    # and as often that it plans again, with the store back.
    assert svc.running
    server_log = svc.log_text()
    assert "Traceback" not in server_log, svc.log_tail()
    paused = server_log.count("planning paused: Redis is unavailable")
    assert paused <= 1, svc.log_tail()
    assert server_log.count("planning again: the store answers") == paused, svc.log_tail()
    state = readyz_stats(svc.url)

    sent = sum(len(r.sent) for r in routers)
    print(
        f"\nRedis {stop} for {OUTAGE_SECONDS:.0f} s under {CLIENTS} clients: {sent} events sent, "
        f"all acknowledged once ({len(acked_at_stop)} before the stop, {len(duplicates)} as "
        f"duplicates of a batch logged as Redis went); first 503 to every client "
        f"{refused_in:.2f} s after the stop; {statuses[503]} answers 503 in all "
        f"({refused} during the outage), {statuses[200]} answers 200; {sent_down} events sent "
        f"while Redis was down; {sum(s.retries for s in stats)} retries; Redis answered again "
        f"{redis_up:.2f} s after its start, the first acknowledgement came {first_ack:.2f} s after "
        f"its start, the clients drained {drained:.2f} s after it; Redis holds "
        f"{state['remembered_event_ids']} event ids, {state['sessions']} sessions"
    )
