"""`kvprefetch-agent --tier mooncake` as processes: two agents of one instance on its Redis
Stream, a real `mooncake_master` and a pool holder on loopback TCP. The agent that takes an order
is killed with SIGKILL while its copy tasks run; the other claims the order once the claim idle
time has passed, copies the blocks onto its own segment, and the order is completed once.

The service is a small recorder of POST /v1/events (the agent's reports), answering 200 as the
service does; the service itself is tested with the buffer tier in tests/e2e/test_agent_e2e.py.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis

from bench._util import quiet_port
from bench.mooncake_cluster import Holder, Master
from kvprefetch_client.agent.consumer import GROUP, default_stream_prefix, stream_key
from kvprefetch_client.agent.mooncake import store_key
from tests import agent_process
from tests.agent_process import AgentProcess
from tests.client.agent.test_mooncake import NS
from tests.e2e.test_agent_e2e import prefetch

INSTANCE = "gpu-0"
CLAIM_IDLE_SECONDS = 1.0
WAIT_LIMIT_SECONDS = 60.0
BLOCKS = list(range(1, 9))
BLOCK_BYTES = 4 << 20


class Recorder:
    """POST /v1/events, recorded; a duplicate event id is kept once, as the service keeps it."""

    def __init__(self) -> None:
        self.events: dict[str, dict[str, Any]] = {}
        self.posts = 0
        lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                with lock:
                    recorder.posts += 1
                    for event in json.loads(body)["events"]:
                        recorder.events.setdefault(event["event_id"], event)
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def progress(self, order_id: str) -> list[dict[str, Any]]:
        return [
            e
            for e in list(self.events.values())
            if e.get("type") == "order_progress" and e.get("order_id") == order_id
        ]

    def close(self) -> None:
        self.server.shutdown()


def mooncake_agent(
    name: str, work: Path, master: Master, service_url: str, redis_url: str, prefix: str
) -> AgentProcess:
    return AgentProcess(
        name,
        work,
        [
            "-m",
            "kvprefetch_client.agent",
            "--instance-id",
            INSTANCE,
            "--tier",
            "mooncake",
            "--mooncake-master",
            master.address,
            "--mooncake-metadata-url",
            master.metadata_url,
            "--mooncake-local-host",
            f"127.0.0.1:{quiet_port()}",
            "--mooncake-segment-bytes",
            str(128 << 20),
            "--mooncake-namespace",
            NS,
            "--service-url",
            service_url,
            "--poll-seconds",
            "0.1",
            "--consumer-name",
            name,
            "--claim-idle-seconds",
            str(CLAIM_IDLE_SECONDS),
        ],
        {"KVP_REDIS_URL": redis_url, "KVP_REDIS_PREFIX": prefix},
    ).start()


def wait_for(condition: Callable[[], Any], what: str, *agents: AgentProcess) -> Any:
    return agent_process.wait_for(
        condition, what, *agents, limit_seconds=WAIT_LIMIT_SECONDS, poll_seconds=0.01
    )


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Master, Holder, Recorder]]:
    # A dead client's copy tasks hold their objects until the master gives up on them (300 s by
    # default): the redelivered order waits for that, so the test shortens it.
    master = Master(
        tmp_path,
        flags=("--client_ttl=2", "--pending_task_timeout_sec=3", "--processing_task_timeout_sec=3"),
    )
    master.start()
    holder = Holder(master, tmp_path)
    recorder = Recorder()
    yield master, holder, recorder
    recorder.close()
    holder.close()
    master.stop()


def replica_segments(master: Master, key: str) -> list[str]:
    url = f"http://127.0.0.1:{master.metrics_port}/query_key?key={key}"
    with urllib.request.urlopen(url, timeout=5) as answer:
        doc = json.loads(answer.read())
    return [r["transport_endpoint_"] for r in doc.get("data", [])]


@pytest.mark.slow
@pytest.mark.redis
def test_an_agent_killed_mid_copy_leaves_the_order_to_another_that_does_it_once(
    cluster: tuple[Master, Holder, Recorder],
    redis_url: str,
    clean_redis: str,
    tmp_path: Path,
) -> None:
    master, holder, recorder = cluster
    for h in BLOCKS:
        assert holder.put(store_key(NS, h), BLOCK_BYTES) == 0
    victim = mooncake_agent("agent-a", tmp_path, master, recorder.url, redis_url, clean_redis)
    survivor: AgentProcess | None = None
    try:
        wait_for(victim.status_path.exists, "agent-a to start", victim)
        r = redis.Redis.from_url(redis_url)
        key = stream_key(default_stream_prefix(clean_redis), INSTANCE)
        r.xadd(key, {"msg": prefetch("o1", BLOCKS, 0.0, len(BLOCKS) * BLOCK_BYTES).to_json()})
        # Killed once it has started the order (its copy tasks take a master heartbeat or so).
        wait_for(lambda: recorder.progress("o1"), "agent-a to accept the order", victim)
        victim.kill()
        assert [e["status"] for e in recorder.progress("o1")] == ["accepted"]
        assert r.xpending(key, GROUP)["pending"] == 1  # held, unacked, by the dead agent

        survivor = mooncake_agent("agent-b", tmp_path, master, recorder.url, redis_url, clean_redis)
        done = wait_for(
            lambda: [e for e in recorder.progress("o1") if e["status"] != "accepted"],
            "agent-b to finish the order",
            survivor,
        )
        assert [e["status"] for e in done] == ["completed"], done
        assert done[0]["bytes"] == len(BLOCKS) * BLOCK_BYTES and done[0]["seconds"] > 0
        wait_for(lambda: r.xpending(key, GROUP)["pending"] == 0, "the ack", survivor)
        # The status file is written on the agent's next turn after the ack: waited for, not read
        # at once (a loaded machine read the one from before the copy).
        status = wait_for(
            lambda: (s := survivor.status()).get("completed") == 1 and s,
            "agent-b's status to count the order",
            survivor,
        )
        assert status["buffer_blocks"] == BLOCKS and status["completed"] == 1
        segment = status["mooncake_segment"]
        for h in BLOCKS:
            assert segment in replica_segments(master, store_key(NS, h))
        # Landed once: the blocks were reported stored by agent-b alone, and only once.
        stored = [e for e in recorder.events.values() if e["type"] == "kv_blocks_stored"]
        assert sorted(h for e in stored for h in e["block_hashes"]) == BLOCKS
    finally:
        victim.kill()
        if survivor is not None:
            survivor.stop()
