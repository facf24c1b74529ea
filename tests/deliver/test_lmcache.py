"""The lmcache sink against a real LMCache coordinator and MP server (CPU, from .venv-lmcache,
which `bash .ci/ensure-lmcache` builds): pins and their TTL, the coordinator's lookup of the
tokens the sink sends, demotes as deletes, the MP server's 503 (no engine registered a KV
layout), an unknown instance, unknown tokens, an unreachable coordinator, and the engine's wiring.

A prefetch needs an engine that registered its KV layout with the MP server. On a GPU that is
vLLM with LMCache's connector; here it is LMCache's own `lmcache bench server --mode cpu
--transfer-mode lmcache_driven`, which registers CPU KV tensors (over POSIX shared memory) as an
engine does and stores one request, (0, 9906 x 512) tokens of model "test-model": a prefetch of
those runs end to end. The polling's other paths (pending, the deadline) are checked against a
stand-in coordinator that answers as LMCache's does."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from app.core.config import Settings
from app.deliver import Fence, LmcacheSink, TokenIndex, build_sink
from app.engine import Engine
from app.observe.metrics import Metrics
from kvprefetch_client.events import KvBlocksStored, OrderProgress
from tests.conftest import live_server
from tests.deliver.conftest import order
from tests.ports import is_in_use, quiet_port, retry_in_use, unanswered_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
LMCACHE = Path(os.environ.get("KVP_TEST_LMCACHE_BIN", REPO / ".venv-lmcache" / "bin" / "lmcache"))
# The bench engine's model and tokens (lmcache/cli/commands/bench/server_bench/helpers.py).
MODEL = "test-model"
BENCH_TOKENS = [0] + [9906] * 511
# A model no engine registered a layout for.
NO_ENGINE_MODEL = "no-engine-model"
MP_INSTANCE = "mp-test"
BLOCK_TOKENS = 16
# 40 blocks of 16 tokens: 640 tokens, two whole LMCache chunks of 256 (and a partial one).
CHAIN = list(range(1000, 1040))
CHAIN_TOKENS = [(7 * i) % 50_000 for i in range(len(CHAIN) * BLOCK_TOKENS)]
STARTUP_SECONDS = 120.0


def _wait(url: str, ready: Any, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args!r} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if ready(httpx.get(url, timeout=2)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"{proc.args!r} not ready in {STARTUP_SECONDS:g} s:\n{log.read_text()[-3000:]}")


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    if not LMCACHE.is_file():
        pytest.fail(f"{LMCACHE} is missing: run `bash .ci/ensure-lmcache` first")
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "PYTHONWARNINGS": "ignore"}
    with log.open("wb") as out:
        return subprocess.Popen(
            [str(LMCACHE), *args], stdout=out, stderr=subprocess.STDOUT, env=env
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Lmcache:
    url: str  # the coordinator's
    rpc_port: int  # the MP server's request port (ZMQ)
    http_port: int  # the MP server's HTTP port
    logs: Path


@pytest.fixture(scope="module")
def lmcache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lmcache]:
    """A real `lmcache coordinator` and one `lmcache server` (CPU, no engine yet) registered
    with it as MP_INSTANCE."""
    logs = tmp_path_factory.mktemp("lmcache")
    started: list[subprocess.Popen[bytes]] = []

    def start(port: int) -> Lmcache:
        # Each binds the ports it is given: quiet ones, all three tried again when one was taken.
        rpc_port, http_port = quiet_port(), quiet_port()
        url = f"http://127.0.0.1:{port}"
        coord_log, server_log = logs / f"coord-{port}.log", logs / f"server-{port}.log"
        coord = _start(["coordinator", "--host", "127.0.0.1", "--port", str(port)], coord_log)
        started.append(coord)
        _wait_or_in_use(f"{url}/healthz", lambda r: r.status_code == 200, coord, coord_log)
        server = _start(
            [
                "server",
                "--instance-id",
                MP_INSTANCE,
                "--port",
                str(rpc_port),
                "--http-port",
                str(http_port),
                "--l1-size-gb",
                "0.1",
                "--eviction-policy",
                "LRU",
                "--coordinator-url",
                url,
                "--coordinator-advertise-ip",
                "127.0.0.1",
            ],
            server_log,
        )
        started.append(server)
        _wait_or_in_use(
            f"{url}/instances",
            lambda r: any(i["instance_id"] == MP_INSTANCE for i in r.json()["instances"]),
            server,
            server_log,
        )
        return Lmcache(url, rpc_port, http_port, logs)

    try:
        yield retry_in_use(start)
    finally:
        for proc in reversed(started):
            if proc.poll() is None:
                _stop(proc)


def _wait_or_in_use(url: str, ready: Any, proc: subprocess.Popen[bytes], log: Path) -> None:
    """`_wait`, but a process that exited because its port was taken raises for a retry (its
    partner processes are stopped by the fixture)."""
    try:
        _wait(url, ready, proc, log)
    except pytest.fail.Exception as exc:
        if proc.poll() is not None and is_in_use(log.read_text(errors="replace")):
            raise RuntimeError(f"address in use: {exc}") from None
        raise


@pytest.fixture(scope="module")
def coordinator(lmcache: Lmcache) -> str:
    return lmcache.url


@pytest.fixture(scope="module")
def bench_engine(lmcache: Lmcache) -> Iterator[None]:
    """LMCache's bench client as the engine: registers its CPU KV layout for MODEL with the MP
    server, stores BENCH_TOKENS' two chunks, and stays registered until the module ends."""
    log = lmcache.logs / "bench.log"
    bench = _start(
        [
            "bench",
            "server",
            "--rpc-url",
            f"tcp://127.0.0.1:{lmcache.rpc_port}",
            "--url",
            f"http://127.0.0.1:{lmcache.http_port}",
            "--mode",
            "cpu",
            "--transfer-mode",
            "lmcache_driven",
            "--kvcache-shape-spec",
            "(2,64,16,2,64):float16:2",
            "--num-blocks",
            "64",
            "--num-tokens",
            "512",
            "--start",
            "0",
            "--interval",
            "100000",  # one request, then it waits, registered
        ],
        log,
    )
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while "STORE: stored" not in log.read_text():
            if bench.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the bench engine did not store:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield
    finally:
        _stop(bench)


def indexed(max_tokens: int = 1_000_000) -> TokenIndex:
    index = TokenIndex(max_tokens)
    index.observe(
        [
            KvBlocksStored(
                event_id="stored-1",
                ts=1.0,
                instance_id=MP_INSTANCE,
                block_hashes=CHAIN,
                block_tokens=BLOCK_TOKENS,
                token_ids=CHAIN_TOKENS,
            )
        ]
    )
    return index


class Reports:
    def __init__(self) -> None:
        self.events: list[OrderProgress] = []

    async def __call__(self, events: Sequence[OrderProgress]) -> None:
        self.events.extend(events)

    def of(self, order_id: str) -> list[tuple[str, str | None]]:
        return [(e.status, e.reason) for e in self.events if e.order_id == order_id]


def make_sink(url: str, **kw: Any) -> tuple[LmcacheSink, Reports, Metrics]:
    reports, metrics = Reports(), Metrics(gpu_hour_price_dollars=1.0)
    fields: dict[str, Any] = dict(
        model_name=MODEL, tokens=indexed(), backoff_seconds=0.01, max_backoff_seconds=0.02
    )
    fields.update(kw)
    sink = LmcacheSink(url, report=reports, metrics=metrics, **fields)
    return sink, reports, metrics


def pins(url: str) -> list[dict[str, Any]]:
    return list(httpx.get(f"{url}/cache/pins", params={"model_name": MODEL}).json()["pins"])


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def pin_order(order_id: str, ttl_seconds: float, blocks: list[int] | None = None) -> Any:
    return order(
        order_id,
        MP_INSTANCE,
        kind="pin",
        source_tier=None,
        ttl_seconds=ttl_seconds,
        block_hashes=blocks or CHAIN[-3:],
    )


def test_a_pin_pins_the_chains_chunks_until_its_ttl_runs_out(coordinator: str) -> None:
    async def main() -> None:
        sink, reports, metrics = make_sink(coordinator)
        try:
            assert await sink.submit([pin_order("pin-1", ttl_seconds=1.0)]) == ["pin-1"]
            await sink.settle()
            assert reports.of("pin-1") == [("completed", None)]
            held = pins(coordinator)
            # 640 tokens: two whole chunks, one key each at world size 1.
            assert [p["pin_count"] for p in held] == [1, 1]
            assert sink.pins_held == 1
            deadline = time.monotonic() + 30
            while pins(coordinator) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert pins(coordinator) == []
            assert sink.pins_held == 0
            assert (
                sample(metrics, "kvprefetch_lmcache_orders_total", kind="pin", outcome="completed")
                == 1
            )
        finally:
            await sink.close()

    asyncio.run(main())


def test_close_releases_the_pins_it_holds(coordinator: str) -> None:
    async def main() -> None:
        sink, _, _ = make_sink(coordinator)
        await sink.submit([pin_order("pin-2", ttl_seconds=3600.0)])
        await sink.settle()
        assert len(pins(coordinator)) == 2
        await sink.close()
        assert pins(coordinator) == []

    asyncio.run(main())


def unpin_behind_the_sinks_back(url: str) -> None:
    """What a coordinator restart does to the chain's pins, done by hand."""
    body = {"model_name": MODEL, "world_size": 1, "token_ids": CHAIN_TOKENS, "cache_salt": ""}
    assert httpx.request("DELETE", f"{url}/cache/pins", json=body).status_code == 200


def test_pins_the_coordinator_no_longer_holds_are_reported_lost(coordinator: str) -> None:
    async def main() -> None:
        sink, reports, metrics = make_sink(coordinator, pin_check_seconds=0)  # checked by hand
        try:
            await sink.submit([pin_order("pin-lost", ttl_seconds=3600.0)])
            await sink.settle()
            assert await sink.check_pins() == []  # all there
            unpin_behind_the_sinks_back(coordinator)
            assert await sink.check_pins() == ["pin-lost"]
            (done, lost) = reports.of("pin-lost")
            assert done == ("completed", None)
            assert lost[0] == "failed" and "pin lost" in (lost[1] or "")
            assert sink.pins_held == 0 and await sink.check_pins() == []
            assert (
                sample(metrics, "kvprefetch_lmcache_order_failures_total", reason="pin_lost") == 1
            )
        finally:
            await sink.close()

    asyncio.run(main())


def test_the_sink_checks_its_pins_while_it_holds_any(coordinator: str) -> None:
    async def main() -> None:
        sink, reports, _ = make_sink(coordinator, pin_check_seconds=0.05)
        try:
            await sink.submit([pin_order("pin-watched", ttl_seconds=3600.0)])
            await sink.settle()
            await asyncio.sleep(0.2)
            assert reports.of("pin-watched") == [("completed", None)]  # checked, and there
            unpin_behind_the_sinks_back(coordinator)
            deadline = time.monotonic() + 30
            while len(reports.of("pin-watched")) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert [s for s, _ in reports.of("pin-watched")] == ["completed", "failed"]
        finally:
            await sink.close()

    asyncio.run(main())


def test_the_tokens_sent_are_the_keys_lmcache_looks_up(coordinator: str) -> None:
    """The sequence rebuilt from the hashes is what LMCache keys the chain by: the keys pinned are
    the ones /directory/lookup resolves the engine's own tokens to."""

    async def main() -> None:
        sink, _, _ = make_sink(coordinator)
        try:
            await sink.submit([pin_order("pin-3", ttl_seconds=3600.0, blocks=[CHAIN[20]])])
            await sink.settle()
            pinned = {p["key"]["chunk_hash_hex"] for p in pins(coordinator)}
        finally:
            await sink.close()
        body = {"model_name": MODEL, "world_size": 1, "token_ids": CHAIN_TOKENS[: 21 * 16]}
        looked_up = httpx.post(f"{coordinator}/directory/lookup", json=body).json()
        # Block 20 ends at token 336: one whole chunk.
        assert looked_up["chunks"] == 1
        assert pinned == {r["key"]["chunk_hash_hex"] for r in looked_up["results"]}

    asyncio.run(main())


def test_a_prefetch_before_any_engine_registered_its_layout_fails_once_with_the_503(
    coordinator: str,
) -> None:
    async def main() -> None:
        sink, reports, metrics = make_sink(coordinator, model_name=NO_ENGINE_MODEL)
        try:
            await sink.submit([order("pf-1", MP_INSTANCE, block_hashes=CHAIN)])
            await sink.settle()
        finally:
            await sink.close()
        [(status, reason)] = reports.of("pf-1")
        assert status == "failed"
        assert reason is not None and "no engine has registered its KV layout" in reason
        assert "503" in reason
        assert sample(metrics, "kvprefetch_lmcache_order_failures_total", reason="no_layout") == 1
        # Not a retry storm: the one call, never tried again.
        assert sample(metrics, "kvprefetch_lmcache_call_retries_total", call="prefetch") == 0

    asyncio.run(main())


def test_a_demote_deletes_the_chunks_from_l1(coordinator: str) -> None:
    async def main() -> None:
        sink, reports, _ = make_sink(coordinator)
        l2, l2_reports, _ = make_sink(coordinator, demote_tier="all")
        try:
            demote = order("dm-1", MP_INSTANCE, kind="demote", source_tier=None, block_hashes=CHAIN)
            await sink.submit([demote])
            await l2.submit([demote])
            await sink.settle()
            await l2.settle()
        finally:
            await sink.close()
            await l2.close()
        assert reports.of("dm-1") == [("completed", None)]
        # This MP server has no L2 tier: a delete that reaches into it is its 503, not retried.
        [(status, reason)] = l2_reports.of("dm-1")
        assert status == "failed" and reason is not None and "503" in reason

    asyncio.run(main())


def test_an_instance_lmcache_does_not_know_fails_the_order(coordinator: str) -> None:
    async def main() -> None:
        sink, reports, metrics = make_sink(coordinator)
        try:
            await sink.submit([order("pf-2", "gpu-nowhere", block_hashes=CHAIN)])
            await sink.settle()
        finally:
            await sink.close()
        [(status, reason)] = reports.of("pf-2")
        assert status == "failed" and reason is not None and "gpu-nowhere" in reason
        assert (
            sample(metrics, "kvprefetch_lmcache_order_failures_total", reason="unknown_instance")
            == 1
        )

    asyncio.run(main())


def test_an_order_whose_tokens_are_unknown_fails_at_submit_without_a_call() -> None:
    async def main() -> None:
        # Nothing listens there: a call would be retried, and counted.
        sink, reports, metrics = make_sink(f"http://127.0.0.1:{unanswered_port()}")
        try:
            assert await sink.submit([order("pf-3", MP_INSTANCE, block_hashes=[5, 6])]) == ["pf-3"]
            # Reported before submit returned.
            [(status, reason)] = reports.of("pf-3")
        finally:
            await sink.close()
        assert status == "failed" and reason is not None and "no tokens known for block 6" in reason
        assert sample(metrics, "kvprefetch_lmcache_call_retries_total", call="prefetch") == 0

    asyncio.run(main())


def test_an_unreachable_coordinator_fails_orders_after_bounded_retries() -> None:
    async def main() -> None:
        sink, reports, metrics = make_sink(f"http://127.0.0.1:{unanswered_port()}", max_attempts=3)
        try:
            await sink.submit(
                [
                    pin_order("pin-4", ttl_seconds=60.0),
                    order("dm-2", MP_INSTANCE, kind="demote", source_tier=None, block_hashes=CHAIN),
                    order("pf-4", MP_INSTANCE, block_hashes=CHAIN),
                ]
            )
            await sink.settle()
            # Nothing stops: the sink takes the next orders, and fails them the same way.
            await sink.submit([pin_order("pin-5", ttl_seconds=60.0)])
            await sink.settle()
        finally:
            await sink.close()
        for order_id in ("pin-4", "dm-2", "pf-4", "pin-5"):
            [(status, reason)] = reports.of(order_id)
            assert status == "failed" and reason is not None
            assert "gave up after 3 attempt(s)" in reason
        assert sample(metrics, "kvprefetch_lmcache_order_failures_total", reason="unreachable") == 4
        # Two retries per order's one call.
        assert sample(metrics, "kvprefetch_lmcache_call_retries_total", call="pin") == 4
        assert sample(metrics, "kvprefetch_lmcache_call_retries_total", call="delete") == 2
        assert sample(metrics, "kvprefetch_lmcache_call_retries_total", call="prefetch") == 2
        assert sink.pins_held == 0

    asyncio.run(main())


def test_past_its_pending_bound_an_order_fails_at_once() -> None:
    async def main() -> None:
        sink, reports, metrics = make_sink(
            f"http://127.0.0.1:{unanswered_port()}", max_pending_orders=1
        )
        try:
            await sink.submit([pin_order("pin-7", ttl_seconds=60.0), pin_order("pin-8", 60.0)])
            # Reported before submit returned, while pin-7 is still trying.
            [(status, reason)] = reports.of("pin-8")
            assert status == "failed" and reason is not None and "1 orders already" in reason
            await sink.settle()
        finally:
            await sink.close()
        assert sample(metrics, "kvprefetch_lmcache_order_failures_total", reason="backlog") == 1
        assert [s for s, _ in reports.of("pin-7")] == ["failed"]

    asyncio.run(main())


# -- a prefetch end to end, LMCache's bench client as the engine --------------------------------


def bench_index() -> TokenIndex:
    """BENCH_TOKENS as an engine reports them: 32 blocks of 16, chained."""
    index = TokenIndex(1_000_000)
    index.observe(
        [
            KvBlocksStored(
                event_id="bench-stored",
                ts=1.0,
                instance_id=MP_INSTANCE,
                block_hashes=[f"b{i}" for i in range(32)],
                block_tokens=BLOCK_TOKENS,
                token_ids=BENCH_TOKENS,
            )
        ]
    )
    return index


def test_a_prefetch_runs_end_to_end_once_an_engine_registered_its_layout(
    coordinator: str, bench_engine: None
) -> None:
    async def main() -> None:
        sink, reports, metrics = make_sink(coordinator, tokens=bench_index())
        try:
            await sink.submit(
                [order("pf-10", MP_INSTANCE, block_hashes=["b30", "b31"], size_bytes=4096)]
            )
            await sink.settle()
        finally:
            await sink.close()
        assert [e.status for e in reports.events] == ["accepted", "completed"]
        done = reports.events[-1]
        assert done.bytes == 4096  # both chunks found: 2 of 2 keys
        assert done.seconds is not None and done.seconds > 0
        assert (
            sample(metrics, "kvprefetch_lmcache_orders_total", kind="prefetch", outcome="completed")
            == 1
        )

    asyncio.run(main())


def test_a_prefetch_of_chunks_lmcache_never_stored_fails_not_found(
    coordinator: str, bench_engine: None
) -> None:
    async def main() -> None:
        # The same model (its layout is registered), other tokens: nothing to load.
        sink, reports, metrics = make_sink(coordinator)
        try:
            await sink.submit([order("pf-11", MP_INSTANCE, block_hashes=CHAIN)])
            await sink.settle()
        finally:
            await sink.close()
        assert [e.status for e in reports.events] == ["accepted", "failed"]
        assert "none of the 2 keys" in (reports.events[-1].reason or "")
        assert sample(metrics, "kvprefetch_lmcache_order_failures_total", reason="not_found") == 1

    asyncio.run(main())


# After the two prefetches above (a module keeps to one worker, in file order): it deletes what
# they load.
def test_a_demote_deletes_the_stored_chunks_from_l1(coordinator: str, bench_engine: None) -> None:
    body = {"model_name": MODEL, "world_size": 1, "token_ids": BENCH_TOKENS}

    async def main() -> None:
        sink, reports, _ = make_sink(coordinator, tokens=bench_index())
        try:
            await sink.submit(
                [order("dm-3", MP_INSTANCE, kind="demote", source_tier=None, block_hashes=["b31"])]
            )
            await sink.settle()
        finally:
            await sink.close()
        assert reports.of("dm-3") == [("completed", None)]

    asyncio.run(main())
    # Gone from L1 (and there is no L2 here): a prefetch now finds nothing.
    answer = httpx.post(
        f"{coordinator}/cache/prefetches", json={"instance_id": MP_INSTANCE, **body}
    ).json()
    path = f"{coordinator}/cache/prefetches/{MP_INSTANCE}/{answer['request_id']}"
    deadline = time.monotonic() + 30
    while (status := httpx.get(path).json())["status"] == "pending" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (status["status"], status["found_keys"]) == ("completed", 0)


# -- a prefetch that completes: the stand-in coordinator -------------------------------------


class StandIn:
    """Answers POST /cache/prefetches and its polls as LMCache's coordinator does once an engine
    registered its layout: `pending` for `pending_polls` polls, then `completed` with
    found_keys of total_keys (the first completed poll drops the job: a later one is a 404)."""

    def __init__(self, pending_polls: int, found_keys: int, total_keys: int) -> None:
        self.pending_polls = pending_polls
        self.found_keys, self.total_keys = found_keys, total_keys
        self.submitted: list[dict[str, Any]] = []
        self.polls = 0
        self.app = Starlette(
            routes=[
                Route("/cache/prefetches", self._submit, methods=["POST"]),
                Route("/cache/prefetches/{instance}/{request_id}", self._poll, methods=["GET"]),
            ]
        )

    async def _submit(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.submitted.append(body)
        return JSONResponse(
            {
                "instance_id": body["instance_id"],
                "request_id": "r1",
                "chunks": 2,
                "status": "submitted",
            }
        )

    async def _poll(self, request: Request) -> JSONResponse:
        self.polls += 1
        if self.polls <= self.pending_polls:
            return JSONResponse({"request_id": "r1", "status": "pending"})
        if self.polls > self.pending_polls + 1:
            return JSONResponse({"detail": "unknown prefetch request_id='r1'"}, status_code=404)
        return JSONResponse(
            {
                "request_id": "r1",
                "status": "completed",
                "found_keys": self.found_keys,
                "total_keys": self.total_keys,
            }
        )


def test_a_prefetch_is_polled_until_completed_and_reports_what_lmcache_found() -> None:
    stand_in = StandIn(pending_polls=3, found_keys=1, total_keys=2)
    with live_server(stand_in.app) as url:

        async def main() -> None:
            sink, reports, _ = make_sink(url, poll_interval_seconds=0.01)
            try:
                await sink.submit([order("pf-5", MP_INSTANCE, block_hashes=CHAIN, size_bytes=4096)])
                await sink.settle()
            finally:
                await sink.close()
            statuses = [e.status for e in reports.events]
            assert statuses == ["accepted", "completed"]
            done = reports.events[-1]
            assert done.bytes == 2048  # half the keys were in LMCache
            assert done.seconds is not None and done.seconds > 0
            [sent] = stand_in.submitted
            assert sent == {
                "instance_id": MP_INSTANCE,
                "model_name": MODEL,
                "world_size": 1,
                "token_ids": CHAIN_TOKENS,
                "cache_salt": "",
            }
            assert stand_in.polls == 4

        asyncio.run(main())


def test_a_prefetch_pending_past_its_deadline_fails() -> None:
    stand_in = StandIn(pending_polls=10**9, found_keys=0, total_keys=2)
    with live_server(stand_in.app) as url:

        async def main() -> None:
            sink, reports, metrics = make_sink(
                url, poll_interval_seconds=0.01, prefetch_timeout_seconds=0.2
            )
            try:
                await sink.submit([order("pf-6", MP_INSTANCE, block_hashes=CHAIN)])
                await sink.settle()
            finally:
                await sink.close()
            assert [e.status for e in reports.events] == ["accepted", "failed"]
            assert "still pending" in (reports.events[-1].reason or "")
            assert sample(metrics, "kvprefetch_lmcache_order_failures_total", reason="timeout") == 1

        asyncio.run(main())


def test_a_prefetch_lmcache_found_nothing_for_fails() -> None:
    stand_in = StandIn(pending_polls=0, found_keys=0, total_keys=2)
    with live_server(stand_in.app) as url:

        async def main() -> None:
            sink, reports, _ = make_sink(url)
            try:
                await sink.submit([order("pf-7", MP_INSTANCE, block_hashes=CHAIN)])
                await sink.settle()
            finally:
                await sink.close()
            assert [e.status for e in reports.events] == ["accepted", "failed"]
            assert "none of the 2 keys" in (reports.events[-1].reason or "")

        asyncio.run(main())


def test_a_cancel_withdraws_only_an_order_not_yet_started() -> None:
    stand_in = StandIn(pending_polls=0, found_keys=2, total_keys=2)
    with live_server(stand_in.app) as url:

        async def main() -> None:
            sink, reports, _ = make_sink(url)
            try:
                await sink.submit([order("pf-8", MP_INSTANCE, block_hashes=CHAIN)])
                # Not yet started: its task has not run.
                assert await sink.cancel([order_cancel("pf-8")]) == ["pf-8"]
                await sink.submit([order("pf-9", MP_INSTANCE, block_hashes=CHAIN)])
                await asyncio.sleep(0)  # it takes its turn and starts
                assert await sink.cancel([order_cancel("pf-9")]) == []
                await sink.settle()
            finally:
                await sink.close()
            assert reports.of("pf-8") == []
            assert [s for s, _ in reports.of("pf-9")] == ["accepted", "completed"]

        asyncio.run(main())


class PinStandIn:
    """Answers POST and DELETE /cache/pins as LMCache's coordinator does, counting each key's
    pins; a pin's answer waits `pin_delay_seconds` (a pin the sink is still making)."""

    def __init__(self, pin_delay_seconds: float = 0.0) -> None:
        self.pin_delay_seconds = pin_delay_seconds
        self.pinned: dict[tuple[int, ...], int] = {}
        self.unpins = 0
        self.app = Starlette(routes=[Route("/cache/pins", self._pins, methods=["POST", "DELETE"])])

    async def _pins(self, request: Request) -> JSONResponse:
        key = tuple((await request.json())["token_ids"])
        if request.method == "POST":
            await asyncio.sleep(self.pin_delay_seconds)
            self.pinned[key] = self.pinned.get(key, 0) + 1
        else:
            self.unpins += 1
            self.pinned[key] -= 1
            if not self.pinned[key]:
                del self.pinned[key]
        return JSONResponse({"affected": 2})

    async def released(self) -> None:
        deadline = time.monotonic() + 10
        while (self.pinned or not self.unpins) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)


def test_a_cancel_releases_a_held_pin_now_not_at_its_ttl() -> None:
    """The LRU guard withdrew the pin (app/decide/order_book.py, withdraw)."""
    stand_in = PinStandIn()
    with live_server(stand_in.app) as url:

        async def main() -> None:
            sink, reports, _ = make_sink(url, pin_check_seconds=0)
            try:
                await sink.submit([pin_order("pin-held", ttl_seconds=3600.0)])
                await sink.settle()
                assert reports.of("pin-held") == [("completed", None)]
                assert sink.pins_held == 1 and len(stand_in.pinned) == 1
                assert await sink.cancel([order_cancel("pin-held")]) == ["pin-held"]
                assert sink.pins_held == 0
                await stand_in.released()
                assert stand_in.pinned == {} and stand_in.unpins == 1
                assert await sink.cancel([order_cancel("pin-held")]) == []  # once
            finally:
                await sink.close()
            assert stand_in.unpins == 1  # close had nothing left to release

        asyncio.run(main())


def test_a_pin_cancelled_while_it_is_made_is_released_once_held() -> None:
    stand_in = PinStandIn(pin_delay_seconds=0.3)
    with live_server(stand_in.app) as url:

        async def main() -> None:
            sink, reports, _ = make_sink(url, pin_check_seconds=0)
            try:
                await sink.submit([pin_order("pin-making", ttl_seconds=3600.0)])
                await asyncio.sleep(0.05)  # it takes its turn and starts
                assert await sink.cancel([order_cancel("pin-making")]) == ["pin-making"]
                await sink.settle()
                assert [s for s, _ in reports.of("pin-making")] == ["completed"]
                await stand_in.released()
                assert stand_in.pinned == {} and sink.pins_held == 0
            finally:
                await sink.close()

        asyncio.run(main())


def order_cancel(order_id: str) -> Any:
    from kvprefetch_client.orders import Cancel

    return Cancel(order_id=order_id)


# -- the engine's wiring ---------------------------------------------------------------------


def test_the_engine_feeds_the_index_and_ingests_the_sinks_reports(tmp_path: Path) -> None:
    settings = Settings(
        order_sink="lmcache",
        lmcache_coordinator_url=f"http://127.0.0.1:{unanswered_port()}",  # nothing listens
        lmcache_model_name=MODEL,
        lmcache_max_attempts=2,
        lmcache_backoff_seconds=0.01,
        data_dir=tmp_path,
        log_fsync=False,
        model_dir=tmp_path / "no-model",
        plan_interval_seconds=0,
        score_interval_seconds=0,
        dashboard_sample_seconds=0,
    )

    async def main() -> None:
        engine = Engine(settings, load_model=False)
        sink = engine.order_sink
        assert isinstance(sink, LmcacheSink)
        assert sink.pin_check_seconds == settings.lmcache_pin_check_seconds == 5.0
        other = build_sink(settings.model_copy(update={"lmcache_pin_check_seconds": 0.5}))
        assert isinstance(other, LmcacheSink) and other.pin_check_seconds == 0.5
        await other.close()
        try:
            engine.ingest(
                [
                    KvBlocksStored(
                        event_id="s-1",
                        ts=time.time(),
                        instance_id=MP_INSTANCE,
                        block_hashes=CHAIN,
                        block_tokens=BLOCK_TOKENS,
                        token_ids=CHAIN_TOKENS,
                    )
                ]
            )
            engine.drain()
            assert len(sink.tokens) == len(CHAIN)
            await sink.submit([pin_order("pin-6", ttl_seconds=60.0)])
            await sink.settle()
            engine.drain()
            text = engine.metrics.exposition().decode()
        finally:
            await engine.close()
        assert 'kvprefetch_events_ingested_total{type="order_progress"} 1.0' in text
        assert 'kvprefetch_lmcache_order_failures_total{reason="unreachable"} 1.0' in text

    asyncio.run(main())


def test_build_sink_needs_the_model_name_and_an_http_url() -> None:
    from app.core.errors import ConfigError

    with pytest.raises(ConfigError, match="KVP_LMCACHE_MODEL_NAME"):
        build_sink(Settings(order_sink="lmcache"))
    with pytest.raises(ConfigError, match="KVP_LMCACHE_COORDINATOR_URL"):
        build_sink(
            Settings(
                order_sink="lmcache", lmcache_model_name=MODEL, lmcache_coordinator_url="tcp://x"
            )
        )


def test_a_holder_fenced_out_after_taking_orders_sends_lmcache_nothing(coordinator: str) -> None:
    """The planning lease lapses between the submit and the orders' calls (the holder paused
    past it): the orders fail `fenced` and the coordinator is asked nothing."""

    async def main() -> None:
        sink, reports, metrics = make_sink(coordinator)
        holding: list[str | None] = ["a|1"]
        sink.fence = Fence("kvp:planner", lambda: holding[0])
        try:
            demote = order("dm-f", MP_INSTANCE, kind="demote", source_tier=None, block_hashes=CHAIN)
            assert await sink.submit([pin_order("pin-f", ttl_seconds=3600.0), demote]) == [
                "pin-f",
                "dm-f",
            ]
            holding[0] = None  # before either order's first call
            await sink.settle()
            assert pins(coordinator) == []
            assert sink.pins_held == 0
        finally:
            await sink.close()
        for order_id in ("pin-f", "dm-f"):
            [(status, reason)] = reports.of(order_id)
            assert status == "failed" and reason is not None and "FENCED" in reason
        assert sample(metrics, "kvprefetch_lmcache_order_failures_total", reason="fenced") == 2

    asyncio.run(main())
