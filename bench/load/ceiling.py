"""The ceiling: a bare FastAPI app with the service's two routes' shapes, hit by the same client.

bench/ceiling_app.py (POST /v1/events: read and parse the batch, nothing else) plus a
POST /v1/route-hint declared as the service declares it, answering a fixed hint. It runs as its
own process (`python -m bench.load.ceiling --fd N`), before and after the service phase, so
the service's throughput has a ratio to what the framework and this client allow.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench.load.client import Load
from bench.load.processes import Proc, cpu_seconds
from bench.load.traffic import make_shards


def _ceiling_app() -> Any:
    """bench/ceiling_app.py plus POST /v1/route-hint declared as the service declares it (the same
    body and response models), answering a fixed hint without looking anything up."""
    from app.api.routes.hints import CandidateHintModel, RouteHintRequest, RouteHintResponse
    from bench.ceiling_app import app

    async def route_hint(body):
        return RouteHintResponse(
            session_id=body.session_id,
            context_known=True,
            context_bytes=0,
            recommended=body.candidates[0],
            reason="ceiling",
            candidates=[
                CandidateHintModel(
                    instance_id=c,
                    resident_bytes=0,
                    inflight_bytes=0,
                    missing_bytes=0,
                    source="none",
                    expected_load_seconds=0.0,
                    queue_depth=0,
                    running_requests=0,
                    expected_wait_seconds=0.0,
                    expected_seconds=0.0,
                    recommended=i == 0,
                    reason="ceiling",
                )
                for i, c in enumerate(body.candidates)
            ],
        )

    # Real classes, not this module's postponed (string) annotations, which FastAPI resolves in
    # the module's globals: the body is then parsed as the service parses it.
    route_hint.__annotations__ = {"body": RouteHintRequest, "return": RouteHintResponse}
    app.post("/v1/route-hint", response_model=RouteHintResponse)(route_hint)
    return app


def serve(fd: int) -> None:
    import socket

    from app.core.runtime import tune_gc
    from bench._server import serve_bare

    tune_gc()  # as `kvprefetch serve` does
    serve_bare(_ceiling_app(), socket.socket(fileno=fd))


def ceiling_phase(
    workdir: Path,
    seconds: float,
    warmup: float,
    *,
    shards_kw: dict[str, Any],
    load_kw: dict[str, Any],
    headers: dict[str, str],
) -> dict[str, Any]:
    """The same client against the ceiling for `seconds` after `warmup`: rates, latencies, CPU,
    errors."""
    server = Proc("ceiling", ["-m", "bench.load.ceiling"], workdir=workdir, env={})
    try:
        server.wait_ready("/healthz", headers)
        load = Load(server.url, make_shards(**shards_kw), **load_kw)
        load.start()
        time.sleep(warmup)
        t0 = time.perf_counter()
        server_cpu0, own0 = cpu_seconds(server.proc.pid), time.process_time()
        time.sleep(seconds)
        t1 = time.perf_counter()
        server_cpu1, own1 = cpu_seconds(server.proc.pid), time.process_time()
        load.finish()
        out = load.window(t0, t1)
        out["seconds"] = round(t1 - t0, 2)
        out["server_cpu_percent"] = round(100 * (server_cpu1 - server_cpu0) / (t1 - t0), 1)
        out["client_cpu_percent"] = round(100 * (own1 - own0) / (t1 - t0), 1)
        out["errors"] = load.errors()
        return out
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="the ceiling server of `kvprefetch bench load`")
    parser.add_argument("--fd", type=int, required=True)
    serve(parser.parse_args().fd)


if __name__ == "__main__":
    main()
