"""Sustained load: event batches and route hints from this process against the real service.

The service runs as its own process (`python -m app.cli serve`, one uvicorn worker, a temp data
dir, fsync on, the memory store unless `store="redis"`, scoring and planning loops at their
defaults); this process is the client. Both kinds of calls run closed-loop at full speed: each
connection (one thread, one keep-alive httpx.Client) sends its next call as soon as the last one
is answered.

Traffic: each event connection is a router with its own shard of the cluster (its conversations
and instances). A bounded population of conversations comes back turn after turn: a turn is
request_routed (the prompt's block hashes), request_started, kv_blocks_stored for the blocks the
prefill computed, and later request_finished (the context's block hashes) and kv_blocks_stored
for the output's full blocks. Each instance's HBM is an LRU of `hbm_blocks` blocks: what falls
out is reported with kv_blocks_removed, as engines do. Instances report instance_status now and
then. A conversation ends after its turns; half the time the router says session_closed, and a
new conversation takes its place. Every event is stamped with the wall clock, so the scoring
loop and the scheduler see a live cluster. Route hints ask about conversations the service has
acknowledged, with the shard's instances as candidates.

Memory: the service's RSS is sampled every `sample_seconds`, beside its store's counts from
/readyz. The bound is what the run grew by in the counts the configuration and the README
account for (sessions tracked, remembered event ids up to KVP_DEDUPE_MAX_IDS, resident blocks)
times what each costs, measured first in fresh processes that ingest this traffic through the
service's own pipeline (`_calibrate`), plus an allowance. Two growths no setting bounds are
priced beside the bound, not in it: the store's removal tombstones, and the orders the pull sink
holds while no agent leases them (this bench runs none).

Baseline: a short phase before and one after against a bare FastAPI "ceiling" (bench/ceiling_app.py
plus a route-hint endpoint of the same shape) with the same client, so throughput has a ratio.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from bench._util import REPO, child_env, free_port, info, machine

BLOCK_TOKENS = 512
BYTES_PER_TOKEN = 327_680  # the service's default (Llama-3.1-70B bf16)
BYTES_PER_BLOCK = BYTES_PER_TOKEN * BLOCK_TOKENS
# Growth the unit costs do not price: the bounded structures (the timeline's samples, the
# scheduler's advice, metrics, queues) and allocator slack. Whichever is larger.
ALLOWANCE_MIN_BYTES = 32 * 2**20
ALLOWANCE_SHARE = 0.10
RETRY_AFTER_CAP_SECONDS = 5.0
MAX_ATTEMPTS = 5
EVENTS_OK = b'"duplicates":[],"rejected":[]'
KINDS = ("event_batches", "route_hints")


class BenchError(RuntimeError):
    pass


# -- traffic ---------------------------------------------------------------------------------


class _Conv:
    __slots__ = ("slot", "session_id", "instance_id", "tokens", "blocks", "turns_left", "turn", "request_id")

    def __init__(self, slot: int, session_id: str, instance_id: str, tokens: int, blocks: list[int],
                 turns: int) -> None:
        self.slot = slot
        self.session_id = session_id
        self.instance_id = instance_id
        self.tokens = tokens
        self.blocks = blocks
        self.turns_left = turns
        self.turn = 0
        self.request_id = ""


class Shard:
    """One router's conversations and instances, generating events as they happen (wall clock).

    Not thread-safe: one generator thread owns it. `hintable` (slot -> a session id the service
    has acknowledged) is written by the poster after each 200 and read by the hint threads.
    """

    def __init__(self, *, seed: int, sessions: int, instance_ids: Sequence[str], hbm_blocks: int,
                 close_share: float = 0.5, kv_events: bool = True, status_events: bool = True) -> None:
        self.rng = random.Random(seed)
        self._id_prefix = str(uuid.uuid4())[:23]  # unique per run, so no two runs' ids collide
        self._next_id = 0
        self.instances = list(instance_ids)
        self.hbm_blocks = hbm_blocks
        self.close_share = close_share
        self.kv_events = kv_events
        self.status_events = status_events
        # System prompts shared by many conversations: their full blocks hash alike everywhere.
        self._system = []
        for _ in range(50):
            tokens = self.rng.randint(600, 3000)
            self._system.append((tokens, [self.rng.getrandbits(63) for _ in range(tokens // BLOCK_TOKENS)]))
        self.hbm: dict[str, OrderedDict[int, None]] = {i: OrderedDict() for i in self.instances}
        # Blocks removed and not stored again, per instance: what the service keeps as tombstones.
        self.tombstones: dict[str, set[int]] = {i: set() for i in self.instances}
        self.running_on: Counter[str] = Counter()
        self.idle: list[_Conv] = []
        self.running: deque[_Conv] = deque()
        self.running_target = max(1, sessions // 20)
        self.hintable: list[str | None] = [None] * sessions
        self.sessions_started = 0
        self.sessions_closed = 0
        self.sessions_abandoned = 0
        self.events = Counter[str]()
        self._last_ts = 0.0
        self._out: list[dict[str, Any]] = []
        self._publish: list[tuple[int, str]] = []
        for slot in range(sessions):
            self.idle.append(self._new_conv(slot))

    @property
    def tombstone_count(self) -> int:
        return sum(len(t) for t in self.tombstones.values())

    def _ts(self) -> float:
        # Wall clock, strictly increasing: a removal never lands before the store it undoes.
        ts = self._last_ts = max(time.time(), self._last_ts + 1e-6)
        return ts

    def _event_id(self) -> str:
        self._next_id += 1
        return f"{self._id_prefix}-{self._next_id:012x}"

    def _new_conv(self, slot: int) -> _Conv:
        rng = self.rng
        self.sessions_started += 1
        tokens, system_blocks = rng.choice(self._system)
        sid = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        # Mostly short conversations, some long (mean ~5 turns).
        turns = min(30, 2 + int(rng.expovariate(1 / 3)))
        return _Conv(slot, sid, rng.choice(self.instances), tokens, list(system_blocks), turns)

    def _grow(self, conv: _Conv, tokens: int) -> list[int]:
        """Adds tokens to the context; returns the hashes of the full blocks that makes."""
        conv.tokens = min(conv.tokens + tokens, 131_072)
        n = conv.tokens // BLOCK_TOKENS - len(conv.blocks)
        new = [self.rng.getrandbits(63) for _ in range(max(0, n))]
        conv.blocks.extend(new)
        return new

    def _emit(self, event: dict[str, Any]) -> None:
        event["event_id"] = self._event_id()
        self.events[event["type"]] += 1
        self._out.append(event)

    def _store(self, instance_id: str, hashes: list[int]) -> None:
        """The engine stored these blocks in HBM; what falls out of its LRU is removed."""
        lru = self.hbm[instance_id]
        tomb = self.tombstones[instance_id]
        new = []
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                tomb.discard(h)
                new.append(h)
        if not new or not self.kv_events:
            return
        self._emit({"type": "kv_blocks_stored", "ts": self._ts(), "tier": "hbm", "instance_id": instance_id,
                    "block_hashes": new, "block_tokens": BLOCK_TOKENS})
        over = len(lru) - self.hbm_blocks
        if over > 0:
            gone = [lru.popitem(last=False)[0] for _ in range(over)]
            tomb.update(gone)
            self._emit({"type": "kv_blocks_removed", "ts": self._ts(), "tier": "hbm", "instance_id": instance_id,
                        "block_hashes": gone})

    def _start_turn(self) -> None:
        rng, idle = self.rng, self.idle
        i = rng.randrange(len(idle))
        conv = idle[i]
        idle[i] = idle[-1]
        idle.pop()
        if conv.turn > 0 and rng.random() < 0.1:  # the router moves it now and then
            conv.instance_id = rng.choice(self.instances)
        self._grow(conv, max(10, min(8000, int(rng.lognormvariate(5.5, 1.0)))))  # the user's message
        if conv.turn == 0:  # hintable once this, its first event, is acknowledged
            self._publish.append((conv.slot, conv.session_id))
        conv.turn += 1
        conv.request_id = f"chatcmpl-{rng.getrandbits(128):032x}"
        common = {"session_id": conv.session_id, "request_id": conv.request_id, "instance_id": conv.instance_id}
        self._emit({"type": "request_routed", "ts": self._ts(), **common, "prompt_tokens": conv.tokens,
                    "block_hashes": list(conv.blocks), "block_tokens": BLOCK_TOKENS})
        self._emit({"type": "request_started", "ts": self._ts(), **common})
        self._store(conv.instance_id, conv.blocks)  # the prefill computed what was missing
        self.running.append(conv)
        self.running_on[conv.instance_id] += 1

    def _finish_turn(self) -> None:
        rng = self.rng
        conv = self.running.popleft()
        self.running_on[conv.instance_id] -= 1
        output = max(1, min(4000, int(rng.lognormvariate(5.3, 0.9))))
        new = self._grow(conv, output)
        self._emit({"type": "request_finished", "ts": self._ts(), "session_id": conv.session_id,
                    "request_id": conv.request_id, "instance_id": conv.instance_id, "output_tokens": output,
                    "context_tokens": conv.tokens, "block_hashes": list(conv.blocks), "block_tokens": BLOCK_TOKENS})
        if new:
            self._store(conv.instance_id, new)
        conv.turns_left -= 1
        if conv.turns_left > 0:
            self.idle.append(conv)
            return
        if rng.random() < self.close_share:
            self._emit({"type": "session_closed", "ts": self._ts(), "session_id": conv.session_id})
            self.sessions_closed += 1
        else:  # the user just never comes back
            self.sessions_abandoned += 1
        self.idle.append(self._new_conv(conv.slot))

    def _status(self) -> None:
        rng = self.rng
        inst = rng.choice(self.instances)
        used = len(self.hbm[inst])
        running = self.running_on[inst]
        self._emit({"type": "instance_status", "ts": self._ts(), "instance_id": inst,
                    "free_kv_bytes": max(0, self.hbm_blocks - used) * BYTES_PER_BLOCK,
                    "total_kv_bytes": self.hbm_blocks * BYTES_PER_BLOCK,
                    "queue_depth": max(0, running - 64), "running_requests": min(running, 64)})

    def step(self) -> None:
        if len(self.running) >= self.running_target or not self.idle:
            self._finish_turn()
        else:
            self._start_turn()
        if self.status_events and self.rng.random() < 0.05:
            self._status()

    def batch(self, size: int) -> tuple[bytes, int, list[tuple[int, str]]]:
        """The next `size` events as a POST /v1/events body; the sessions it makes known."""
        while len(self._out) < size:
            self.step()
        events, self._out = self._out[:size], self._out[size:]
        publish, self._publish = self._publish, []
        return orjson.dumps({"events": events}), len(events), publish


def make_shards(*, connections: int, sessions: int, instances: int, hbm_blocks: int, seed: int,
                **kw: Any) -> list[Shard]:
    shards = []
    for c in range(connections):
        ids = [f"vllm-decode-{n:02d}" for n in range(instances) if n % connections == c]
        shards.append(Shard(seed=seed * 1000 + c, sessions=max(1, sessions // connections), instance_ids=ids,
                            hbm_blocks=hbm_blocks, **kw))
    return shards


# -- the client --------------------------------------------------------------------------------


class _Log:
    """One thread's calls: when each was answered, how long it took, how many events it carried."""

    def __init__(self) -> None:
        self.ends = array("d")
        self.latencies = array("d")
        self.events = array("q")
        self.errors: Counter[str] = Counter()
        self.dropped = 0
        self.unexpected = 0  # a 200 to a first attempt that reported duplicates or rejects


def _error_key(status: int | None, exc: BaseException | None) -> str:
    return str(status) if exc is None else type(exc).__name__


def _retry_after(headers: Any) -> float:
    try:
        return min(RETRY_AFTER_CAP_SECONDS, max(0.0, float(headers.get("retry-after", "0.5"))))
    except ValueError:
        return 0.5


def _call(client: Any, url: str, body: bytes, headers: dict[str, str], log: _Log, stop: threading.Event,
          ok: Callable[[Any, int], bool]) -> bool:
    """POSTs until answered 200 (retrying what a real client would: 429, 503, transport errors),
    logging each answer. Returns whether it got through."""
    for attempt in range(MAX_ATTEMPTS):
        t0 = time.perf_counter()
        try:
            r = client.post(url, content=body, headers=headers)
        except Exception as exc:  # noqa: BLE001 - counted by type; the call is retried
            log.errors[_error_key(None, exc)] += 1
            if stop.wait(0.5):
                return False
            continue
        t1 = time.perf_counter()
        if r.status_code == 200:
            if not ok(r, attempt):
                log.unexpected += 1
            log.ends.append(t1)
            log.latencies.append(t1 - t0)
            return True
        log.errors[_error_key(r.status_code, None)] += 1
        if r.status_code not in (429, 503):
            break  # the request itself is wrong: resending it cannot help
        if stop.wait(_retry_after(r.headers)):
            return False
    log.dropped += 1
    return False


def _new_client() -> Any:
    import httpx

    return httpx.Client(timeout=30.0, limits=httpx.Limits(max_connections=1))


def _event_worker(url: str, shard: Shard, batch_size: int, headers: dict[str, str], log: _Log,
                  stop: threading.Event) -> None:
    # A generator thread makes the next bodies while this one waits for answers (the GIL is free
    # then), so generating costs the client CPU but not latency.
    bodies: queue.Queue[tuple[bytes, int, list[tuple[int, str]]]] = queue.Queue(maxsize=3)

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

    with _new_client() as client:
        while not stop.is_set():
            try:
                body, n, publish = bodies.get(timeout=0.2)
            except queue.Empty:
                continue
            if _call(client, url + "/v1/events", body, headers, log, stop, ok):
                log.events.append(n)
                for slot, sid in publish:
                    shard.hintable[slot] = sid
    gen.join(timeout=5)


def _hint_worker(url: str, shards: Sequence[Shard], seed: int, headers: dict[str, str], log: _Log,
                 stop: threading.Event) -> None:
    rng = random.Random(seed)
    candidates = [orjson.dumps(s.instances) for s in shards]

    def ok(r: Any, attempt: int) -> bool:
        return b'"recommended"' in r.content

    with _new_client() as client:
        while not stop.is_set():
            k = rng.randrange(len(shards))
            sid = shards[k].hintable[rng.randrange(len(shards[k].hintable))]
            if sid is None:
                stop.wait(0.01)
                continue
            body = b'{"session_id":"' + sid.encode() + b'","candidates":' + candidates[k] + b"}"
            if _call(client, url + "/v1/route-hint", body, headers, log, stop, ok):
                log.events.append(0)


class _Load:
    """The client threads of one phase: `event_connections` routers posting batches and
    `hint_connections` asking for route hints, all closed-loop."""

    def __init__(self, url: str, shards: list[Shard], *, hint_connections: int, batch_size: int,
                 token: str | None, seed: int) -> None:
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
            self.threads.append(threading.Thread(target=_event_worker, name=f"load-events-{i}", daemon=True,
                                                 args=(url, shard, batch_size, headers, log, self.stop)))
        for i in range(hint_connections):
            log = _Log()
            self.logs["route_hints"].append(log)
            self.threads.append(threading.Thread(target=_hint_worker, name=f"load-hints-{i}", daemon=True,
                                                 args=(url, shards, seed * 1000 + i, headers, log, self.stop)))

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=40)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Throughput, latency and errors of the calls answered in [t0, t1) (perf_counter)."""
        out: dict[str, Any] = {}
        for kind, logs in self.logs.items():
            lat: list[float] = []
            events = 0
            for log in logs:
                n = len(log.events)  # appended last: every array holds at least n entries
                i, j = bisect.bisect_left(log.ends, t0, 0, n), bisect.bisect_left(log.ends, t1, 0, n)
                lat.extend(log.latencies[i:j])
                events += sum(log.events[i:j])
            secs = t1 - t0
            entry: dict[str, Any] = {"requests": len(lat), "requests_per_second": round(len(lat) / secs, 1)}
            if kind == "event_batches":
                entry["events"] = events
                entry["events_per_second"] = round(events / secs, 1)
            entry["latency_ms"] = _percentiles(lat)
            out[kind] = entry
        return out

    def errors(self) -> dict[str, Any]:
        by_kind: dict[str, dict[str, int]] = {}
        total = rate_limited = dropped = unexpected = 0
        for kind, logs in self.logs.items():
            c: Counter[str] = Counter()
            for log in logs:
                c.update(log.errors)
                dropped += log.dropped
                unexpected += log.unexpected
            by_kind[kind] = dict(sorted(c.items()))
            total += sum(c.values())
            rate_limited += c.get("429", 0)
        return {"total": total, "rate_limited_429": rate_limited, "by_kind": by_kind,
                "dropped_after_retries": dropped, "unexpected_duplicates_or_rejects": unexpected}


def _percentiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p99": None, "max": None}
    xs = sorted(xs)

    def q(p: float) -> float:
        return round(xs[min(len(xs) - 1, int(p * len(xs)))] * 1000, 3)

    return {"p50": q(0.5), "p99": q(0.99), "max": round(xs[-1] * 1000, 3)}


# -- processes ---------------------------------------------------------------------------------


class _Proc:
    """A server process on a free port, its output in a log file."""

    def __init__(self, name: str, cmd_tail: list[str], *, workdir: Path, env: dict[str, str], port: int) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, *cmd_tail], cwd=workdir, env=child_env(env),
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, path: str, headers: dict[str, str], timeout: float = 90.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"the {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = httpx.get(self.url + path, headers=headers, timeout=2.0)
                if r.status_code == 200:
                    return
                last = f"{path} answered {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.1)
        raise BenchError(f"the {self.name} was not ready within {timeout:.0f} s ({last}):\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # uvicorn shuts down gracefully
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _rss(pid: int) -> int:
    import psutil

    p = psutil.Process(pid)
    total = p.memory_info().rss
    for c in p.children(recursive=True):
        try:
            total += c.memory_info().rss
        except psutil.Error:
            pass
    return int(total)


def _cpu_seconds(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _cpu_pressure() -> float | None:
    """The share of the last 60 s some runnable task waited for a CPU (Linux PSI), in %."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(dict(kv.split("=") for kv in line.split()[1:])["avg60"])
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


# -- calibration: what each unit of state costs, measured ----------------------------------


def _calibrate_worker(mode: str, sessions: int, store: str, redis_url: str, dedupe_max_ids: int | None,
                      seed: int) -> dict[str, Any]:
    """In a fresh process: the service's app (create_app, its lifespan, every ingest observer;
    no loops, no HTTP) ingests this traffic; RSS before and after, per unit of state.

    modes: `sessions` (request and close events, one remembered id), `ids` (the same, ids
    remembered as configured), `blocks` (kv_blocks_stored of fresh blocks only, one id),
    `tombstones` (fresh blocks stored and removed again: what a removal leaves behind), `orders`
    (pin orders of this traffic's contexts held by the pull sink, as the scheduler makes them)."""
    import asyncio

    import psutil

    if mode == "orders":
        return _calibrate_orders(sessions, seed)

    from app.api.main import create_app
    from app.core.config import Settings
    from app.engine.events import batch_adapter

    tmp = Path(tempfile.mkdtemp(prefix="kvp-bench-load-cal-"))
    prefix = f"kvp-bench-load-cal-{uuid.uuid4().hex[:12]}"
    keep_ids = mode == "ids"
    overrides: dict[str, Any] = {
        "store": store, "redis_url": redis_url, "redis_prefix": prefix, "data_dir": tmp, "log_fsync": False,
        "score_interval_seconds": 0, "plan_interval_seconds": 0, "dashboard_sample_seconds": 0,
        "replica_id": "bench-load-calibrate",
        "dedupe_max_ids": (dedupe_max_ids or Settings.model_fields["dedupe_max_ids"].default) if keep_ids else 1,
    }
    settings = Settings(_env_file=None, **overrides)  # type: ignore[call-arg]
    app = create_app(settings)
    proc = psutil.Process()
    # A population smaller than the sessions ingested, so most of them live and end as in the run.
    kv = mode in ("blocks", "tombstones")
    shard = Shard(seed=seed, sessions=max(1, min(3000, sessions // 4)), instance_ids=[f"cal-{i:02d}" for i in range(16)],
                  hbm_blocks=10 if mode == "tombstones" else 10**9, kv_events=kv, status_events=False)

    tombstones_after: list[int] = []  # the client's count once each body was made

    def bodies() -> list[bytes]:
        out: list[bytes] = []
        if kv:
            for _ in range(max(2, sessions // 10)):  # as many blocks as the sessions run has hashes, roughly
                for inst in shard.instances:
                    shard._store(inst, [shard.rng.getrandbits(63) for _ in range(10)])
                out.append(orjson.dumps({"events": shard._out}))
                shard._out = []
                tombstones_after.append(shard.tombstone_count)
            return out
        while shard.sessions_started < sessions or len(out) < 2:
            out.append(shard.batch(1000)[0])
        return out

    async def go() -> dict[str, Any]:
        async with app.router.lifespan_context(app):
            ingestor, store_ = app.state.ingestor, app.state.store
            # Where the planning side runs off the request (a backlog), hand it each batch at once,
            # as the service's loop does between requests.
            backlog = getattr(app.state, "backlog", None)
            drain = backlog.drain if backlog is not None else (lambda: None)
            # Made before the baseline and kept until after, so they weigh in both.
            made = bodies()
            warm = made[0]
            ingestor.ingest(batch_adapter.validate_json(warm).events, warm)
            drain()
            gc.collect()
            before_stats = store_.stats()
            before = proc.memory_info().rss
            for body in made[1:]:
                ingestor.ingest(batch_adapter.validate_json(body).events, body)
                drain()
            gc.collect()
            after = proc.memory_info().rss
            after_stats = store_.stats()
            growth = {k: after_stats[k] - before_stats.get(k, 0) for k in after_stats}
            growth["tombstones"] = tombstones_after[-1] - tombstones_after[0] if tombstones_after else 0
            return {"mode": mode, "bytes": after - before, "growth": growth}

    try:
        return asyncio.run(go())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if store == "redis":
            _redis_clean(redis_url, prefix)


def _calibrate_orders(n: int, seed: int) -> dict[str, Any]:
    import psutil

    from app.engine.orders import Order, order_id_for
    from app.engine.sinks.pull import PullQueue

    shard = Shard(seed=seed, sessions=max(1, min(3000, n // 4)), instance_ids=[f"cal-{i:02d}" for i in range(16)],
                  hbm_blocks=10**9, status_events=False)
    for _ in range(n):  # contexts of a few turns, as pins name them
        shard.step()
    shard._out = []
    convs = shard.idle + list(shard.running)
    sink = PullQueue()
    gc.collect()
    proc = psutil.Process()
    before = proc.memory_info().rss
    now = time.time()
    for i in range(n):
        c = convs[i % len(convs)]
        blocks = list(c.blocks)
        sink.submit_nowait([Order(
            order_id=order_id_for("pin", c.instance_id, "hbm", blocks, i), kind="pin", instance_id=c.instance_id,
            block_hashes=blocks, size_bytes=len(blocks) * BYTES_PER_BLOCK, created_ts=now, start_by_ts=now,
            needed_by_ts=now, ttl_seconds=300.0, session_ids=[c.session_id])])
    gc.collect()
    return {"mode": "orders", "bytes": proc.memory_info().rss - before, "growth": {"orders": n}}


def _calibrate(sessions: int, store: str, redis_url: str, dedupe_max_ids: int | None, seed: int) -> dict[str, Any]:
    results = {}
    for mode in ("sessions", "ids", "blocks", "tombstones", "orders"):
        cmd = [sys.executable, "-m", "bench.load", "calibrate", "--mode", mode, "--sessions", str(sessions),
               "--store", store, "--redis-url", redis_url, "--seed", str(seed)]
        if dedupe_max_ids is not None:
            cmd += ["--dedupe-max-ids", str(dedupe_max_ids)]
        done = subprocess.run(cmd, cwd=REPO, env=child_env({}), capture_output=True, check=False)
        if done.returncode != 0:
            raise BenchError(f"calibration {mode} failed ({done.returncode}):\n{done.stderr.decode()[-3000:]}")
        results[mode] = json.loads(done.stdout)
    s, i, b, t, o = (results[m] for m in ("sessions", "ids", "blocks", "tombstones", "orders"))
    n_sessions = max(1, s["growth"]["sessions"])
    n_ids = max(1, i["growth"]["remembered_event_ids"] - s["growth"]["remembered_event_ids"])
    n_blocks = max(1, b["growth"]["resident_blocks"])
    n_tombstones = max(1, t["growth"]["tombstones"])
    return {
        "bytes_per_session": round(max(0, s["bytes"]) / n_sessions, 1),
        "bytes_per_event_id": round(max(0, i["bytes"] - s["bytes"]) / n_ids, 1),
        "bytes_per_resident_block": round(max(0, b["bytes"]) / n_blocks, 1),
        "bytes_per_tombstone": round(max(0, t["bytes"]) / n_tombstones, 1),
        "bytes_per_held_order": round(max(0, o["bytes"]) / o["growth"]["orders"], 1),
        "measured_on": {"sessions": n_sessions, "event_ids": n_ids, "resident_blocks": n_blocks,
                        "tombstones": n_tombstones, "orders": o["growth"]["orders"]},
    }


# -- the ceiling server ------------------------------------------------------------------------


def _ceiling_app() -> Any:
    """bench/ceiling_app.py plus POST /v1/route-hint declared as the service declares it (the same
    body and response models), answering a fixed hint without looking anything up."""
    from app.api.routes.hints import CandidateHintModel, RouteHintRequest, RouteHintResponse
    from bench.ceiling_app import app

    async def route_hint(body):  # type: ignore[no-untyped-def]
        return RouteHintResponse(
            session_id=body.session_id, context_known=True, context_bytes=0, recommended=body.candidates[0],
            reason="ceiling", candidates=[CandidateHintModel(
                instance_id=c, resident_bytes=0, inflight_bytes=0, missing_bytes=0, source="none",
                expected_load_seconds=0.0, queue_depth=0, running_requests=0, expected_wait_seconds=0.0,
                expected_seconds=0.0, recommended=i == 0, reason="ceiling") for i, c in enumerate(body.candidates)])

    # Real classes, not this module's postponed (string) annotations, which FastAPI resolves in
    # the module's globals: the body is then parsed as the service parses it.
    route_hint.__annotations__ = {"body": RouteHintRequest, "return": RouteHintResponse}
    app.post("/v1/route-hint", response_model=RouteHintResponse)(route_hint)
    return app


def _serve_ceiling(port: int) -> None:
    import uvicorn

    from app.core.runtime import tune_gc

    tune_gc()  # as `kvprefetch serve` does
    uvicorn.run(_ceiling_app(), host="127.0.0.1", port=port, log_level="warning", access_log=False)


# -- the run -----------------------------------------------------------------------------------


def _readyz(url: str, headers: dict[str, str]) -> dict[str, Any] | None:
    import httpx

    try:
        r = httpx.get(url + "/readyz", headers=headers, timeout=10.0)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _metrics(url: str, headers: dict[str, str]) -> dict[str, float] | None:
    """The service's own counters at the end, those not zero (histograms: sum and count only)."""
    import httpx

    try:
        r = httpx.get(url + "/metrics", headers=headers, timeout=10.0)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        name, _, value = line.rpartition(" ")
        base = name.split("{")[0]
        if not base.startswith("kvprefetch_") or not base.endswith(("_total", "_sum", "_count")):
            continue
        try:
            if float(value):
                out[name] = float(value)
        except ValueError:
            continue
    return out


def _log_summary(path: Path) -> dict[str, Any]:
    """Problems the service logged (they need not show as HTTP errors), and its last lines if any."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {"errors": None, "warnings": None, "tail": None}
    errors = sum(" ERROR " in ln or " CRITICAL " in ln or ln.startswith("Traceback") for ln in lines)
    warnings = sum(" WARNING " in ln for ln in lines)
    return {"errors": errors, "warnings": warnings,
            "tail": "\n".join(lines[-15:])[-1500:] if errors or warnings else None}


def _held_orders(metrics: dict[str, float] | None) -> int:
    """Orders issued less those cancelled: what a pull sink no agent leases from still holds."""
    if not metrics:
        return 0
    issued = sum(v for k, v in metrics.items() if k.startswith("kvprefetch_orders_issued_total"))
    cancelled = sum(v for k, v in metrics.items() if k.startswith("kvprefetch_orders_cancelled_total"))
    return int(issued - cancelled)


def _redis_memory(url: str) -> int | None:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        return int(client.info("memory")["used_memory"])
    except redis.RedisError:
        return None
    finally:
        client.close()


def _redis_clean(url: str, prefix: str) -> int:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=30)
    n = 0
    try:
        batch = []
        for key in client.scan_iter(match=f"{prefix}:*", count=5000):
            batch.append(key)
            if len(batch) >= 1000:
                n += client.unlink(*batch)
                batch = []
        if batch:
            n += client.unlink(*batch)
    finally:
        client.close()
    return n


def _ceiling_phase(workdir: Path, seconds: float, warmup: float, *, shards_kw: dict[str, Any],
                   load_kw: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    port = free_port()
    server = _Proc("ceiling", ["-m", "bench.load", "serve-ceiling", "--port", str(port)], workdir=workdir,
                   env={}, port=port)
    try:
        server.wait_ready("/healthz", headers)
        load = _Load(server.url, make_shards(**shards_kw), **load_kw)
        load.start()
        time.sleep(warmup)
        t0 = time.perf_counter()
        server_cpu0, own0 = _cpu_seconds(server.proc.pid), time.process_time()
        time.sleep(seconds)
        t1 = time.perf_counter()
        server_cpu1, own1 = _cpu_seconds(server.proc.pid), time.process_time()
        load.finish()
        out = load.window(t0, t1)
        out["seconds"] = round(t1 - t0, 2)
        out["server_cpu_percent"] = round(100 * (server_cpu1 - server_cpu0) / (t1 - t0), 1)
        out["client_cpu_percent"] = round(100 * (own1 - own0) / (t1 - t0), 1)
        out["errors"] = load.errors()
        return out
    finally:
        server.stop()


def run(
    *,
    duration_seconds: float = 120.0,
    warmup_seconds: float = 10.0,
    sessions: int = 3000,
    instances: int = 16,
    hbm_blocks: int = 2000,
    batch_size: int = 200,
    event_connections: int = 2,
    hint_connections: int = 2,
    store: str = "memory",
    fsync: bool = True,
    dedupe_max_ids: int | None = None,
    sample_seconds: float = 5.0,
    ceiling_seconds: float = 10.0,
    calibrate_sessions: int = 10_000,
    token: str | None = None,
    service_env: dict[str, str] | None = None,
    data_dir: Path | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    if store not in ("memory", "redis"):
        raise ValueError("store must be memory or redis")
    if min(duration_seconds, sample_seconds) <= 0 or warmup_seconds < 0 or ceiling_seconds < 0:
        raise ValueError("durations must be positive (warm-up and ceiling: zero or more)")
    if min(sessions, instances, hbm_blocks, batch_size, event_connections) < 1 or hint_connections < 0:
        raise ValueError("sessions, instances, hbm blocks, batch size and event connections must be at least 1")
    if instances < event_connections:
        raise ValueError("every event connection needs an instance of its own: instances >= event connections")
    if dedupe_max_ids is None and "KVP_DEDUPE_MAX_IDS" in (service_env or {}):
        dedupe_max_ids = int(service_env["KVP_DEDUPE_MAX_IDS"])  # type: ignore[index]
    bench_started = time.monotonic()
    headers = {"authorization": f"Bearer {token}"} if token else {}
    redis_url = os.environ.get("KVP_REDIS_URL", "redis://127.0.0.1:6379/0")
    prefix = f"kvp-bench-load-{uuid.uuid4().hex[:12]}"
    shards_kw = {"connections": event_connections, "sessions": sessions, "instances": instances,
                 "hbm_blocks": hbm_blocks, "seed": seed}
    load_kw = {"hint_connections": hint_connections, "batch_size": batch_size, "token": token, "seed": seed}
    config = {
        "duration_seconds": duration_seconds, "warmup_seconds": warmup_seconds, "sessions": sessions,
        "instances": instances, "hbm_blocks": hbm_blocks, "batch_size": batch_size,
        "event_connections": event_connections, "hint_connections": hint_connections, "store": store,
        "fsync": fsync, "dedupe_max_ids": dedupe_max_ids, "sample_seconds": sample_seconds,
        "ceiling_seconds": ceiling_seconds, "calibrate_sessions": calibrate_sessions,
        "token": "set" if token else None, "seed": seed, "mode": "closed-loop, full speed",
    }

    calibration = None
    if calibrate_sessions > 0:
        info(f"bench load: calibrating what state costs ({calibrate_sessions:,} sessions, 5 fresh processes)")
        calibration = _calibrate(calibrate_sessions, store, redis_url, dedupe_max_ids, seed + 7)
        info(f"  {calibration['bytes_per_session']:,.0f} B/session, {calibration['bytes_per_event_id']:,.0f} B/event id, "
             f"{calibration['bytes_per_resident_block']:,.0f} B/resident block, "
             f"{calibration['bytes_per_tombstone']:,.0f} B/tombstone, {calibration['bytes_per_held_order']:,.0f} B/held order")

    workdir = Path(tempfile.mkdtemp(prefix="kvp-bench-load-", dir=data_dir))
    ceiling: list[dict[str, Any]] = []
    ceiling_warmup = min(2.0, warmup_seconds)

    def ceiling_run(label: str) -> None:
        if ceiling_seconds <= 0:
            return
        info(f"bench load: ceiling phase ({label}), {ceiling_seconds:g} s")
        kw = dict(shards_kw, seed=seed + 100 + len(ceiling))
        result = _ceiling_phase(workdir, ceiling_seconds, ceiling_warmup, shards_kw=kw, load_kw=load_kw,
                                headers=headers)
        info(f"  ceiling: {result['event_batches']['events_per_second']:,.0f} events/s, "
             f"{result['route_hints']['requests_per_second']:,.0f} hints/s")
        ceiling.append(result)

    env = {
        "KVP_HOST": "127.0.0.1", "KVP_STORE": store, "KVP_DATA_DIR": str(workdir / "data"),
        "KVP_LOG_FSYNC": "true" if fsync else "false", "KVP_REPLICA_ID": "bench-load",
    }
    if store == "redis":
        env.update({"KVP_REDIS_URL": redis_url, "KVP_REDIS_PREFIX": prefix})
    if dedupe_max_ids is not None:
        env["KVP_DEDUPE_MAX_IDS"] = str(dedupe_max_ids)
    env.update(service_env or {})
    config["service_env"] = {k: (v if "TOKEN" not in k.upper() else "set") for k, v in sorted(env.items())
                             if k != "KVP_DATA_DIR"}

    service: _Proc | None = None
    load: _Load | None = None
    samples: list[dict[str, Any]] = []
    try:
        ceiling_run("before")
        port = free_port()
        service = _Proc("service", ["-m", "app.cli", "serve", "--port", str(port)], workdir=workdir, env=env,
                        port=port)
        info(f"bench load: service on {service.url} (store={store}, fsync={'on' if fsync else 'off'}), "
             f"data in {workdir}")
        service.wait_ready("/readyz", headers)
        startup_rss = _rss(service.proc.pid)
        shards = make_shards(**shards_kw)
        config["hint_candidates"] = "the instances of the session's shard: " + ", ".join(
            str(len(sh.instances)) for sh in shards)
        load = _Load(service.url, shards, **load_kw)
        pid = service.proc.pid
        redis_before = _redis_memory(redis_url) if store == "redis" else None

        def sample(t_rel: float) -> dict[str, Any]:
            ready = _readyz(service.url, headers) or {}
            return {"t": round(t_rel, 1), "perf": time.perf_counter(), "rss_bytes": _rss(pid),
                    "service_cpu_seconds": _cpu_seconds(pid), "client_cpu_seconds": time.process_time(),
                    "load_average_1m": _load_average(), "cpu_pressure_avg60": _cpu_pressure(),
                    "stats": ready.get("stats"),
                    "tombstones": sum(s.tombstone_count for s in shards)}

        load.start()
        info(f"bench load: warm-up {warmup_seconds:g} s, then {duration_seconds:g} s measured")
        time.sleep(warmup_seconds)
        start = sample(0.0)
        metrics_start = _metrics(service.url, headers)
        samples.append(start)
        t_start = start["perf"]
        end_at = t_start + duration_seconds
        while True:
            now = time.perf_counter()
            if now >= end_at:
                break
            if service.proc.poll() is not None:
                raise BenchError(f"the service exited with {service.proc.returncode} under load:\n{service.log_tail()}")
            time.sleep(min(sample_seconds - (now - t_start) % sample_seconds, end_at - now))
            s = sample(time.perf_counter() - t_start)
            samples.append(s)
            prev = samples[-2]
            w = load.window(prev["perf"], s["perf"])
            info(f"  t={s['t']:6.1f} s  rss {s['rss_bytes'] / 2**20:7.1f} MiB  "
                 f"{w['event_batches']['events_per_second']:8,.0f} events/s  "
                 f"{w['route_hints']['requests_per_second']:6,.0f} hints/s  "
                 f"p99 batch {w['event_batches']['latency_ms']['p99']} ms, hint {w['route_hints']['latency_ms']['p99']} ms")
        end = samples[-1]
        t_end = end["perf"]
        ready_end = _readyz(service.url, headers)
        metrics_end = _metrics(service.url, headers)
        redis_after = _redis_memory(redis_url) if store == "redis" else None
        load.finish()
        measured = load.window(t_start, t_end)
        errors = load.errors()
        service.stop()
        service_log = _log_summary(service.log_path)
        service = None
        ceiling_run("after")
    finally:
        if load is not None:
            load.finish()
        if service is not None:
            service.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        redis_keys_removed = _redis_clean(redis_url, prefix) if store == "redis" else None

    secs = t_end - t_start
    series = []
    for prev, s in zip([None, *samples], samples):
        stats = s["stats"] or {}
        entry: dict[str, Any] = {
            "t": s["t"], "rss_bytes": s["rss_bytes"],
            "sessions": stats.get("sessions"), "remembered_event_ids": stats.get("remembered_event_ids"),
            "resident_blocks": stats.get("resident_blocks"), "tombstones_sent": s["tombstones"],
            "load_average_1m": s["load_average_1m"],
        }
        if prev is not None:  # rates over the interval that ends here
            w = load.window(prev["perf"], s["perf"])
            dt = s["perf"] - prev["perf"]
            entry.update({
                "events_per_second": w["event_batches"]["events_per_second"],
                "route_hints_per_second": w["route_hints"]["requests_per_second"],
                "event_batch_p99_ms": w["event_batches"]["latency_ms"]["p99"],
                "route_hint_p99_ms": w["route_hints"]["latency_ms"]["p99"],
                "service_cpu_percent": round(100 * (s["service_cpu_seconds"] - prev["service_cpu_seconds"]) / dt, 1),
                "client_cpu_percent": round(100 * (s["client_cpu_seconds"] - prev["client_cpu_seconds"]) / dt, 1),
            })
        series.append(entry)
    start_stats, end_stats = start["stats"] or {}, end["stats"] or {}
    growth = {k: end_stats.get(k, 0) - start_stats.get(k, 0)
              for k in ("sessions", "remembered_event_ids", "resident_blocks")}
    memory: dict[str, Any] = {
        "rss_after_startup_bytes": startup_rss,
        "rss_start_bytes": start["rss_bytes"],
        "rss_end_bytes": end["rss_bytes"],
        "rss_peak_bytes": max(s["rss_bytes"] for s in samples),
        "rss_growth_bytes": end["rss_bytes"] - start["rss_bytes"],
        "store_stats_start": start_stats,
        "store_stats_end": end_stats,
        "tombstones_sent": {"start": start["tombstones"], "end": end["tombstones"]},
    }
    if redis_before is not None:
        memory["redis_used_memory_bytes"] = {"start": redis_before, "end": redis_after,
                                             "note": "the whole Redis server, not only this run's keys"}
    if calibration is not None:
        explained = {
            "sessions": round(max(0, growth["sessions"]) * calibration["bytes_per_session"]),
            "remembered_event_ids": round(max(0, growth["remembered_event_ids"]) * calibration["bytes_per_event_id"]),
            "resident_blocks": round(max(0, growth["resident_blocks"]) * calibration["bytes_per_resident_block"]),
        }
        explained_total = sum(explained.values())
        allowance = max(ALLOWANCE_MIN_BYTES, round(ALLOWANCE_SHARE * explained_total))
        bound = explained_total + allowance
        from app.core.config import Settings

        ids_cap = int(env.get("KVP_DEDUPE_MAX_IDS", Settings.model_fields["dedupe_max_ids"].default))
        tombstones = end["tombstones"] - start["tombstones"]
        tombstone_bytes = round(max(0, tombstones) * calibration["bytes_per_tombstone"])
        # The pull sink holds each order until an agent leases it, and this bench runs no agents.
        held = (_held_orders(metrics_end) - _held_orders(metrics_start)
                if env.get("KVP_ORDER_SINK", "pull") == "pull" else 0)
        held_bytes = round(max(0, held) * calibration["bytes_per_held_order"])
        memory["bound"] = {
            "rule": ("end RSS <= start RSS + growth of each store count x its measured cost "
                     f"+ allowance (max({ALLOWANCE_MIN_BYTES // 2**20} MiB, {ALLOWANCE_SHARE:.0%} of that))"),
            "unit_costs": calibration,
            "growth": growth,
            "explained_bytes": explained,
            "allowance_bytes": allowance,
            "bound_bytes": bound,
            "end_rss_limit_bytes": start["rss_bytes"] + bound,
            "within_bound": memory["rss_growth_bytes"] <= bound,
            "unexplained_growth_bytes": memory["rss_growth_bytes"] - explained_total,
            # Not in the bound, since no setting bounds them: the removal tombstones the store keeps
            # per block (counted by the client, which mirrors the store's rule) and the orders the
            # pull sink holds for agents that never come; priced like the rest.
            "outside_bound": {"tombstones": tombstones, "tombstone_bytes": tombstone_bytes,
                              "orders_held_by_pull_sink": held, "held_order_bytes": held_bytes},
            "unexplained_after_those_bytes": (memory["rss_growth_bytes"] - explained_total - tombstone_bytes
                                              - held_bytes),
            "dedupe_max_ids": ids_cap,
            "dedupe_ring_full_bytes": round(ids_cap * calibration["bytes_per_event_id"]),
        }
    ceilings = {kind: [c[kind][key] for c in ceiling]
                for kind, key in (("event_batches", "events_per_second"), ("route_hints", "requests_per_second"))}

    def ratio(kind: str, key: str) -> float | None:
        xs = ceilings[kind]
        if not xs or not measured[kind][key] or not sum(xs):
            return None
        return round(measured[kind][key] / (sum(xs) / len(xs)), 3)

    service_cpu = round(100 * (end["service_cpu_seconds"] - start["service_cpu_seconds"]) / secs, 1)
    client_cpu = round(100 * (end["client_cpu_seconds"] - start["client_cpu_seconds"]) / secs, 1)
    traffic = Counter[str]()
    for sh in load.shards:
        traffic.update(sh.events)
    return {
        "throughput": {
            "seconds": round(secs, 2),
            "event_batches": {k: measured["event_batches"][k]
                              for k in ("requests", "requests_per_second", "events", "events_per_second")},
            "route_hints": {k: measured["route_hints"][k] for k in ("requests", "requests_per_second")},
        },
        "latency_ms": {kind: measured[kind]["latency_ms"] for kind in KINDS},
        "errors": errors,
        "memory": memory,
        "cpu_percent": {"service": service_cpu, "client": client_cpu,
                        "note": "100 = one core; the client is this process (generation + HTTP)"},
        "ceiling": {
            "phases": ceiling,
            "ratio_to_ceiling": {"events_per_second": ratio("event_batches", "events_per_second"),
                                 "route_hints_per_second": ratio("route_hints", "requests_per_second")},
        },
        "series": series,
        "traffic": {
            "events_by_type": dict(sorted(traffic.items())),
            "sessions_started": sum(sh.sessions_started for sh in load.shards),
            "sessions_closed": sum(sh.sessions_closed for sh in load.shards),
            "sessions_abandoned": sum(sh.sessions_abandoned for sh in load.shards),
            "note": "the whole run, warm-up included",
        },
        "service_end": {"readyz": ready_end, "metrics": metrics_end, "log": service_log},
        "redis": {"prefix": prefix, "keys_removed": redis_keys_removed} if store == "redis" else None,
        "config": config,
        "environment": {**machine(),
                        "load_average_1m": {"start": start["load_average_1m"], "end": end["load_average_1m"]},
                        "cpu_pressure_avg60_percent": {"start": start["cpu_pressure_avg60"],
                                                       "end": end["cpu_pressure_avg60"]}},
        "bench_seconds": round(time.monotonic() - bench_started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="the child processes of `kvprefetch bench load`")
    sub = parser.add_subparsers(dest="cmd", required=True)
    ceiling = sub.add_parser("serve-ceiling")
    ceiling.add_argument("--port", type=int, required=True)
    cal = sub.add_parser("calibrate")
    cal.add_argument("--mode", choices=["sessions", "ids", "blocks", "tombstones", "orders"], required=True)
    cal.add_argument("--sessions", type=int, required=True)
    cal.add_argument("--store", choices=["memory", "redis"], default="memory")
    cal.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    cal.add_argument("--dedupe-max-ids", type=int, default=None)
    cal.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.cmd == "serve-ceiling":
        _serve_ceiling(args.port)
    else:
        print(json.dumps(_calibrate_worker(args.mode, args.sessions, args.store, args.redis_url,
                                           args.dedupe_max_ids, args.seed)))


if __name__ == "__main__":
    main()
