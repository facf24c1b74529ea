"""What the crash and outage tests share: routers streaming events through the real client, and
reading back the log and the state to check that every event is there exactly once."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

from app.ingest.eventlog import iter_log, list_segments
from kvprefetch_client.client import Answer, ClientStats, KvpClient

JSON = {"content-type": "application/json"}
BATCH_EVENTS = 200  # what EventSource makes at a time
SESSIONS = 300
CLIENT_BATCH = 500
# Small, so a client finds a service that is back soon (the default is 5 s).
MAX_BACKOFF_SECONDS = 0.25


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
                session, request, instance = self.unfinished.pop(
                    self.rng.randrange(len(self.unfinished))
                )
                events.append(
                    {
                        "type": "request_finished",
                        "event_id": event_id,
                        "ts": self.ts,
                        "session_id": session,
                        "request_id": request,
                        "instance_id": instance,
                        "output_tokens": self.rng.randrange(1, 500),
                    }
                )
            else:
                self.requests += 1
                session = f"s{self.rng.randrange(SESSIONS)}"
                request = f"{self.name}-r{self.requests}"
                instance = f"i{self.rng.randrange(8)}"
                self.unfinished.append((session, request, instance))
                events.append(
                    {
                        "type": "request_routed",
                        "event_id": event_id,
                        "ts": self.ts,
                        "session_id": session,
                        "request_id": request,
                        "instance_id": instance,
                        "prompt_tokens": self.rng.randrange(100, 4000),
                    }
                )
        return events


def post(client: httpx.Client, events: list[dict[str, Any]]) -> httpx.Response:
    return client.post("/v1/events", content=orjson.dumps({"events": events}), headers=JSON)


def ids_of(events: list[dict[str, Any]]) -> list[str]:
    return [e["event_id"] for e in events]


class StatusCounter(httpx.HTTPTransport):
    """The client's real transport, counting the status of every answer (and each failure to get
    one) so a test can tell a 503 from a 500 or a refused connection."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[int | str] = Counter()
        self.missing_retry_after = 0
        # Events of attempts that may have reached the service and got no answer (a timeout, a
        # connection reset): their retry may rightly find them applied, as duplicates.
        self.unanswered: set[str] = set()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = super().handle_request(request)
        except httpx.TransportError as exc:
            self.counts[type(exc).__name__] += 1
            if not isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                self.unanswered.update(
                    e["event_id"] for e in orjson.loads(request.content)["events"]
                )
            raise
        self.counts[response.status_code] += 1
        if response.status_code == 503 and "retry-after" not in response.headers:
            self.missing_retry_after += 1
        return response


class Router:
    """A router reporting through the real client from its own thread: `rate` events a second,
    and never more than `high_water` queued (a test may change it as it goes), so none is ever
    dropped and every event sent must in the end be acknowledged. `acknowledged()` is what the
    client's on_answer told."""

    def __init__(
        self,
        name: str,
        seed: int,
        url: str,
        *,
        rate: float,
        high_water: int,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.source = EventSource(name, seed)
        self.rate = rate
        self.high_water = high_water
        self.sent: list[dict[str, Any]] = []
        self.answers: list[Answer] = []
        self.transport = transport if transport is not None else StatusCounter()
        self.client = KvpClient(
            url,
            batch_size=CLIENT_BATCH,
            max_backoff_seconds=MAX_BACKOFF_SECONDS,
            max_queue_events=10 * high_water,
            on_answer=self.answers.append,
            transport=self.transport,
        )
        self.stop = threading.Event()
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name=f"router-{name}", daemon=True)

    @property
    def name(self) -> str:
        return self.source.name

    def _run(self) -> None:
        try:
            due = time.monotonic()
            while not self.stop.is_set():
                now = time.monotonic()
                if now < due or self.client.stats.queued >= self.high_water:
                    time.sleep(0.002)
                    continue
                due = max(due, now - 0.1) + BATCH_EVENTS / self.rate
                batch = self.source.next_batch()
                for event in batch:
                    self.client.send(event)
                self.sent.extend(batch)
        except BaseException as exc:
            self.error = f"router {self.name} raised {exc!r}"

    def acknowledged(self) -> set[str]:
        return {i for a in list(self.answers) for i in (*a.accepted, *a.duplicates)}

    def duplicates(self) -> set[str]:
        return {i for a in list(self.answers) for i in a.duplicates}

    def unanswered(self) -> set[str]:
        """Events of attempts the service may have taken without answering (StatusCounter)."""
        return set(getattr(self.transport, "unanswered", ()))


def start_routers(routers: list[Router]) -> None:
    for r in routers:
        r.thread.start()


def stop_routers(routers: list[Router]) -> None:
    for r in routers:
        r.stop.set()
    for r in routers:
        r.thread.join(10)


def drain(routers: list[Router], timeout: float = 60.0) -> list[ClientStats]:
    """Stop the routers, wait until their clients have an answer for every event, close them."""
    stop_routers(routers)
    for r in routers:
        assert r.error is None, r.error
        assert not r.thread.is_alive(), f"router {r.name} did not stop"
        assert r.client.flush(timeout=timeout), (
            f"router {r.name}'s client did not drain: {r.client.stats}"
        )
        assert r.client.close(timeout=5)
    return [r.client.stats for r in routers]


def wait_until(condition: Callable[[], Any], what: str, limit: float = 20.0) -> float:
    """Seconds it took for `condition` to hold."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < limit, f"timed out after {limit} s waiting for {what}"
        time.sleep(0.01)
    return time.monotonic() - started


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


def check_each_event_once(
    routers: list[Router],
    stats: list[ClientStats],
    url: str,
    events_dir: Path,
    *,
    extra_ids: frozenset[str] | set[str] = frozenset(),
    extra_sessions: int = 0,
) -> dict[str, dict[str, Any] | None]:
    """After the routers drained: every event sent was acknowledged, and is in the log and in the
    state exactly once. `extra_ids` were posted besides, in `extra_sessions` other sessions.
    Returns the routers' sessions' views."""
    sent = [e for r in routers for e in r.sent]
    sent_ids = ids_of(sent)
    assert len(set(sent_ids)) == len(sent_ids)
    told = Counter(
        i for r in routers for a in r.answers for i in (*a.accepted, *a.duplicates, *a.rejected)
    )
    assert not [i for i, n in told.items() if n > 1], "an event was answered for twice"
    assert set(told) == set(sent_ids)
    assert sum(s.rejected + s.dropped + s.queued for s in stats) == 0, stats
    assert sum(s.sent + s.duplicates for s in stats) == len(sent_ids)

    # The log holds every event sent exactly once, and nothing else.
    for ids in (log_ids_from_files(events_dir), log_ids_from_iter_log(events_dir)):
        counts = Counter(ids)
        twice = [i for i, n in counts.items() if n > 1]
        assert not twice, f"{len(twice)} event ids are in the log more than once, e.g. {twice[:5]}"
        expected = set(sent_ids) | extra_ids
        assert set(ids) == expected, (
            f"missing from the log: {len(expected - set(ids))}, "
            f"unexpected: {len(set(ids) - expected)}"
        )

    # The state applied each exactly once: a session's turns count its request_routed events.
    turns = expected_turns(sent)
    session_ids = [f"s{n}" for n in range(SESSIONS)]
    views = session_views(url, session_ids)
    got = {sid: (view["turns"] if view else None) for sid, view in views.items()}
    wrong = {sid: (got[sid], turns.get(sid)) for sid in session_ids if got[sid] != turns.get(sid)}
    assert not wrong, (
        f"sessions whose turns are wrong (got, expected): {dict(list(wrong.items())[:10])}"
    )
    state = readyz_stats(url)
    assert state["remembered_event_ids"] == len(sent_ids) + len(extra_ids)
    assert state["sessions"] == len(turns) + extra_sessions
    return views


def regular_sessions(
    sessions: dict[str, list[int]],
    now: float,
    *,
    instance_id: str = "gpu-0",
    turn_gap_seconds: float = 10.0,
    room_event_id: str = "room",
) -> list[dict[str, Any]]:
    """Sessions with a turn every `turn_gap_seconds` on `instance_id`, the last just finished,
    their contexts (the blocks given) in the pool; and the instance's room. The heuristic
    predictor then expects each back within the lead time and the scheduler orders each context
    prefetched from the pool."""
    events: list[dict[str, Any]] = []
    for sid, blocks in sessions.items():
        for n in range(6):
            # The last turn 6 s ago: due again in 4 s, so the planner's needed_by (from the
            # arrival curve) is seconds ahead and an agent holds the orders until their start_by.
            ts = now + 4.0 - turn_gap_seconds * (6 - n)
            common = {"session_id": sid, "request_id": f"{sid}-r{n}", "instance_id": instance_id}
            events += [
                {"type": "request_routed", "event_id": f"{sid}-q{n}", "ts": ts, **common,
                 "prompt_tokens": 3900, "block_hashes": blocks},
                {"type": "request_finished", "event_id": f"{sid}-f{n}", "ts": ts + 1.0, **common,
                 "output_tokens": 100, "context_tokens": 4096, "block_hashes": blocks},
            ]  # fmt: skip
        events.append(
            {"type": "kv_blocks_stored", "event_id": f"{sid}-pool", "ts": now - 1.0,
             "tier": "pool", "instance_id": None, "block_hashes": blocks}
        )  # fmt: skip
    events.append(
        {"type": "instance_status", "event_id": room_event_id, "ts": now - 1.0,
         "instance_id": instance_id, "free_kv_bytes": 1 << 40}
    )  # fmt: skip
    return events
