"""Keeping a blocking store off the event loop (docs/decisions.md, 16).

The Redis store is synchronous redis-py: a Redis that hangs holds each call for up to
KVP_REDIS_TIMEOUT_SECONDS. On the event loop that would stall every route, /healthz included.

`StoreThread` runs the work that touches such a store, and the planning-side state that work
shares (ingestion, the backlog's observers, the scoring and planning ticks, the dashboard's
figures), on one thread of its own, one job at a time: the same one-at-a-time order the loop
gave them, so nothing they share needs a lock. With the memory store (`offload=False`) a job runs
inline on the loop, as before: nothing there blocks, and a thread hop per batch costs more than
it saves (entry 5).

A job that was waiting its turn while the job before it found the store unavailable is refused at
once with StoreUnavailable, without touching the store: a hung Redis costs a queued request one
timeout, not one per request ahead of it.

`StoreHealth` is the store's last known health and counts, refreshed in the background on a
thread of its own (never queued behind ingestion), for /readyz, /metrics and the dashboard.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from app.core.errors import StoreError, StoreUnavailable
from app.state.base import StateStore

log = logging.getLogger(__name__)

T = TypeVar("T")

# StoreThread.run, as the loops take it: `await offload(fn, *args)`.
Offload = Callable[..., Awaitable[Any]]


class StoreThread:
    def __init__(self, *, offload: bool) -> None:
        self.offload = offload
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvp-store") if offload else None
        # time.monotonic() when a job last raised StoreUnavailable, and when the job running now
        # started (None: idle); only the store thread writes them.
        self._unavailable_at = -math.inf
        self._unavailable_because = ""
        self._running_since: float | None = None

    def stuck_seconds(self) -> float:
        """How long the job running now has run (0 when idle or inline): a store that hangs shows
        here first."""
        since = self._running_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    async def run(self, fn: Callable[..., T], *args: Any, fail_fast: bool = True) -> T:
        """`fn(*args)` on the store thread (inline without offload), its result or its exception.
        `fail_fast=False` for work that must run even after the store failed (it catches its
        store errors itself, or needs no store)."""
        if self._executor is None:
            return fn(*args)
        return await asyncio.wrap_future(self._submit(fn, args, fail_fast))

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` that only reads the store (no planning-side state): on a thread of the
        default pool, beside the store thread (redis-py's client is thread-safe); inline without
        offload (the memory store is the loop's alone)."""
        if self._executor is None:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)

    def _submit(self, fn: Callable[..., T], args: tuple[Any, ...], fail_fast: bool) -> Future[T]:
        assert self._executor is not None
        return self._executor.submit(
            self._job, time.monotonic() if fail_fast else math.inf, fn, args
        )

    async def run_within(
        self, wait_seconds: float, fn: Callable[..., T], *args: Any, fail_fast: bool = True
    ) -> tuple[bool, T | None]:
        """Like run(), waiting at most `wait_seconds`: (True, result), or (False, None) when the
        job is not done by then (it still runs, in its turn)."""
        if self._executor is None:
            return True, fn(*args)
        future = asyncio.wrap_future(self._submit(fn, args, fail_fast))
        done, _ = await asyncio.wait({future}, timeout=wait_seconds)
        if not done:
            # Its outcome, when it comes, is nobody's: retrieved so asyncio does not log it.
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
            return False, None
        return True, future.result()

    def _job(self, submitted: float, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        if self._unavailable_at > submitted:
            # What the store said to the job that found it away: the same answer, one timeout.
            raise StoreUnavailable(self._unavailable_because)
        self._running_since = time.monotonic()
        try:
            return fn(*args)
        except StoreUnavailable as exc:
            self._unavailable_because = str(exc)
            self._unavailable_at = time.monotonic()
            raise
        finally:
            self._running_since = None

    def close(self) -> None:
        """Wait for the jobs queued, then stop the thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)


@dataclass(frozen=True, slots=True)
class StoreSnapshot:
    """What the last probe found: `ok` (the store answered), its counts (those of the last probe
    that answered: empty before any did), and when, by time.monotonic()."""

    ok: bool
    stats: dict[str, int] = field(default_factory=dict)
    # When the last probe ended, and when the counts were read (-inf: never).
    checked_at: float = -math.inf
    stats_at: float = -math.inf
    problem: str | None = None

    def stats_age_seconds(self, now: float) -> float | None:
        return None if math.isinf(self.stats_at) else max(0.0, now - self.stats_at)


class StoreHealth:
    """The store's health and counts as last probed (ping, then stats()).

    `refresh(wait)` starts a probe unless one is running and waits at most `wait` seconds for it;
    `run(interval)` refreshes in the background. With `offload` the probe runs on a thread of its
    own (redis-py's client is thread-safe), so no probe waits behind ingestion and no caller waits
    longer than it asked; without, it runs inline (the memory store answers at once)."""

    def __init__(
        self, store: StateStore, *, offload: bool, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self.store = store
        self.monotonic = monotonic
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvp-probe") if offload else None
        self._lock = threading.Lock()
        self._last = StoreSnapshot(ok=False, problem="not probed yet")
        self._probing: asyncio.Future[StoreSnapshot] | None = None

    @property
    def last(self) -> StoreSnapshot:
        return self._last

    def probe(self) -> StoreSnapshot:
        """Ping the store and read its counts, now, on the calling thread."""
        try:
            self.store.ping()
            stats = self.store.stats()
        except StoreError as exc:
            now = self.monotonic()
            with self._lock:
                self._last = StoreSnapshot(
                    ok=False,
                    stats=self._last.stats,
                    checked_at=now,
                    stats_at=self._last.stats_at,
                    problem=str(exc),
                )
        else:
            now = self.monotonic()
            with self._lock:
                self._last = StoreSnapshot(ok=True, stats=stats, checked_at=now, stats_at=now)
        return self._last

    async def refresh(self, wait_seconds: float | None) -> StoreSnapshot | None:
        """The snapshot of a probe that ends within `wait_seconds` (None: however long it takes),
        or None when the store did not answer by then (`last` is what it said before)."""
        if self._executor is None:
            return self.probe()
        if self._probing is None or self._probing.done():
            self._probing = asyncio.get_running_loop().run_in_executor(self._executor, self.probe)
        # This caller's probe: by the time it ends another caller may have started the next.
        probing = self._probing
        if wait_seconds is None:
            return await asyncio.shield(probing)
        done, _ = await asyncio.wait({probing}, timeout=wait_seconds)
        return probing.result() if done else None

    async def run(self, interval_seconds: float) -> None:
        while True:
            try:
                await self.refresh(None)
            except Exception:  # a failed probe costs one reading, never the probing
                log.exception("store probe failed")
            await asyncio.sleep(interval_seconds)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
