"""vLLM intake throughput: batches/s and KV events/s from 8 ZMQ publishers through the subscriber
into the engine, beside the same batches posted over HTTP, in the same run.

- ZMQ: a child process (`python -m bench.vllm_intake publish`) binds `publishers` PUB sockets
  and, told to go, sends every batch as vLLM 0.33 does (three frames; msgpack
  `[ts, events, rank]`, events as maps with a "type"), encoded before the clock starts. This
  process runs an Engine (memory store, the event log in a temp dir, fsync at its default, its
  loops running, as the service runs it) subscribed to them by KVP_VLLM_KV_ENDPOINTS; the clock
  runs from "go" until the subscriber has handed every batch to the ingestor.
- HTTP: the service as its own process (bench/_server.py, one uvicorn worker, the same settings),
  sent the very same batches as `vllm_kv_events` JSON, `per_post` batches a POST, from
  `concurrency` connections; the clock runs over the posts.

A KV event is one of vLLM's (BlockStored with 2 block hashes and 32 token ids, or BlockRemoved).
A batch holds what one engine step published: vLLM 0.33's own publisher sent 1 or 2 events a batch
(56,108 events in 40,000 batches from 8 engines, a mean of 1.4), so that is the default size, each
batch 1 or 2 events drawn to that mean; `--events-per-batch 16` is the size this bench used before.
Every round uses fresh instance ids, so every batch is new to both; the figures are medians over
rounds, the two paths alternating which goes first.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import orjson

from bench._util import BenchError, Server, child_env, info, machine, median

DEFAULT_PUBLISHERS = 8
DEFAULT_BATCHES = 2500  # per publisher per round
# vLLM 0.33's publisher, measured: 56,108 KV events in 40,000 batches from 8 engines.
VLLM_EVENTS_PER_BATCH = 1.4
TARGET_BATCHES_PER_SECOND = 10_000


def payloads(
    instance: str, batches: int, seed: int, events_per_batch: float = VLLM_EVENTS_PER_BATCH
) -> list[tuple[bytes, int]]:
    """One publisher's batches as vLLM encodes them ([ts, [event maps], rank]), each with its
    count of events: the whole part of `events_per_batch`, one more with the fraction's chance."""
    rng = random.Random(f"{seed}:{instance}")
    whole, fraction = int(events_per_batch), events_per_batch - int(events_per_batch)
    ts = time.time() - 60.0
    out = []
    stored: list[int] = []
    i = 0  # the publisher's events so far: every fourth a removal
    for b in range(batches):
        events: list[dict[str, Any]] = []
        for _ in range(whole + (rng.random() < fraction)):
            i += 1
            if i % 4 == 0 and stored:
                events.append(
                    {"type": "BlockRemoved", "block_hashes": [stored.pop()], "medium": "GPU"}
                )
                continue
            hashes = [rng.getrandbits(64) for _ in range(2)]
            stored.extend(hashes)
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": hashes,
                    "parent_block_hash": rng.getrandbits(64),
                    "token_ids": [rng.randrange(128_000) for _ in range(32)],
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "group_idx": 0,
                    "session_id": f"{instance}-s{b % 4}",
                }
            )
        out.append((msgspec.msgpack.encode([ts + b * 0.01, events, 0]), len(events)))
    return out


def instance_ids(tag: str, publishers: int) -> list[str]:
    return [f"bench-{tag}-{p}" for p in range(publishers)]


# -- the publisher process -------------------------------------------------------------------


def publish_main(argv: list[str]) -> None:
    """publish TAG PUBLISHERS BATCHES SEED EVENTS_PER_BATCH: bind, print the ports, wait for
    "go", send all."""
    import zmq

    tag, publishers, batches, seed = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    events_per_batch = float(argv[4])
    ctx: zmq.Context = zmq.Context.instance()
    socks, ports, frames = [], [], []
    for instance in instance_ids(tag, publishers):
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.SNDHWM, 0)  # nothing dropped: the bench measures the subscriber
        ports.append(s.bind_to_random_port("tcp://127.0.0.1"))
        socks.append(s)
        frames.append(
            [
                [b"", seq.to_bytes(8, "big"), p]
                for seq, (p, _) in enumerate(payloads(instance, batches, seed, events_per_batch))
            ]
        )
    print(" ".join(map(str, ports)), flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    # Round-robin over the publishers, as 8 engines stepping at once would interleave.
    for b in range(batches):
        for s, fs in zip(socks, frames):
            s.send_multipart(fs[b])
    print("sent", flush=True)
    sys.stdin.readline()  # held open until the parent has read everything
    for s in socks:
        s.close(linger=1000)


# -- the ZMQ path -----------------------------------------------------------------------------


def _zmq_round(
    tag: str, publishers: int, batches: int, seed: int, events_per_batch: float, workdir: Path
) -> tuple[int, float]:
    """The KV events sent, and the seconds from "go" until the subscriber handed every batch to
    the ingestor."""
    from app.core.config import Settings
    from app.engine import Engine

    total = sum(
        n
        for instance in instance_ids(tag, publishers)
        for _, n in payloads(instance, batches, seed, events_per_batch)
    )
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.vllm_intake", "publish", tag, str(publishers),
         str(batches), str(seed), repr(events_per_batch)],
        env=child_env({}),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    try:
        ports = child.stdout.readline().split()
        if len(ports) != publishers:
            raise BenchError("the publisher process did not start")
        endpoints = " ".join(
            f"{i}=tcp://127.0.0.1:{port}" for i, port in zip(instance_ids(tag, publishers), ports)
        )
        settings = Settings(
            data_dir=workdir / f"zmq-{tag}",
            replica_id="bench",
            vllm_kv_endpoints=endpoints,
            model_dir=workdir / "no-model",
        )

        async def measure() -> float:
            engine = Engine(settings)
            await engine.start()
            try:
                assert engine.vllm is not None
                # Every SUB connected: a PUB sends to none before (no replay socket here).
                connect_by = time.perf_counter() + 30
                while engine.vllm.totals.connects < publishers:
                    if time.perf_counter() > connect_by:
                        raise BenchError("the subscriber did not connect to every publisher")
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)  # and its subscription reached the publisher
                child.stdin.write("go\n")  # type: ignore[union-attr]
                child.stdin.flush()  # type: ignore[union-attr]
                t0 = time.perf_counter()
                deadline = t0 + 120
                while engine.vllm.totals.events < total:
                    if time.perf_counter() > deadline:
                        raise BenchError(
                            f"the subscriber took {engine.vllm.totals.events} of {total} events "
                            f"in 120 s (lost {engine.vllm.totals.lost}, refused "
                            f"{engine.vllm.totals.bad_input})"
                        )
                    await asyncio.sleep(0.002)
                elapsed = time.perf_counter() - t0
                if engine.vllm.totals.lost or engine.vllm.totals.bad_input:
                    raise BenchError(f"the subscriber lost or refused: {engine.vllm.totals}")
                return elapsed
            finally:
                await engine.close()

        return total, asyncio.run(measure())
    finally:
        child.stdin.close()
        child.wait(30)


# -- the HTTP path ----------------------------------------------------------------------------


def _http_bodies(
    tag: str, publishers: int, batches: int, seed: int, events_per_batch: float, per_post: int
) -> tuple[list[bytes], int]:
    """The POST bodies, `per_post` batches each, and the KV events they hold."""
    from app.ingest.vllm.wire import VllmEndpoint, decode_batch

    posted, events = [], 0
    for instance in instance_ids(tag, publishers):
        ep = VllmEndpoint(instance, 0, "tcp://unused:1")
        for seq, (p, n) in enumerate(payloads(instance, batches, seed, events_per_batch)):
            posted.append(decode_batch(ep, seq, p).model_dump(mode="json", exclude_none=True))
            events += n
    bodies = [
        orjson.dumps({"events": posted[i : i + per_post]}) for i in range(0, len(posted), per_post)
    ]
    return bodies, events


def run(
    *,
    rounds: int = 3,
    publishers: int = DEFAULT_PUBLISHERS,
    batches: int = DEFAULT_BATCHES,
    events_per_batch: float = VLLM_EVENTS_PER_BATCH,
    per_post: int = 32,
    concurrency: int = 3,
    seed: int = 0,
    data_dir: Path | None = None,
) -> dict[str, Any]:
    from bench.ingest import new_clients, post_all

    if min(rounds, publishers, batches, per_post, concurrency) < 1:
        raise ValueError("rounds, publishers, batches, per_post and concurrency must be >= 1")
    if events_per_batch < 1:
        raise ValueError("events_per_batch must be >= 1")
    workdir = Path(tempfile.mkdtemp(prefix="kvp-bench-vllm-", dir=data_dir))
    batches_per_round = publishers * batches
    info(
        f"bench vllm-intake: {rounds} rounds of {publishers} publishers x {batches} batches of "
        f"{events_per_batch:g} KV events on average ({batches_per_round:,} batches a round), "
        f"in {workdir}"
    )
    # Per path: (batches/s, KV events/s) of each round.
    samples: dict[str, list[tuple[float, float]]] = {"zmq": [], "http": []}
    server = Server(
        "service",
        workdir=workdir,
        env={"KVP_STORE": "memory", "KVP_DATA_DIR": str(workdir / "http"), "KVP_REPLICA_ID": "b"},
    )
    clients: list[Any] = []
    try:
        server.wait_ready()
        clients = new_clients(concurrency)
        warm, _ = _http_bodies("warm", 1, 8, seed, events_per_batch, 4)
        post_all(clients, server.url + "/v1/events", warm, None)
        for r in range(rounds):
            bodies, http_events = _http_bodies(
                f"h{r}", publishers, batches, seed, events_per_batch, per_post
            )

            def http(bodies: list[bytes] = bodies, events: int = http_events) -> tuple[int, float]:
                try:
                    elapsed = post_all(
                        clients,
                        server.url + "/v1/events",
                        bodies,
                        b'"duplicates":[],"rejected":[]',
                    )
                except BenchError as exc:
                    raise BenchError(f"{exc}\n--- service log ---\n{server.log_tail()}") from None
                return events, elapsed

            def zmq(r: int = r) -> tuple[int, float]:
                return _zmq_round(f"z{r}", publishers, batches, seed, events_per_batch, workdir)

            order: list[tuple[str, Callable[[], tuple[int, float]]]] = [
                ("zmq", zmq),
                ("http", http),
            ]
            line = []
            for name, fn in order if r % 2 == 0 else order[::-1]:
                events, elapsed = fn()
                samples[name].append((batches_per_round / elapsed, events / elapsed))
                line.append(
                    f"{name} {batches_per_round / elapsed:,.0f} batches/s "
                    f"({events / elapsed:,.0f} KV events/s)"
                )
            info(f"  round {r + 1}/{rounds}: " + ", ".join(line))
    finally:
        for c in clients:
            c.close()
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    zmq_bps, http_bps = (median([b for b, _ in samples[k]]) for k in ("zmq", "http"))
    zmq_eps, http_eps = (median([e for _, e in samples[k]]) for k in ("zmq", "http"))
    return {
        "zmq_batches_per_second": round(zmq_bps, 1),
        "zmq_events_per_second": round(zmq_eps, 1),
        "http_batches_per_second": round(http_bps, 1),
        "http_events_per_second": round(http_eps, 1),
        "ratio_zmq_to_http": round(zmq_bps / http_bps, 3),
        "target_batches_per_second": TARGET_BATCHES_PER_SECOND,
        "within_target": zmq_bps >= TARGET_BATCHES_PER_SECOND,
        "rounds": rounds,
        "publishers": publishers,
        "batches_per_publisher": batches,
        "events_per_batch": events_per_batch,
        "batches_per_post": per_post,
        "concurrency": concurrency,
        "samples": {
            k: [{"batches_per_second": round(b, 1), "events_per_second": round(e, 1)} for b, e in v]
            for k, v in samples.items()
        },
        **machine(),
    }


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "publish":
        publish_main(sys.argv[2:])
