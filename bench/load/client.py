"""The client: connections posting event batches and asking for route hints.

Each connection is one thread with one keep-alive httpx.Client. By default it is closed-loop: it
sends its next call as soon as the last one is answered, so the latencies are those of a
saturated server. Given an offered rate (`events_per_second`, `hints_per_second`) it is
open-loop: each call has a scheduled start, one interval after the last one's, and its latency is
counted from that start, not from when it could be sent, so a server that falls behind shows it
in the latencies (no coordinated omission). Every answer is logged with when it came, so any
window of the run can be read afterwards (`Load.window`).
"""

from __future__ import annotations

import bisect
import queue
import random
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from bench.load.traffic import Held, Shard

RETRY_AFTER_CAP_SECONDS = 5.0
MAX_ATTEMPTS = 5
EVENTS_OK = b'"duplicates":[],"rejected":[]'
KINDS = ("event_batches", "route_hints")


class _Log:
    """One thread's calls: when each was answered, how long it took, how many events it carried."""

    def __init__(self) -> None:
        self.ends = array("d")
        self.latencies = array("d")
        self.events = array("q")
        self.errors: Counter[str] = Counter()
        self.dropped = 0
        self.unexpected = 0  # a 200 to a first attempt that reported duplicates or rejects
        self.first_refusal: str | None = None  # the first answer not retried, as the service said


def _error_key(status: int | None, exc: BaseException | None) -> str:
    return str(status) if exc is None else type(exc).__name__


def _retry_after(headers: Any) -> float:
    try:
        return min(RETRY_AFTER_CAP_SECONDS, max(0.0, float(headers.get("retry-after", "0.5"))))
    except ValueError:
        return 0.5


class _Pacer:
    """The scheduled starts of an open-loop connection: `interval_seconds` apart from the first.
    `next` waits for the next one (at once when behind) and returns it; None without a rate
    (closed-loop) or once `stop` is set."""

    def __init__(self, interval_seconds: float | None, stop: threading.Event) -> None:
        self.interval_seconds = interval_seconds
        self.stop = stop
        self._next: float | None = None

    def next(self) -> float | None:
        if self.interval_seconds is None:
            return None
        now = time.perf_counter()
        due = now if self._next is None else self._next
        if due > now and self.stop.wait(due - now):
            return None
        self._next = due + self.interval_seconds
        return due


def _interval(units_per_call: int, rate_per_second: float | None) -> float | None:
    return None if rate_per_second is None else units_per_call / rate_per_second


def _call(
    client: Any,
    url: str,
    body: bytes,
    headers: dict[str, str],
    log: _Log,
    stop: threading.Event,
    ok: Callable[[Any, int], bool],
    scheduled: float | None = None,
) -> bool:
    """POSTs until answered 200 (retrying what a real client would: 429, 503, transport errors),
    logging each answer. Returns whether it got through. The latency logged is from `scheduled`
    (open-loop) or from the answered attempt's send."""
    for attempt in range(MAX_ATTEMPTS):
        t0 = time.perf_counter()
        try:
            r = client.post(url, content=body, headers=headers)
        except Exception as exc:  # counted by type; the call is retried
            log.errors[_error_key(None, exc)] += 1
            if stop.wait(0.5):
                return False
            continue
        t1 = time.perf_counter()
        if r.status_code == 200:
            if not ok(r, attempt):
                log.unexpected += 1
            log.ends.append(t1)
            log.latencies.append(t1 - (t0 if scheduled is None else scheduled))
            return True
        log.errors[_error_key(r.status_code, None)] += 1
        if r.status_code not in (429, 503):
            if log.first_refusal is None:
                log.first_refusal = f"HTTP {r.status_code}: {r.text[:1000]}"
            break  # the request itself is wrong: resending it cannot help
        if stop.wait(_retry_after(r.headers)):
            return False
    log.dropped += 1
    return False


def _new_client() -> Any:
    import httpx

    return httpx.Client(timeout=30.0, limits=httpx.Limits(max_connections=1))


def _event_worker(
    url: str,
    shard: Shard,
    batch_size: int,
    headers: dict[str, str],
    log: _Log,
    stop: threading.Event,
    events_per_second: float | None = None,
) -> None:
    # A generator thread makes the next bodies while this one waits for answers (the GIL is free
    # then), so generating costs the client CPU but not latency.
    bodies: queue.Queue[tuple[bytes, int, list[tuple[int, str]], Held]] = queue.Queue(maxsize=3)

    def generate() -> None:
        while not stop.is_set():
            item = shard.batch(batch_size)
            while not stop.is_set():
                try:
                    bodies.put(item, timeout=0.2)
                    break
                except queue.Full:
                    continue

    gen = threading.Thread(target=generate, daemon=True, name="load-generate")
    gen.start()

    def ok(r: Any, attempt: int) -> bool:
        # A retry may find its events applied already; the ceiling's answer names no duplicates.
        return attempt > 0 or EVENTS_OK in r.content or b'"duplicates"' not in r.content

    pacer = _Pacer(_interval(batch_size, events_per_second), stop)
    with _new_client() as client:
        while not stop.is_set():
            try:
                body, n, publish, held = bodies.get(timeout=0.2)
            except queue.Empty:
                continue
            scheduled = pacer.next()
            if stop.is_set():
                break
            if _call(client, url + "/v1/events", body, headers, log, stop, ok, scheduled):
                log.events.append(n)
                for slot, sid in publish:
                    shard.hintable[slot] = sid
                # Counted as this body was made, not as later ones are: the generator runs
                # bodies ahead of what the service has applied.
                shard.acked = held
    gen.join(timeout=5)


def _hint_worker(
    url: str,
    shards: Sequence[Shard],
    seed: int,
    headers: dict[str, str],
    log: _Log,
    stop: threading.Event,
    hints_per_second: float | None = None,
) -> None:
    rng = random.Random(seed)
    candidates = [orjson.dumps(s.instances) for s in shards]

    def ok(r: Any, attempt: int) -> bool:
        return b'"recommended"' in r.content

    pacer = _Pacer(_interval(1, hints_per_second), stop)
    with _new_client() as client:
        while not stop.is_set():
            k = rng.randrange(len(shards))
            sid = shards[k].hintable[rng.randrange(len(shards[k].hintable))]
            if sid is None:
                stop.wait(0.01)
                continue
            body = b'{"session_id":"' + sid.encode() + b'","candidates":' + candidates[k] + b"}"
            scheduled = pacer.next()
            if stop.is_set():
                break
            if _call(client, url + "/v1/route-hint", body, headers, log, stop, ok, scheduled):
                log.events.append(0)


class Load:
    """The client threads of one phase: `event_connections` routers posting batches and
    `hint_connections` asking for route hints; closed-loop, or open-loop at the offered rates
    (in all, shared evenly among the connections of each kind)."""

    def __init__(
        self,
        url: str,
        shards: list[Shard],
        *,
        hint_connections: int,
        batch_size: int,
        token: str | None,
        seed: int,
        events_per_second: float | None = None,
        hints_per_second: float | None = None,
    ) -> None:
        headers = {"content-type": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self.shards = shards
        self.stop = threading.Event()
        self.logs: dict[str, list[_Log]] = {"event_batches": [], "route_hints": []}
        self.threads: list[threading.Thread] = []
        for i, shard in enumerate(shards):
            log = _Log()
            self.logs["event_batches"].append(log)
            self.threads.append(
                threading.Thread(
                    target=_event_worker,
                    name=f"load-events-{i}",
                    daemon=True,
                    args=(
                        url,
                        shard,
                        batch_size,
                        headers,
                        log,
                        self.stop,
                        None if events_per_second is None else events_per_second / len(shards),
                    ),
                )
            )
        for i in range(hint_connections):
            log = _Log()
            self.logs["route_hints"].append(log)
            self.threads.append(
                threading.Thread(
                    target=_hint_worker,
                    name=f"load-hints-{i}",
                    daemon=True,
                    args=(
                        url,
                        shards,
                        seed * 1000 + i,
                        headers,
                        log,
                        self.stop,
                        None if hints_per_second is None else hints_per_second / hint_connections,
                    ),
                )
            )

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=40)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Throughput, latency and errors of the calls answered in [t0, t1) (perf_counter)."""
        return window(self.logs, t0, t1)

    def errors(self) -> dict[str, Any]:
        by_kind: dict[str, dict[str, int]] = {}
        total = rate_limited = dropped = unexpected = 0
        first_refusal: str | None = None
        for kind, logs in self.logs.items():
            c: Counter[str] = Counter()
            for log in logs:
                c.update(log.errors)
                dropped += log.dropped
                unexpected += log.unexpected
                first_refusal = first_refusal or log.first_refusal
            by_kind[kind] = dict(sorted(c.items()))
            total += sum(c.values())
            rate_limited += c.get("429", 0)
        return {
            "total": total,
            "rate_limited_429": rate_limited,
            "by_kind": by_kind,
            "dropped_after_retries": dropped,
            "unexpected_duplicates_or_rejects": unexpected,
            "first_refusal": first_refusal,
        }


def window(logs_by_kind: dict[str, list[_Log]], t0: float, t1: float) -> dict[str, Any]:
    """Throughput and latency of the calls in `logs_by_kind` answered in [t0, t1) (perf_counter):
    one Load's, or several Loads' together (`kvprefetch bench planner`, a Load per replica)."""
    out: dict[str, Any] = {}
    for kind, logs in logs_by_kind.items():
        lat: list[float] = []
        events = 0
        for log in logs:
            n = len(log.events)  # appended last: every array holds at least n entries
            i, j = (
                bisect.bisect_left(log.ends, t0, 0, n),
                bisect.bisect_left(log.ends, t1, 0, n),
            )
            lat.extend(log.latencies[i:j])
            events += sum(log.events[i:j])
        secs = t1 - t0
        entry: dict[str, Any] = {
            "requests": len(lat),
            "requests_per_second": round(len(lat) / secs, 1),
        }
        if kind == "event_batches":
            entry["events"] = events
            entry["events_per_second"] = round(events / secs, 1)
        entry["latency_ms"] = percentiles(lat)
        out[kind] = entry
    return out


def percentiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p99": None, "max": None}
    xs = sorted(xs)

    def q(p: float) -> float:
        return round(xs[min(len(xs) - 1, int(p * len(xs)))] * 1000, 3)

    return {"p50": q(0.5), "p99": q(0.99), "max": round(xs[-1] * 1000, 3)}
