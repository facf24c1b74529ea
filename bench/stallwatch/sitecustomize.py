"""Loaded by every Python process started with this directory on PYTHONPATH; active only in
`kvprefetch serve` (`python -m kvprefetch_cli serve`) with STALLWATCH_OUT set (not a KVP_
variable: the e2e tests pass the environment on without those).

It notes, in STALLWATCH_OUT/service-<pid>.json (rewritten every second and at exit):
- stalls: when a thread of its own, doing nothing but sleep 1 ms, woke more than 30 ms late
  (time.monotonic() of the sleep, ms late): the whole process stopped, not just the event loop;
- gc: each collection over 10 ms (start, ms, generation, thread);
- sched: every 20 ms, the main thread's (the event loop's) CPU time and time spent waiting on the
  kernel's run queue, from /proc/self/task/<pid>/schedstat (ns): a process that waited there was
  kept off the CPU by others;
- holds: each time the event loop was held more than 40 ms (start, ms, what ran): a heartbeat task
  on the loop (`asyncio.Runner.run` wrapped) notes the time every 5 ms, and while it is late a
  thread samples the main thread's stack every 2 ms (the innermost three frames of each sample,
  counted). The sampler needs the GIL, so code that holds it (the collector, C calls that keep
  it) shows in fewer samples than it took: read the counts as what ran, not as shares. The
  start-up, before the loop first runs, shows as one long hold of imports.

`python -m bench.stallwatch DIR` reads them beside the hung-Redis test's poller (see there).
"""

from __future__ import annotations

import asyncio
import asyncio.runners
import atexit
import collections
import gc
import json
import os
import sys
import threading
import time
from typing import Any

_OUT = os.environ.get("STALLWATCH_OUT")
HEARTBEAT_SECONDS = 0.005
HOLD_SECONDS = 0.04
_SKIP = ("/asyncio/", "/threading.py", "stallwatch")


def _frames(frame: Any, depth: int = 3) -> str:
    """The innermost `depth` frames outside asyncio and this module, outermost first."""
    out: list[str] = []
    while frame is not None and len(out) < depth:
        name = frame.f_code.co_filename
        if not any(s in name for s in _SKIP):
            out.append(f"{frame.f_code.co_qualname}@{os.path.basename(name)}:{frame.f_lineno}")
        frame = frame.f_back
    return " > ".join(reversed(out))


def _watch_the_loop(holds: list[tuple[float, float, list[tuple[str, int]]]]) -> None:
    """Wraps asyncio.Runner.run (uvicorn's way into the loop) with a heartbeat task, and starts
    the thread that samples the main thread while the heartbeat is late."""
    beat = [time.monotonic()]
    main_id = threading.main_thread().ident
    run = asyncio.runners.Runner.run

    def wrapped_run(self: Any, coro: Any, **kw: Any) -> Any:
        async def with_heartbeat() -> Any:
            async def heartbeat() -> None:
                while True:
                    beat[0] = time.monotonic()
                    await asyncio.sleep(HEARTBEAT_SECONDS)

            task = asyncio.ensure_future(heartbeat())
            try:
                return await coro
            finally:
                task.cancel()

        return run(self, with_heartbeat(), **kw)

    asyncio.runners.Runner.run = wrapped_run  # type: ignore[method-assign]

    def sample() -> None:
        while True:
            time.sleep(0.002)
            since = beat[0]
            if time.monotonic() - since < HOLD_SECONDS:
                continue
            seen: collections.Counter[str] = collections.Counter()
            while beat[0] == since:
                frame = sys._current_frames().get(main_id or 0)
                if frame is not None:
                    seen[_frames(frame)] += 1
                time.sleep(0.002)
            holds.append((round(since, 4), round((beat[0] - since) * 1e3, 1), seen.most_common(5)))

    threading.Thread(target=sample, name="stallwatch-loop", daemon=True).start()


def _start(out: str) -> None:
    pid = os.getpid()
    stalls: list[tuple[float, float]] = []
    pauses: list[tuple[float, float, int, str]] = []
    sched: list[tuple[float, int, int]] = []
    holds: list[tuple[float, float, list[tuple[str, int]]]] = []

    def schedstat() -> tuple[int, int]:
        try:
            with open(f"/proc/self/task/{pid}/schedstat") as f:
                ran, waited, _ = f.read().split()
        except OSError:  # not Linux: no run-queue figures
            return 0, 0
        return int(ran), int(waited)

    def watch() -> None:
        n = 0
        while True:
            t0 = time.monotonic()
            time.sleep(0.001)
            late = time.monotonic() - t0 - 0.001
            if late > 0.03:
                stalls.append((round(t0, 4), round(late * 1e3, 1)))
            n += 1
            if n % 20 == 0:
                sched.append((round(time.monotonic(), 4), *schedstat()))

    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.monotonic()
            return
        took = time.monotonic() - started[0]
        if took > 0.01:
            name = threading.current_thread().name
            pauses.append((round(started[0], 4), round(took * 1e3, 1), info["generation"], name))

    def dump() -> None:
        with open(os.path.join(out, f"service-{pid}.json"), "w") as f:
            json.dump({"stalls": stalls, "gc": pauses, "sched": sched, "holds": holds}, f)

    def every_second() -> None:
        while True:
            time.sleep(1.0)
            dump()

    gc.callbacks.append(on_gc)
    _watch_the_loop(holds)
    atexit.register(dump)
    threading.Thread(target=watch, name="stallwatch", daemon=True).start()
    threading.Thread(target=every_second, name="stallwatch-dump", daemon=True).start()


# At this point `python -m kvprefetch_cli serve --port N` reads ['-m', 'serve', '--port', 'N'].
if _OUT and "serve" in sys.argv:
    _start(_OUT)
