"""Crash recovery of the real service process.

kill -9 the server in the middle of a stream of posts, restart it, and the state and the log hold
every acknowledged event exactly once. And a torn last line of the log (a write cut short by the
crash) is cut on restart, while the complete lines before it are served.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import orjson
import pytest

from app.engine.eventlog import iter_log, list_segments

if TYPE_CHECKING:
    from tests.e2e.conftest import ServiceProcess

pytestmark = pytest.mark.slow

JSON = {"content-type": "application/json"}
BATCH_EVENTS = 200
SESSIONS = 300
CLIENTS = 2
STREAM_LIMIT_SECONDS = 20.0  # a safety net: the kill always lands long before


# -- the client side ---------------------------------------------------------------------------


class EventSource:
    """A router's stream: request_routed events over a few hundred sessions, then their finishes."""

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self.rng = random.Random(f"{seed}-{name}")
        self.batches = 0
        self.requests = 0
        self.ts = 1_700_000_000.0
        self.unfinished: list[tuple[str, str, str]] = []  # (session, request, instance)

    def next_batch(self) -> list[dict[str, Any]]:
        self.batches += 1
        events = []
        for i in range(BATCH_EVENTS):
            self.ts += 0.001
            event_id = f"{self.name}-b{self.batches}-e{i}"
            if self.unfinished and self.rng.random() < 0.25:
                session, request, instance = self.unfinished.pop(self.rng.randrange(len(self.unfinished)))
                events.append({"type": "request_finished", "event_id": event_id, "ts": self.ts,
                               "session_id": session, "request_id": request, "instance_id": instance,
                               "output_tokens": self.rng.randrange(1, 500)})
            else:
                self.requests += 1
                session = f"s{self.rng.randrange(SESSIONS)}"
                request = f"{self.name}-r{self.requests}"
                instance = f"i{self.rng.randrange(8)}"
                self.unfinished.append((session, request, instance))
                events.append({"type": "request_routed", "event_id": event_id, "ts": self.ts,
                               "session_id": session, "request_id": request, "instance_id": instance,
                               "prompt_tokens": self.rng.randrange(100, 4000)})
        return events


def post(client: httpx.Client, events: list[dict[str, Any]]) -> httpx.Response:
    return client.post("/v1/events", content=orjson.dumps({"events": events}), headers=JSON)


def ids_of(events: list[dict[str, Any]]) -> list[str]:
    return [e["event_id"] for e in events]


@dataclass
class Stream:
    """What one client thread sent and what the server acknowledged."""

    source: EventSource
    acked_batches: list[list[dict[str, Any]]] = field(default_factory=list)
    in_flight: list[dict[str, Any]] | None = None
    failure: BaseException | None = None
    error: str | None = None

    @property
    def acked_ids(self) -> set[str]:
        return {i for batch in self.acked_batches for i in ids_of(batch)}

    def run(self, url: str, started: threading.Event) -> None:
        try:
            self._run(url, started)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            self.error = f"client {self.source.name} raised {exc!r}"

    def _run(self, url: str, started: threading.Event) -> None:
        deadline = time.monotonic() + STREAM_LIMIT_SECONDS
        with httpx.Client(base_url=url, timeout=10.0) as client:
            while time.monotonic() < deadline:
                batch = self.source.next_batch()
                self.in_flight = batch
                started.set()
                try:
                    r = post(client, batch)
                except httpx.TransportError as exc:
                    self.failure = exc  # the kill landed: this batch is not acknowledged
                    return
                if r.status_code != 200:
                    self.error = f"POST answered {r.status_code}: {r.text[:300]}"
                    return
                body = r.json()
                # Every id is fresh: all of them must come back accepted, in order.
                if body["accepted"] != ids_of(batch) or body["duplicates"] or body["rejected"]:
                    self.error = f"unexpected answer to a fresh batch: {str(body)[:300]}"
                    return
                self.acked_batches.append(batch)
                self.in_flight = None
        self.error = f"the server was not killed within {STREAM_LIMIT_SECONDS} s"


# -- reading the log and the state ---------------------------------------------------------------


def log_ids_from_files(events_dir: Path) -> list[str]:
    """Every event id in the JSONL segments, read as plain files."""
    ids = []
    segments = list_segments(events_dir)
    assert segments, f"no log segment in {events_dir}"
    for _, path in segments:
        data = path.read_bytes()
        assert not data or data.endswith(b"\n"), f"{path.name} ends in a partial line"
        for line in data.splitlines():
            doc = orjson.loads(line)  # one event, or a whole batch as it was posted
            if "events" in doc:
                ids.extend(e["event_id"] for e in doc["events"])
            else:
                ids.append(doc["event_id"])
    return ids


def log_ids_from_iter_log(events_dir: Path) -> list[str]:
    return [event.event_id for _, event in iter_log(events_dir)]


def expected_turns(events: list[dict[str, Any]]) -> dict[str, int]:
    """Per session named by these events: how many distinct request_routed events it got."""
    routed: dict[str, set[str]] = {}
    for e in events:
        ids = routed.setdefault(e["session_id"], set())
        if e["type"] == "request_routed":
            ids.add(e["event_id"])
    return {s: len(ids) for s, ids in routed.items()}


def session_views(url: str, session_ids: list[str]) -> dict[str, dict[str, Any] | None]:
    out: dict[str, dict[str, Any] | None] = {}
    with httpx.Client(base_url=url, timeout=10.0) as client:
        for sid in session_ids:
            r = client.get(f"/v1/sessions/{sid}")
            assert r.status_code in (200, 404), r.text
            out[sid] = r.json() if r.status_code == 200 else None
    return out


def readyz_stats(url: str) -> dict[str, int]:
    r = httpx.get(f"{url}/readyz", timeout=10.0)
    assert r.status_code == 200, r.text
    return r.json()["stats"]


# -- kill -9 mid-stream -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seed", "kill_after", "env"),
    [
        (1, 0.30, {}),
        (2, 0.60, {}),
        # Small segments: the log rotates every batch or so, and the kill may land on a rotation.
        (3, 0.95, {"KVP_LOG_SEGMENT_BYTES": "100000"}),
    ],
    ids=["kill-at-0.3s", "kill-at-0.6s", "kill-at-0.95s-small-segments"],
)
def test_kill_9_mid_stream_loses_nothing_acknowledged_and_applies_nothing_twice(
    service_factory: Callable[..., ServiceProcess], seed: int, kill_after: float, env: dict[str, str]
) -> None:
    svc = service_factory(env=env)
    svc.start()
    streams = [Stream(EventSource(f"c{n}", seed)) for n in range(CLIENTS)]
    started = threading.Event()
    threads = [threading.Thread(target=s.run, args=(svc.url, started), daemon=True) for s in streams]
    for t in threads:
        t.start()
    try:
        assert started.wait(10), "the clients never started posting"
        time.sleep(kill_after + random.Random(seed).uniform(0.0, 0.05))
        svc.kill()
    finally:
        svc.kill()
        for t in threads:
            t.join(STREAM_LIMIT_SECONDS + 15)
    for s in streams:
        assert s.error is None, s.error
        assert s.failure is not None and s.in_flight is not None, "the kill did not land mid-stream"
        assert s.acked_batches, f"client {s.source.name} had no batch acknowledged before the kill"

    acked = set().union(*(s.acked_ids for s in streams))
    in_flight_ids = {i for s in streams for i in ids_of(s.in_flight or [])}
    assert not acked & in_flight_ids

    # The log on disk, before the restart: every acknowledged id is in it, none twice. Of the
    # in-flight batches, any prefix of whole lines may be there; a torn last line is skipped.
    before = log_ids_from_iter_log(svc.events_dir)
    assert len(before) == len(set(before)), "an event id is in the log twice"
    assert acked <= set(before), f"{len(acked - set(before))} acknowledged events are not in the log"
    assert set(before) <= acked | in_flight_ids

    svc.start()

    # The client's retry of the batch that was in flight: every id comes back accepted or duplicate.
    retried_duplicates = 0
    with httpx.Client(base_url=svc.url, timeout=10.0) as client:
        for s in streams:
            assert s.in_flight is not None
            r = post(client, s.in_flight)
            assert r.status_code == 200, r.text
            body = r.json()
            assert not body["rejected"]
            assert sorted(body["accepted"] + body["duplicates"]) == sorted(ids_of(s.in_flight))
            assert set(body["duplicates"]) == set(ids_of(s.in_flight)) & set(before), (
                "the retry's duplicates are not exactly the in-flight events that reached the log")
            retried_duplicates += len(body["duplicates"])

    everything = [e for s in streams for batch in s.acked_batches for e in batch]
    everything += [e for s in streams for e in (s.in_flight or [])]
    final_ids = {e["event_id"] for e in everything}
    assert len(final_ids) == len(everything)

    # (a) + (b): every acknowledged (and retried) id is in the log exactly once, and nothing else.
    for ids in (log_ids_from_files(svc.events_dir), log_ids_from_iter_log(svc.events_dir)):
        counts = Counter(ids)
        twice = [i for i, n in counts.items() if n > 1]
        assert not twice, f"{len(twice)} event ids are in the log more than once, e.g. {twice[:5]}"
        assert set(ids) == final_ids, (
            f"missing from the log: {len(final_ids - set(ids))}, unexpected: {len(set(ids) - final_ids)}")

    # (c): the state after the restart holds every event exactly once.
    turns = expected_turns(everything)
    session_ids = [f"s{n}" for n in range(SESSIONS)]
    views = session_views(svc.url, session_ids)
    got = {sid: (view["turns"] if view else None) for sid, view in views.items()}
    wrong = {sid: (got[sid], turns.get(sid)) for sid in session_ids if got[sid] != turns.get(sid)}
    assert not wrong, f"sessions whose turns are wrong (got, expected): {dict(list(wrong.items())[:10])}"
    stats = readyz_stats(svc.url)
    assert stats["remembered_event_ids"] == len(final_ids)
    assert stats["sessions"] == len(turns)

    # (d): resending acknowledged batches answers 200, every id a duplicate, and logs nothing.
    with httpx.Client(base_url=svc.url, timeout=10.0) as client:
        for batch in [streams[0].acked_batches[0], streams[-1].acked_batches[-1], streams[0].in_flight]:
            assert batch is not None
            r = post(client, batch)
            assert r.status_code == 200, r.text
            assert r.json() == {"accepted": [], "duplicates": ids_of(batch), "rejected": []}
    assert len(log_ids_from_files(svc.events_dir)) == len(final_ids)

    # And a second crash replays the whole log, retry included, to the very same state.
    svc.restart()
    assert session_views(svc.url, session_ids) == views
    assert readyz_stats(svc.url) == stats

    print(f"seed {seed}: {len(acked)} events acknowledged before the kill, "
          f"{len(in_flight_ids)} in flight ({retried_duplicates} of them had reached the log)")


# -- a torn last line ---------------------------------------------------------------------------


def routed(event_id: str, session: str, ts: float) -> dict[str, Any]:
    return {"type": "request_routed", "event_id": event_id, "ts": ts, "session_id": session,
            "request_id": f"req-{event_id}", "instance_id": "i0", "prompt_tokens": 100}


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
        "torn-s0": 9, "torn-s1": 8, "torn-s2": 8, "torn-s3": 8, "torn-s4": 8}

    # The client retries the unacknowledged batch: the whole line is a duplicate, the torn one is new.
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
