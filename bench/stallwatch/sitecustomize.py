"""Loaded by every Python process started with this directory on PYTHONPATH; active only in
`kvprefetch serve` (`python -m app.cli serve`) with STALLWATCH_OUT set (not a KVP_ variable: the
e2e tests pass the environment on without those).

It notes, in STALLWATCH_OUT/service-<pid>.json (rewritten every second and at exit):
- stalls: when a thread of its own, doing nothing but sleep 1 ms, woke more than 30 ms late
  (time.monotonic() of the sleep, ms late): the whole process stopped, not just the event loop;
- gc: each collection over 10 ms (start, ms, generation, thread);
- sched: every 20 ms, the main thread's (the event loop's) CPU time and time spent waiting on the
  kernel's run queue, from /proc/self/task/<pid>/schedstat (ns): a process that waited there was
  kept off the CPU by others.

`python -m bench.stallwatch DIR` reads them beside the hung-Redis test's poller (see there).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import threading
import time
from typing import Any

_OUT = os.environ.get("STALLWATCH_OUT")


def _start(out: str) -> None:
    pid = os.getpid()
    stalls: list[tuple[float, float]] = []
    pauses: list[tuple[float, float, int, str]] = []
    sched: list[tuple[float, int, int]] = []

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
            json.dump({"stalls": stalls, "gc": pauses, "sched": sched}, f)

    def every_second() -> None:
        while True:
            time.sleep(1.0)
            dump()

    gc.callbacks.append(on_gc)
    atexit.register(dump)
    threading.Thread(target=watch, name="stallwatch", daemon=True).start()
    threading.Thread(target=every_second, name="stallwatch-dump", daemon=True).start()


# At this point `python -m app.cli serve --port N` reads ['-m', 'serve', '--port', 'N'].
if _OUT and "serve" in sys.argv:
    _start(_OUT)
