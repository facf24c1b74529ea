"""Where the time of POST /v1/events goes, batch of 1000 by batch of 1000.

    python -m bench.profile_ingest stages   [--batches 60] [--no-fsync]
    python -m bench.profile_ingest cprofile [--batches 200] [--no-fsync] [--top 25]
                                            [--out FILE.pstats]
    python -m bench.profile_ingest observers [--batches 200] [--no-fsync]

`stages` times each step of the ingest path in-process with perf_counter, no profiler (so pure
Python code is not inflated): parse (app.api.batch.BatchParser.parse), dedupe (the in-batch set and
MemoryStore.seen, as Ingestor.ingest does them), log encode (encode_events), log write+flush,
fsync, apply (MemoryStore.apply), response encode (the route's orjson.dumps), and a real
Ingestor.ingest on the same kind of batches as a cross-check of the sum. Medians per batch; the
collector's thresholds as `serve` sets them.

`cprofile` runs the real service (create_app, memory store, event log in a temp dir) in this
process under cProfile, uvicorn on the asyncio loop (so the loop's idle wait is visible as
epoll.poll; `serve` would pick uvloop), while a client subprocess posts batches of 1000 over
HTTP with keep-alive. It prints the breakdown of the server's busy time by step and the top
functions. Profiling inflates Python-heavy steps (apply, the framework) relative to C ones
(pydantic, orjson, fsync): read it next to `stages`. The server's GC is tuned as `serve` tunes
it (app/core/runtime.py, `tune_gc`).

`observers` builds the service's Engine (every ingest observer, the memory store, the event log
in a temp dir; no loops, no HTTP) and times, with perf_counter, parse, `Engine.ingest` (the
Ingestor and the observers it calls at once) and each observer the backlog hands the events to
(app/engine.py, `compose_observers`), on batches of 1000 drained one at a time. Medians per batch
and the mean of the cyclic GC's pauses.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench._util import REPO, Traffic, child_env, info, listening_socket, median


class GcTimer:
    """Wall time the cyclic garbage collector runs, per generation (gc.callbacks)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._t0 = 0.0

    def _cb(self, phase: str, info_: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            g = info_["generation"]
            self.seconds[g] += time.perf_counter() - self._t0
            self.collections[g] += 1

    def __enter__(self) -> GcTimer:
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._cb)

    def summary(self, batches: int) -> dict[str, Any]:
        return {
            "ms_per_batch": round(sum(self.seconds) / batches * 1e3, 3),
            "full_collections": self.collections[2],
            "ms_in_full_collections": round(self.seconds[2] * 1e3, 1),
            "collections_by_generation": list(self.collections),
        }


# -- stages ----------------------------------------------------------------------------------


def stages(batches: int, fsync: bool, seed: int = 0) -> dict[str, Any]:
    import orjson

    from app.api.batch import BatchParser
    from app.core.clock import SystemClock
    from app.core.runtime import tune_gc
    from app.ingest.eventlog import FileEventLog, encode_events, segment_path
    from app.ingest.ingestor import Ingestor
    from app.state.memory import MemoryStore

    tune_gc()  # the thresholds `serve` sets (its pacer is an Engine's observer: not here)
    parser = BatchParser(10_000)
    traffic = Traffic(seed=seed)
    bodies = traffic.batches(batches, 1000)
    check_bodies = traffic.batches(batches, 1000)
    workdir = Path(tempfile.mkdtemp(prefix="kvp-bench-stages-"))
    times: dict[str, list[float]] = {
        k: []
        for k in ("parse", "dedupe", "log_encode", "log_write", "fsync", "apply", "response_encode")
    }
    ingest_times: list[float] = []
    try:
        store = MemoryStore(bytes_per_token=327_680, block_tokens=512)
        log = FileEventLog(workdir / "stages", fsync=False)  # fsync timed on its own below
        fd = os.open(segment_path(log.directory, log.position.segment), os.O_RDONLY)
        clock = time.perf_counter
        gc_timer = GcTimer().__enter__()
        for body in bodies:
            t0 = clock()
            parsed = parser.parse(body)
            t1 = clock()
            # Ingestor.ingest's dedupe, step for step.
            unique, in_batch, duplicates = [], set(), []
            for e in parsed.events:
                if e.event_id in in_batch:
                    duplicates.append(e.event_id)
                else:
                    in_batch.add(e.event_id)
                    unique.append(e)
            seen = store.seen([e.event_id for e in unique])
            fresh = [e for e, was_seen in zip(unique, seen) if not was_seen]
            t2 = clock()
            data = encode_events(fresh)
            t3 = clock()
            log.append(data)
            t4 = clock()
            if fsync:
                os.fsync(fd)
            t5 = clock()
            applied = store.apply(fresh)
            t6 = clock()
            accepted = [e.event_id for e, ok in zip(fresh, applied) if ok]
            orjson.dumps(
                {
                    "accepted": accepted,
                    "duplicates": duplicates,
                    "rejected": [r.model_dump() for r in parsed.rejected],
                }
            )
            t7 = clock()
            for k, a, b in (
                ("parse", t0, t1),
                ("dedupe", t1, t2),
                ("log_encode", t2, t3),
                ("log_write", t3, t4),
                ("fsync", t4, t5),
                ("apply", t5, t6),
                ("response_encode", t6, t7),
            ):
                times[k].append(b - a)
            if len(accepted) != 1000:
                raise RuntimeError(f"expected 1000 accepted events, got {len(accepted)}")
        gc_timer.__exit__()
        os.close(fd)
        log.close()

        # Cross-check: the real Ingestor (fsync as asked) on fresh batches, parse not included.
        store2 = MemoryStore(bytes_per_token=327_680, block_tokens=512)
        log2 = FileEventLog(workdir / "ingestor", fsync=fsync)
        ingestor = Ingestor(
            store2, log2, replica_id="bench", clock=SystemClock(), max_clock_skew_seconds=300.0
        )
        for body in check_bodies:
            events = parser.parse(body).events
            t0 = clock()
            ingestor.ingest(events)
            ingest_times.append(clock() - t0)
        log2.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    ms = {k: round(median(v) * 1e3, 3) for k, v in times.items()}
    total = sum(ms.values())
    return {
        "batch_size": 1000,
        "batches": batches,
        "fsync": fsync,
        "ms_per_batch": ms,
        "sum_ms_per_batch": round(total, 3),
        "share": {k: round(v / total, 3) for k, v in ms.items()},
        # The collector's pauses land in whichever step allocates when they come (mostly parse).
        "gc": gc_timer.summary(len(bodies)),
        "ingestor_ingest_ms_per_batch": round(median(ingest_times) * 1e3, 3),
        "implied_events_per_second_without_http": round(1000 / (total / 1e3), 1),
    }


# -- observers -------------------------------------------------------------------------------


def _observer_name(observer: Any) -> str:
    """`LruGuard.observe`, `feedback_observer`, ...: what the timings are keyed by."""
    name = getattr(observer, "__qualname__", None) or type(observer).__qualname__
    return name.replace(".<locals>.observe", "").replace(".<locals>", "")


def observers(batches: int, fsync: bool, seed: int = 0) -> dict[str, Any]:
    import asyncio

    import app.engine as engine_module
    from app.api.batch import BatchParser
    from app.core.config import Settings
    from app.core.runtime import tune_gc

    tune_gc()
    times: dict[str, list[float]] = {}
    clock = time.perf_counter
    real_compose = engine_module.compose_observers

    def timed_compose(observers_: Any) -> Any:
        timed = []
        for observer in observers_:
            name = _observer_name(observer)
            times.setdefault(name, [])

            def wrapped(events: Any, _o: Any = observer, _n: str = name) -> None:
                t0 = clock()
                _o(events)
                times[_n].append(clock() - t0)

            timed.append(wrapped)
        return real_compose(timed)

    workdir = Path(tempfile.mkdtemp(prefix="kvp-bench-observers-"))
    engine_module.compose_observers = timed_compose  # type: ignore[assignment]
    try:
        settings = Settings(
            _env_file=None, data_dir=workdir, log_fsync=fsync, replica_id="bench", store="memory"
        )
        engine = engine_module.Engine(settings)
    finally:
        engine_module.compose_observers = real_compose  # type: ignore[assignment]
    parser = BatchParser(settings.max_batch_events)
    bodies = Traffic(seed=seed).batches(batches + 10, 1000)
    steps: dict[str, list[float]] = {"parse": [], "Engine.ingest": [], "Backlog.drain": []}
    try:
        for body in bodies[:10]:  # warm-up
            engine.ingest(parser.parse(body).events, body)
            engine.drain()
        for v in times.values():
            v.clear()
        with GcTimer() as gc_timer:
            for body in bodies[10:]:
                t0 = clock()
                parsed = parser.parse(body)
                t1 = clock()
                result = engine.ingest(parsed.events, body)
                t2 = clock()
                engine.drain()
                t3 = clock()
                if len(result.accepted) != 1000:
                    raise RuntimeError(f"expected 1000 accepted, got {len(result.accepted)}")
                steps["parse"].append(t1 - t0)
                steps["Engine.ingest"].append(t2 - t1)
                steps["Backlog.drain"].append(t3 - t2)
        asyncio.run(engine.close())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    ms = {k: round(median(v) * 1e3, 3) for k, v in steps.items()}
    per_observer = {
        k: round(median(v) * 1e3, 3)
        for k, v in sorted(times.items(), key=lambda kv: -sum(kv[1]))
        if v
    }
    return {
        "batch_size": 1000,
        "batches": batches,
        "fsync": fsync,
        "ms_per_batch": ms,
        "sum_ms_per_batch": round(sum(ms.values()), 3),
        # Engine.ingest's own observers (the deployment signals, the backlog's put) and the
        # backlog's (the planning side, the outcomes, the metrics), each timed where it runs.
        "observers_ms_per_batch": per_observer,
        "gc": gc_timer.summary(batches),
        "implied_events_per_second_without_http": round(1000 / (sum(ms.values()) / 1e3), 1),
    }


# -- cProfile ----------------------------------------------------------------------------------

# Where the event loop's busy time goes, each the cumulative time of one function (name, file
# suffix). The service appends to the log on a thread of its own (Engine.ingest_async), which
# cProfile does not see: the write and fsync are not in these figures. `post_events` covers the
# request up to the log (read, parse, prepare: dedupe and the log's encoding); the batch's
# commit (the store's apply, the observers told at once) runs in a task of its own, the
# planning side's observers in the backlog's, the scoring passes in the scorer's.
_ROUTE = ("route post_events, up to the log", "post_events", "app/api/routes/events.py")
_PARTS: list[tuple[str, str, str]] = [
    ("commit (Ingestor.commit)", "commit", "app/ingest/ingestor.py"),
    ("backlog: the planning side's observers", "drain", "app/ingest/backlog.py"),
    ("scoring passes (Scorer.passes)", "passes", "app/decide/scorer.py"),
    ("planning ticks (Dispatcher.tick)", "tick", "app/decide/dispatcher.py"),
]
_STEPS: list[tuple[str, str, str]] = [
    _ROUTE,
    ("  read body", "read_body", "app/api/routes/events.py"),
    ("  parse (BatchParser._parse)", "_parse", "app/api/batch.py"),
    ("  prepare (Ingestor.prepare)", "prepare", "app/ingest/ingestor.py"),
    ("    of which dedupe", "seen_and_newest", "app/state/memory.py"),
    ("    of which log encode (the body as sent)", "encode_batch", "app/ingest/eventlog.py"),
    _PARTS[0],
    ("  of which apply (MemoryStore.apply)", "apply", "app/state/memory.py"),
    *_PARTS[1:],
]


# (file, line, function) -> (primitive calls, calls, tottime, cumtime, callers)
_Table = dict[tuple[str, int, str], tuple[int, int, float, float, dict[Any, Any]]]


def _table(stats: pstats.Stats) -> _Table:
    # typeshed's pstats stub does not declare the raw table that Stats keeps.
    return stats.stats  # type: ignore[attr-defined]


def _find(stats: pstats.Stats, name: str, suffix: str) -> tuple[int, float, float]:
    """(calls, tottime, cumtime) summed over the functions of that name in that file."""
    calls, tt, ct = 0, 0.0, 0.0
    for (file, _line, func), (_cc, nc, t, c, _callers) in _table(stats).items():
        if func == name and file.replace(os.sep, "/").endswith(suffix):
            calls, tt, ct = calls + nc, tt + t, ct + c
    return calls, tt, ct


def _idle(stats: pstats.Stats) -> float:
    return sum(
        t
        for (file, _l, func), (_cc, _nc, t, _c, _callers) in _table(stats).items()
        if file == "~" and "poll" in func and ("epoll" in func or "select" in func)
    )


def client_main(url: str, batches: int, concurrency: int, seed: int) -> None:
    from bench.ingest import new_clients, post_all

    bodies = Traffic(seed=seed).batches(batches + 10, 1000)
    clients = new_clients(concurrency)
    post_all(clients, url, bodies[:10], b'"duplicates":[],"rejected":[]')  # warm-up
    elapsed = post_all(clients, url, bodies[10:], b'"duplicates":[],"rejected":[]')
    print(
        f"client: {batches} batches of 1000 in {elapsed:.2f} s: "
        f"{batches * 1000 / elapsed:,.0f} events/s "
        "(under the profiler)",
        file=sys.stderr,
    )


def profile(batches: int, fsync: bool, top: int, out: Path | None, concurrency: int = 2) -> str:
    import httpx
    import uvicorn

    from app.api.main import create_app
    from app.core.config import Settings
    from app.core.runtime import tune_gc

    tune_gc()  # as `serve` does

    workdir = Path(tempfile.mkdtemp(prefix="kvp-bench-profile-"))
    sock = listening_socket()
    port = sock.getsockname()[1]
    settings = Settings(
        _env_file=None,
        data_dir=workdir,
        log_fsync=fsync,
        replica_id="bench",
        store="memory",
    )
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings),
            loop="asyncio",
            log_level="warning",
            access_log=False,
        )
    )
    url = f"http://127.0.0.1:{port}"
    done: dict[str, Any] = {}

    def drive() -> None:
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.05)
            cmd = [
                sys.executable,
                "-m",
                "bench.profile_ingest",
                "client",
                "--url",
                url + "/v1/events",
                "--batches",
                str(batches),
                "--concurrency",
                str(concurrency),
            ]
            done["rc"] = subprocess.run(cmd, cwd=REPO, env=child_env({}), check=False).returncode
        finally:
            server.should_exit = True

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    prof = cProfile.Profile()
    gc_timer = GcTimer()
    try:
        with gc_timer:
            prof.runcall(server.run, sockets=[sock])
    finally:
        driver.join(timeout=5)
        sock.close()
        shutil.rmtree(workdir, ignore_errors=True)
    if done.get("rc") != 0:
        raise RuntimeError(f"the client failed ({done.get('rc')})")
    if out is not None:
        prof.dump_stats(out)
    return _report(pstats.Stats(prof), batches, top, gc_timer)


def _report(stats: pstats.Stats, batches: int, top: int, gc_timer: GcTimer) -> str:
    total = stats.total_tt  # type: ignore[attr-defined]
    idle = _idle(stats)
    busy = total - idle
    route = _find(stats, "post_events", "app/api/routes/events.py")[2]
    lines = [
        f"server under cProfile: {total:.2f} s, idle in epoll {idle:.2f} s, busy {busy:.2f} s "
        f"({batches} measured batches + 10 warm-up of 1000 events)",
        "",
        f"{'step':44s} {'ms/batch':>9s} {'% busy':>7s}",
    ]
    n = batches + 10
    for label, name, suffix in _STEPS:
        _calls, _tt, ct = _find(stats, name, suffix)
        lines.append(f"{label:44s} {ct / n * 1e3:9.2f} {ct / busy * 100:6.1f}%")
    # The rest: HTTP and the framework, the response, the loops' own overhead.
    rest = busy - route - sum(_find(stats, nm, sf)[2] for _label, nm, sf in _PARTS)
    lines.append(
        f"{'the rest (HTTP, framework, loops)':44s} {rest / n * 1e3:9.2f} {rest / busy * 100:6.1f}%"
    )
    gc_s = sum(gc_timer.seconds)
    lines.append("")
    lines.append(
        f"{'cyclic GC (inside the steps above)':44s} {gc_s / n * 1e3:9.2f} "
        f"{gc_s / busy * 100:6.1f}%"
        f"  ({gc_timer.collections[2]} full collections, {gc_timer.seconds[2] * 1e3:.0f} ms)"
    )
    buf = io.StringIO()
    stats.stream = buf  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(top)
    return "\n".join(lines) + "\n\ntop functions by own time:\n" + _trim(buf.getvalue())


def _trim(text: str) -> str:
    keep = []
    started = False
    for line in text.splitlines():
        if line.strip().startswith("ncalls"):
            started = True
        if started and line.strip():
            keep.append(line.replace(str(REPO) + os.sep, "").replace(sys.prefix + os.sep, ""))
    return "\n".join(keep)


def main(argv: list[str] | None = None) -> None:
    import json

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_st = sub.add_parser("stages")
    p_st.add_argument("--batches", type=int, default=60)
    p_st.add_argument("--fsync", action=argparse.BooleanOptionalAction, default=True)
    p_pr = sub.add_parser("cprofile")
    p_pr.add_argument("--batches", type=int, default=200)
    p_pr.add_argument("--fsync", action=argparse.BooleanOptionalAction, default=True)
    p_pr.add_argument("--top", type=int, default=25)
    p_pr.add_argument("--out", type=Path, default=None)
    p_ob = sub.add_parser("observers")
    p_ob.add_argument("--batches", type=int, default=200)
    p_ob.add_argument("--fsync", action=argparse.BooleanOptionalAction, default=True)
    p_cl = sub.add_parser("client")
    p_cl.add_argument("--url", required=True)
    p_cl.add_argument("--batches", type=int, required=True)
    p_cl.add_argument("--concurrency", type=int, default=2)
    p_cl.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.cmd == "stages":
        info(f"stages: {args.batches} batches of 1000, fsync={'on' if args.fsync else 'off'}")
        print(json.dumps(stages(args.batches, args.fsync), indent=2))
    elif args.cmd == "observers":
        info(f"observers: {args.batches} batches of 1000, fsync={'on' if args.fsync else 'off'}")
        print(json.dumps(observers(args.batches, args.fsync), indent=2))
    elif args.cmd == "cprofile":
        print(profile(args.batches, args.fsync, args.top, args.out))
    else:
        client_main(args.url, args.batches, args.concurrency, args.seed)


if __name__ == "__main__":
    main()
