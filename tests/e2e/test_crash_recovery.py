"""Crash recovery of the real service process.

kill -9 the server while two routers stream events to it through the real client
(client/kvprefetch_client/client),
keep it down while they go on sending and retrying, restart it: every event the clients sent is
acknowledged once, and the log and the state hold each exactly once. And a torn last line of the
log (a write cut short by the crash) is cut on restart, while the complete lines before it are
served.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import orjson
import pytest

from app.ingest.eventlog import list_segments
from kvprefetch_client.client import Answer, KvpClient
from tests.e2e.streams import (
    CLIENT_BATCH,
    Router,
    check_each_event_once,
    drain,
    ids_of,
    log_ids_from_files,
    log_ids_from_iter_log,
    post,
    readyz_stats,
    session_views,
    start_routers,
    wait_until,
)

if TYPE_CHECKING:
    from tests.e2e.conftest import ServiceProcess

pytestmark = pytest.mark.slow

CLIENTS = 2
# Far more than the service takes: each client's queue stays at the bound, so it always has a
# full batch to post, and the service is busy when the kill lands. The bound keeps any event from
# being dropped; it is raised at the kill so the routers go on sending while the service is down.
ROUTER_RATE = 100_000  # events per second, per router
HIGH_WATER = 10_000
OUTAGE_ALLOWANCE = 10_000
OUTAGE_SECONDS = 1.0
STREAM_AFTER_RESTART_SECONDS = 0.5


# -- kill -9 mid-stream -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seed", "kill_after", "env"),
    [
        (1, 0.4, {}),
        # Small segments: the log rotates every batch or so, and the kill may land on a rotation.
        (3, 0.9, {"KVP_LOG_SEGMENT_BYTES": "100000"}),
    ],
    ids=["kill-at-0.4s", "kill-at-0.9s-small-segments"],
)
def test_kill_9_under_the_clients_stream_loses_nothing_acknowledged_and_applies_nothing_twice(
    service_factory: Callable[..., ServiceProcess],
    routers: list[Router],
    seed: int,
    kill_after: float,
    env: dict[str, str],
) -> None:
    svc = service_factory(env=env)
    svc.start()
    routers += [
        Router(f"c{n}", seed, svc.url, rate=ROUTER_RATE, high_water=HIGH_WATER)
        for n in range(CLIENTS)
    ]
    start_routers(routers)
    wait_until(lambda: all(r.answers for r in routers), "the first acknowledgements")
    time.sleep(kill_after + random.Random(seed).uniform(0.0, 0.05))
    svc.kill()
    sent_at_kill = sum(len(r.sent) for r in routers)
    retries_at_kill = [r.client.stats.retries for r in routers]
    for r in routers:
        r.high_water += OUTAGE_ALLOWANCE
    # Once each client has failed an attempt, every answer sent before the kill was read.
    wait_until(
        lambda: all(r.client.stats.retries > n for r, n in zip(routers, retries_at_kill)),
        "the clients to notice the kill",
    )
    acked_at_kill = set().union(*(r.acknowledged() for r in routers))

    # The log on disk while the service is down: every acknowledged id once; besides them
    # at most the batch each client had in flight (a torn last line is skipped).
    before = log_ids_from_iter_log(svc.events_dir)
    assert len(before) == len(set(before)), "an event id is in the log twice"
    assert acked_at_kill <= set(before), (
        f"{len(acked_at_kill - set(before))} acknowledged events are not in the log"
    )
    logged_unacked = set(before) - acked_at_kill
    assert len(logged_unacked) <= CLIENTS * CLIENT_BATCH

    # The routers go on sending and the clients retrying while nothing answers.
    time.sleep(OUTAGE_SECONDS)
    assert all(r.thread.is_alive() for r in routers), [r.error for r in routers]
    retries_down = sum(r.client.stats.retries for r in routers) - sum(retries_at_kill)
    sent_down = sum(len(r.sent) for r in routers) - sent_at_kill
    assert retries_down >= CLIENTS and sent_down > 0
    assert set(log_ids_from_iter_log(svc.events_dir)) == set(before)

    acks_before_restart = [len(r.answers) for r in routers]
    restarted = time.monotonic()
    svc.start()
    started_in = time.monotonic() - restarted
    wait_until(
        lambda: all(len(r.answers) > n for r, n in zip(routers, acks_before_restart)),
        "the clients' first acknowledgement after the restart",
    )
    first_ack = time.monotonic() - restarted
    time.sleep(STREAM_AFTER_RESTART_SECONDS)  # streaming on, across the restart
    stats = drain(routers)
    drained = time.monotonic() - restarted

    views = check_each_event_once(routers, stats, svc.url, svc.events_dir)
    # The duplicates are the in-flight events that had reached the log before the kill, and,
    # on a busy machine, those of a later attempt the service took but did not answer within the
    # client's timeout: never an event whose every attempt was answered.
    duplicates = set().union(*(r.duplicates() for r in routers))
    unanswered = set().union(*(r.unanswered() for r in routers))
    assert logged_unacked <= duplicates
    assert duplicates - logged_unacked <= unanswered, sorted(duplicates - logged_unacked)[:10]
    state = readyz_stats(svc.url)

    # A resend of acknowledged events is all duplicates and logs nothing.
    sent = [e for r in routers for e in r.sent]
    again: list[Answer] = []
    with KvpClient(svc.url, batch_size=CLIENT_BATCH, on_answer=again.append) as client:
        for e in sent[:CLIENT_BATCH] + [e for e in sent if e["event_id"] in duplicates]:
            client.send(e)
        assert client.flush(timeout=30)
    assert again and not [i for a in again for i in (*a.accepted, *a.rejected)]
    assert len(log_ids_from_files(svc.events_dir)) == len(sent)

    # And a second crash replays the whole log to the very same state.
    svc.restart()
    assert session_views(svc.url, list(views)) == views
    assert readyz_stats(svc.url) == state

    print(
        f"\nkill -9, seed {seed}: {len(sent)} events sent by {CLIENTS} clients, all acknowledged "
        f"once; {len(acked_at_kill)} acknowledged before the kill, {len(logged_unacked)} logged "
        f"but unanswered (acknowledged as duplicates on retry), "
        f"{len(duplicates - logged_unacked)} more duplicates of attempts unanswered after the "
        f"kill; while down ({OUTAGE_SECONDS:.1f} s "
        f"+ {started_in:.2f} s to restart) {sent_down} events sent, {retries_down} failed attempts "
        f"by {CLIENTS} clients (before the restart began); {sum(s.retries for s in stats)} retries "
        f"in all; first acknowledgement {first_ack:.2f} s after the restart began, drained "
        f"{drained:.2f} s after it"
    )


# -- a torn last line ---------------------------------------------------------------------------


def routed(event_id: str, session: str, ts: float) -> dict[str, Any]:
    return {
        "type": "request_routed",
        "event_id": event_id,
        "ts": ts,
        "session_id": session,
        "request_id": f"req-{event_id}",
        "instance_id": "i0",
        "prompt_tokens": 100,
    }


@pytest.mark.parametrize("tear", ["half-a-line", "whole-json-without-newline"])
def test_torn_last_line_is_cut_on_restart_and_complete_lines_are_served(
    service: ServiceProcess, tear: str
) -> None:
    complete = [routed(f"ok-{n}", f"torn-s{n % 5}", 1_000.0 + n) for n in range(40)]
    with httpx.Client(base_url=service.url, timeout=10.0) as client:
        for batch in (complete[:25], complete[25:]):
            r = post(client, batch)
            assert r.status_code == 200, r.text
            assert r.json()["accepted"] == ids_of(batch)
    service.kill()

    segments = list_segments(service.events_dir)
    newest = segments[-1][1]
    whole = newest.read_bytes()
    assert whole.endswith(b"\n")
    # The batch that was being written when the process died; never acknowledged.
    lost = [routed("torn-0", "torn-s0", 2_000.0), routed("torn-1", "torn-victim", 2_001.0)]
    line = orjson.dumps(lost[0]) + b"\n" + orjson.dumps(lost[1])
    partial = line if tear == "whole-json-without-newline" else line[: len(line) - 40]
    with open(newest, "ab") as f:
        f.write(partial)

    # The reader skips the partial line (the first line of that batch is whole, so it counts).
    assert log_ids_from_iter_log(service.events_dir) == ids_of(complete) + ["torn-0"]

    service.start()

    # The partial line is gone, the whole lines before it stay.
    assert newest.read_bytes() == whole + orjson.dumps(lost[0]) + b"\n"
    assert log_ids_from_files(service.events_dir) == ids_of(complete) + ["torn-0"]
    views = session_views(service.url, [f"torn-s{n}" for n in range(5)] + ["torn-victim"])
    assert views["torn-victim"] is None
    assert {sid: v["turns"] for sid, v in views.items() if v} == {
        "torn-s0": 9,
        "torn-s1": 8,
        "torn-s2": 8,
        "torn-s3": 8,
        "torn-s4": 8,
    }

    # The client retries the unacknowledged batch: the whole line is a duplicate, the torn one
    # is new.
    with httpx.Client(base_url=service.url, timeout=10.0) as client:
        r = post(client, lost)
        assert r.status_code == 200, r.text
        assert r.json() == {"accepted": ["torn-1"], "duplicates": ["torn-0"], "rejected": []}
        r = post(client, complete[:25])
        assert r.json() == {"accepted": [], "duplicates": ids_of(complete[:25]), "rejected": []}

    # The new line starts on a line of its own: a second crash replays a clean log.
    expected = ids_of(complete) + ["torn-0", "torn-1"]
    assert log_ids_from_files(service.events_dir) == expected
    service.restart()
    assert log_ids_from_iter_log(service.events_dir) == expected
    views = session_views(service.url, ["torn-s0", "torn-victim"])
    assert views["torn-s0"] is not None and views["torn-s0"]["turns"] == 9
    assert views["torn-victim"] is not None and views["torn-victim"]["turns"] == 1
    assert readyz_stats(service.url)["remembered_event_ids"] == len(expected)
