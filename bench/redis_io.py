"""The Redis store's hot calls the service's way (the store thread), through redis.asyncio, and
inline on the event loop.

On the real Redis (a database of the caller's choosing, every key under a prefix of this run's,
removed at the end), with the service's settings for the store (app.state.build_store), each of
the store's hot calls as the service makes them:

- `ingest_100`, `ingest_1000`: what Ingestor.ingest asks of the store for a batch of 100 or 1000
  new events of bench._util.Traffic: the dedupe read (`seen_and_newest`), the apply script
  (`apply`: its chunks pipelined, one round trip) and the checkpoint (`set_checkpoint`);
- `judge_1000`: the arrival judging of a 1000-event batch already applied
  (app.observe.outcomes.judge: its one residency read and its Python);
- `live_sessions_256`: a scoring tick's page (`live_sessions(256)` from one of the first pages,
  active within the advisor's MAX_IDLE_SECONDS).

Each is run these ways on one event loop (uvloop, as `serve` runs when it is installed, and the
service's garbage collector settings), the ingest calls by `callers` concurrent tasks, the way
the events route's several posts meet, the reads by one (the backlog's drain and the scoring
loop each make one at a time):

- `store_thread`: the service's way (docs/decisions.md, 16): the sync RedisStore's method on the
  one store thread, `await StoreThread.run(...)`, one job at a time;
- `asyncio`: redis.asyncio on the loop issuing exactly the same commands and scripts with the same
  arguments, one round trip after another, each awaited. Nothing here is a second store: the
  apply script's calls are the store's own (`_apply_calls`, `_apply_outcome`); every other round
  trip is recorded from the sync store beforehand (untimed) and sent again, and the store's own
  code then turns the replies into its answer (a client that answers it from them, checking it
  asks exactly what was sent). The ingest calls take an asyncio.Lock, as the Ingestor's lock
  keeps the log's order the apply order; the reads run side by side on the client's pool;
- `asyncio_c_pack`: the same, the client packing commands with hiredis (C) as the sync client
  does when hiredis is installed; redis.asyncio packs them in Python, argument by argument, and
  the store's calls carry thousands (the apply script call of 1000 events here: ~9,600);
- `inline`: the sync store called on the loop (the floor: it blocks the loop for every call).

Rounds interleave the four (their order rotating), each on fresh events; figures are medians
over rounds: calls/s (events/s for ingest) and the event loop's lag while each ran, from a ticker
task that sleeps 1 ms and notes its oversleep (median, p99 and max over every round's ticks),
beside the lag of the idle loop. Every path's every answer is checked: each ingest applies each
of its events (none seen before), and the reads answer the same on every path; at the end every
event posted on any path is found applied.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench._util import BenchError, Traffic, info, machine, median

OPS = ("ingest_100", "ingest_1000", "judge_1000", "live_sessions_256")
PATHS = ("store_thread", "asyncio", "asyncio_c_pack", "inline")
ASYNC_PATHS = ("asyncio", "asyncio_c_pack")
PAGE_SESSIONS = 256
TICK_SECONDS = 0.001
IDLE_SECONDS = 0.3
REPLICA = "bench-redis-io"


@dataclass
class _Trip:
    """One round trip: a command, or a pipeline's commands; each (args, options) as redis-py
    queues them, so that redis.asyncio sends the very same."""

    commands: list[tuple[tuple[Any, ...], dict[str, Any]]]
    pipeline: bool
    raise_on_error: bool = True


def _recording_client_class() -> type[Any]:
    import redis

    class RecordingPipeline(redis.client.Pipeline):
        owner: Any

        def execute(self, raise_on_error: bool = True) -> list[Any]:
            stack = list(self.command_stack)
            replies = super().execute(raise_on_error)
            self.owner.trips.append(_Trip(stack, True, raise_on_error))
            return replies

    class Recording(redis.Redis):
        """A sync client that notes each round trip it makes (`trips`)."""

        trips: list[_Trip]

        def execute_command(self, *args: Any, **options: Any) -> Any:
            reply = super().execute_command(*args, **options)
            self.trips.append(_Trip([(args, options)], False))
            return reply

        def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
            assert not transaction  # the store never asks for MULTI
            pipe = RecordingPipeline(self.connection_pool, self.response_callbacks, False, None)
            pipe.owner = self
            return pipe

    return Recording


def _answering_client_class() -> type[Any]:
    import redis

    class AnsweringPipeline(redis.client.Pipeline):
        owner: Any

        def execute(self, raise_on_error: bool = True) -> list[Any]:
            stack = list(self.command_stack)
            self.reset()
            return list(self.owner.answer(stack, True))

    class Answering(redis.Redis):
        """A sync client that sends nothing: it answers each round trip from `load`ed replies,
        and checks that each is exactly the round trip they answer."""

        def load(self, trips: list[_Trip], replies: list[Any]) -> None:
            self._queue = list(zip(trips, replies))
            self._queue.reverse()

        def answer(self, commands: list[tuple[tuple[Any, ...], dict[str, Any]]], pipe: bool) -> Any:
            trip, reply = self._queue.pop()
            if trip.pipeline != pipe or [c[0] for c in trip.commands] != [c[0] for c in commands]:
                raise BenchError("the store asked other commands than those sent (replay)")
            return reply

        def done(self) -> None:
            if self._queue:
                raise BenchError(f"{len(self._queue)} round trips sent and never asked for")

        def execute_command(self, *args: Any, **options: Any) -> Any:
            return self.answer([(args, options)], False)

        def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
            pipe = AnsweringPipeline(self.connection_pool, self.response_callbacks, False, None)
            pipe.owner = self
            return pipe

    return Answering


def _c_packing_connection_class() -> type[Any]:
    import hiredis
    import redis.asyncio

    class CPacking(redis.asyncio.Connection):
        """Packs commands with hiredis, in C, as the sync client does when hiredis is installed
        (redis.asyncio packs them in Python, argument by argument)."""

        def pack_command(self, *args: Any) -> list[bytes]:
            if isinstance(args[0], str):  # 'SCRIPT LOAD': its words sent apart, as redis-py does
                args = tuple(args[0].encode().split()) + args[1:]
            return [hiredis.pack_command(args)]

    return CPacking


async def _send(aclient: Any, trips: list[_Trip]) -> list[Any]:
    """Each round trip through redis.asyncio, one after another; their replies."""
    replies = []
    for trip in trips:
        if trip.pipeline:
            pipe = aclient.pipeline(transaction=False)
            for args, options in trip.commands:
                pipe.execute_command(*args, **options)
            replies.append(await pipe.execute(raise_on_error=trip.raise_on_error))
        else:
            ((args, options),) = trip.commands
            replies.append(await aclient.execute_command(*args, **options))
    return replies


class _Ticker:
    """Sleeps TICK_SECONDS over and over on the loop and notes how late each wake-up was."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(TICK_SECONDS)
            self.lags.append(time.perf_counter() - t0 - TICK_SECONDS)

    def __enter__(self) -> _Ticker:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


@dataclass
class _Call:
    """One call: fn(store); `key` checks its answer (ingest: its events' count; a read: which
    of the few distinct reads it is); an ingest's batch and log position."""

    fn: Callable[[Any], Any]
    key: int
    events: list[Any] | None = None
    position: Any = None


@dataclass
class _Figures:
    seconds: list[float] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)  # every tick's, over the rounds
    calls: int = 0
    events: int = 0


class _Bench:
    def __init__(self, url: str, prefix: str, callers: int, seed: int) -> None:
        import redis
        import redis.asyncio

        from app.api.batch import BatchParser
        from app.core.cluster import ClusterSpec
        from app.core.config import Settings
        from app.state import build_store
        from app.state.redis import RedisStore
        from app.state.storethread import StoreThread

        self.settings = Settings(store="redis", redis_url=url, redis_prefix=prefix)
        store = build_store(self.settings)
        assert isinstance(store, RedisStore)
        self.store = store
        self.cluster = ClusterSpec.from_settings(self.settings)
        self.callers = callers
        self.traffic = Traffic(seed=seed)
        self.parser = BatchParser(1000)
        self.thread = StoreThread(offload=True)
        timeout = self.settings.redis_timeout_seconds

        def twin(cls: type[Any]) -> tuple[Any, RedisStore]:
            """A client of another class, and a RedisStore like the service's over it."""
            client = cls.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout, decode_responses=True
            )
            return client, RedisStore(
                client,
                prefix=prefix,
                bytes_per_token=store.bytes_per_token,
                block_tokens=store.block_tokens,
                dedupe_ttl_seconds=store.dedupe_ttl_seconds,
                reorder_window_seconds=store.reorder_window_seconds,
                session_retention_seconds=store.session_retention_seconds,
            )

        self.recording, self.recorder = twin(_recording_client_class())
        # One answering store per caller: each replays its own call's round trips.
        self.answering = [twin(_answering_client_class()) for _ in range(callers)]
        self.aclients = {
            "asyncio": redis.asyncio.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout, decode_responses=True
            ),
            "asyncio_c_pack": redis.asyncio.Redis.from_url(
                url,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                decode_responses=True,
                connection_class=_c_packing_connection_class(),
            ),
        }
        self.ingest_lock = asyncio.Lock()
        self.position = 0
        self.posted: list[str] = []
        self.figures = {(op, path): _Figures() for op in OPS for path in PATHS}
        self.idle_lags: list[float] = []
        self.judged: list[list[Any]] = []  # recent applied 1000-event batches, for the judging
        self.checked: dict[tuple[str, int], Any] = {}

    # -- work ----------------------------------------------------------------------------------

    def batches(self, n: int, size: int) -> list[list[Any]]:
        return [self.parser.parse(body).events for body in self.traffic.batches(n, size)]

    def ingest(self, store: Any, events: list[Any], position: Any) -> list[bool]:
        """What Ingestor.ingest asks of the store for a batch of new events."""
        seen, _ = store.seen_and_newest([e.event_id for e in events])
        if any(seen):
            raise BenchError("an event of a fresh batch was seen before")
        applied: list[bool] = store.apply(events)
        store.set_checkpoint(REPLICA, position)
        return applied

    def record(self, fn: Callable[[Any], Any]) -> tuple[list[_Trip], Any]:
        """fn(store) on the recording store: the round trips it made, and its answer."""
        trips: list[_Trip] = []
        self.recording.trips = trips
        answer = fn(self.recorder)
        return trips, answer

    async def replayed(
        self, path: str, k: int, trips: list[_Trip], fn: Callable[[Any], Any]
    ) -> Any:
        """The round trips sent with redis.asyncio, then fn(store) answered from the replies."""
        client, store = self.answering[k]
        client.load(trips, await _send(self.aclients[path], trips))
        answer = fn(store)
        client.done()
        return answer

    # -- segments ------------------------------------------------------------------------------

    def calls(self, op: str, calls: int) -> tuple[list[_Call], int]:
        """The segment's calls, and the events they post."""
        from app.decide.advisor import MAX_IDLE_SECONDS
        from app.observe.outcomes import judge
        from app.state.base import LogPosition, cursor_of

        if op.startswith("ingest_"):
            batches = self.batches(calls, int(op.rsplit("_", 1)[1]))
            out = []
            for b in batches:
                self.position += 1
                p = LogPosition(0, self.position)

                def ingest(s: Any, b: list[Any] = b, p: LogPosition = p) -> list[bool]:
                    return self.ingest(s, b, p)

                out.append(_Call(ingest, len(b), b, p))
                self.posted += (e.event_id for e in b)
            if op == "ingest_1000":
                self.judged = batches[-4:]
            return out, sum(map(len, batches))
        distinct: list[_Call] = []
        if op == "judge_1000":
            for i, b in enumerate(self.judged):

                def judged(s: Any, b: list[Any] = b) -> Any:
                    return judge(s, b, self.cluster)

                distinct.append(_Call(judged, i))
        else:
            # The first few pages, as a scoring tick walks them.
            since = self.traffic.ts - MAX_IDLE_SECONDS
            before = None
            for i in range(4):

                def page_of(s: Any, before: Any = before) -> Any:
                    return s.live_sessions(PAGE_SESSIONS, before=before, active_since_ts=since)

                distinct.append(_Call(page_of, i))
                page = page_of(self.store)
                if len(page) < PAGE_SESSIONS:
                    break
                before = cursor_of(page[-1])
        return [distinct[i % len(distinct)] for i in range(calls)], 0

    def check(self, op: str, path: str, key: int, answer: Any) -> None:
        if op.startswith("ingest_"):
            if len(answer) != key or not all(answer):
                raise BenchError(f"{op} on {path}: {answer.count(False)} events not applied")
        elif self.checked.setdefault((op, key), answer) != answer:
            raise BenchError(f"{op} on {path} answered otherwise than the other paths")

    async def segment(self, op: str, path: str, calls: int) -> None:
        fns, events = self.calls(op, calls)
        store, thread = self.store, self.thread
        # The asyncio paths' round trips, recorded beforehand: a read's; an ingest's dedupe
        # read (before its batch is applied) and checkpoint write (made again when sent).
        plans: list[Any] = []
        if path in ASYNC_PATHS:
            for c in fns:
                if c.events is not None:
                    ids, p = [e.event_id for e in c.events], c.position

                    def dedupe(s: Any, ids: list[str] = ids) -> Any:
                        return s.seen_and_newest(ids)

                    def checkpoint(s: Any, p: Any = p) -> None:
                        s.set_checkpoint(REPLICA, p)

                    seen, _ = self.record(dedupe)
                    ckpt, _ = self.record(checkpoint)
                    plans.append((seen, ckpt, c.events, p))
                else:
                    plans.append(self.record(c.fn)[0])
        todo = iter(range(len(fns)))

        async def caller(k: int) -> None:
            for n in todo:
                fn, key = fns[n].fn, fns[n].key
                if path == "inline":
                    answer = fn(store)
                elif path == "store_thread":
                    answer = await thread.run(fn, store)
                elif fns[n].events is not None:
                    answer = await self.ingest_async(path, k, *plans[n])
                else:
                    answer = await self.replayed(path, k, plans[n], fn)
                self.check(op, path, key, answer)
                # A request's handler gives the loop back between calls: inline, the ticker
                # then sees each call's hold, not the whole segment's.
                await asyncio.sleep(0)

        with _Ticker() as ticker:
            t0 = time.perf_counter()
            # The route's several posts meet on the loop; the judging (the backlog's drain) and
            # a scoring tick each come one at a time.
            callers = self.callers if op.startswith("ingest_") else 1
            await asyncio.gather(*(caller(k) for k in range(callers)))
            seconds = time.perf_counter() - t0
        f = self.figures[(op, path)]
        f.seconds.append(seconds)
        f.lags += ticker.lags
        f.calls, f.events = len(fns), events

    async def ingest_async(
        self,
        path: str,
        k: int,
        seen_trips: list[_Trip],
        ckpt_trips: list[_Trip],
        events: list[Any],
        p: Any,
    ) -> list[bool]:
        """ingest() through redis.asyncio: the same three round trips, the apply script's calls
        the store's own."""
        store = self.store
        async with self.ingest_lock:
            seen, _ = await self.replayed(
                path, k, seen_trips, lambda s: s.seen_and_newest([e.event_id for e in events])
            )
            if any(seen):
                raise BenchError("an event of a fresh batch was seen before")
            calls, sizes = store._apply_calls(events)
            pipe = self.aclients[path].pipeline(transaction=False)
            for args in calls:
                pipe.evalsha(store._apply_script.sha, 0, *args)
            applied = store._apply_outcome(await pipe.execute(raise_on_error=False), sizes)
            await self.replayed(path, k, ckpt_trips, lambda s: s.set_checkpoint(REPLICA, p))
        return applied

    async def idle(self) -> None:
        with _Ticker() as ticker:
            await asyncio.sleep(IDLE_SECONDS)
        self.idle_lags += ticker.lags

    def check_all_applied(self) -> int:
        seen = []
        for i in range(0, len(self.posted), 10_000):
            seen += self.store.seen(self.posted[i : i + 10_000])
        if not all(seen):
            raise BenchError(f"{seen.count(False)} events posted were not applied")
        return len(seen)

    def close(self) -> None:
        self.thread.close()
        self.recorder.close()
        for _, s in self.answering:
            s.close()
        self.store.close()


def _calls(op: str, events: int, reads: int) -> int:
    return max(1, events // int(op.rsplit("_", 1)[1])) if op.startswith("ingest_") else reads


async def _run(
    url: str, prefix: str, rounds: int, events: int, reads: int, callers: int, seed: int
) -> dict[str, Any]:
    bench = _Bench(url, prefix, callers, seed)
    try:
        # A round not counted: scripts loaded, connections made, state to read.
        for op in OPS:
            bench.checked.clear()
            for path in PATHS:
                await bench.segment(op, path, min(2, _calls(op, events, reads)))
        for f in bench.figures.values():
            f.seconds, f.lags = [], []
        for r in range(rounds):
            await bench.idle()
            order = PATHS[r % len(PATHS) :] + PATHS[: r % len(PATHS)]
            for op in OPS:
                bench.checked.clear()  # the reads of a round all see the state its ingest left
                for path in order:
                    await bench.segment(op, path, _calls(op, events, reads))
            info(f"round {r + 1}/{rounds} done")
        applied = bench.check_all_applied()
    finally:
        bench.close()
        for aclient in bench.aclients.values():
            await aclient.aclose()

    ops: dict[str, Any] = {}
    for op in OPS:
        per: dict[str, Any] = {}
        for path in PATHS:
            f = bench.figures[(op, path)]
            row: dict[str, Any] = {
                "calls": f.calls,
                "calls_per_second": round(median([f.calls / s for s in f.seconds]), 1),
                "ms_per_call": _ms(median([s / f.calls for s in f.seconds])),
                "loop_lag_ms": _lag(f.lags),
            }
            if f.events:
                row["events"] = f.events
                row["events_per_second"] = round(median([f.events / s for s in f.seconds]))
            per[path] = row
        # Same-round ratios: each round's three figures met the same machine.
        base = bench.figures[(op, "store_thread")].seconds
        for path in PATHS[1:]:
            per[path]["speed_vs_store_thread"] = round(
                median([b / s for b, s in zip(base, bench.figures[(op, path)].seconds)]), 3
            )
        ops[op] = per
    return {
        "rounds": rounds,
        "callers": callers,
        "read_callers": 1,
        "events_applied": applied,
        "idle_loop_lag_ms": _lag(bench.idle_lags),
        "tick_ms": TICK_SECONDS * 1e3,
        "ops": ops,
    }


def _ms(x: float) -> float:
    return round(x * 1e3, 3)


def _lag(lags: list[float]) -> dict[str, float]:
    """The ticks' oversleep: median, 99th percentile and max, ms (a call holding the loop for
    longer than a tick shows as one long tick: fewer ticks, each late)."""
    if not lags:  # a loop held throughout: no tick came back
        return {"ticks": 0, "median": math.nan, "p99": math.nan, "max": math.nan}
    xs = sorted(lags)
    return {
        "ticks": len(xs),
        "median": _ms(statistics.median(xs)),
        "p99": _ms(xs[min(len(xs) - 1, int(0.99 * len(xs)))]),
        "max": _ms(xs[-1]),
    }


def run(
    *,
    redis_url: str = "redis://127.0.0.1:6379",
    db: int = 0,
    rounds: int = 5,
    events: int = 8000,
    reads: int = 16,
    callers: int = 4,
    seed: int = 0,
) -> dict[str, Any]:
    """The figures of the module's docstring; BenchError when Redis does not answer."""
    import os

    import redis

    from app.core.runtime import tune_gc

    runner: Callable[[Any], Any] = asyncio.run
    loop_name = "asyncio"
    try:
        import uvloop

        runner, loop_name = uvloop.run, "uvloop"
    except ImportError:  # the service runs on asyncio's own loop then too
        pass

    url = f"{redis_url.rstrip('/')}/{db}"
    probe = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        server = probe.info("server")
    except redis.RedisError as exc:
        raise BenchError(
            f"Redis did not answer at {url}: {exc}. Start it with "
            "`redis-server --daemonize yes --port 6379 --save ''` or pass --redis-url."
        ) from None
    finally:
        probe.close()
    prefix = f"kvp-bench-redis-io-{uuid.uuid4().hex[:12]}"
    info(f"bench redis-io: {url}, keys under {prefix}:*")
    # The service's garbage collector settings (app.core.runtime): its full collections, not the
    # default's, are what the loop meets.
    tune_gc()
    load_before = os.getloadavg()
    try:
        result = runner(_run(url, prefix, rounds, events, reads, callers, seed))
    finally:
        removed = _remove(url, prefix)
    return {
        "redis": {
            "url": url,
            "version": server.get("redis_version"),
            "prefix": prefix,
            "keys_removed": removed,
        },
        "loop": loop_name,
        "events_per_ingest_segment": events,
        "reads_per_segment": reads,
        **result,
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "machine": machine(),
    }


def _remove(url: str, prefix: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    removed = 0
    try:
        batch: list[Any] = []
        for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            batch.append(key)
            if len(batch) >= 500:
                removed += client.unlink(*batch)
                batch.clear()
        if batch:
            removed += client.unlink(*batch)
    finally:
        client.close()
    return removed
