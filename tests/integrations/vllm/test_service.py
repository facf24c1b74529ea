"""The two ways in, as real processes: the service subscribed by KVP_VLLM_KV_ENDPOINTS, and
`kvprefetch connect vllm` posting to a service over HTTP. A vLLM publisher (captured frames,
publisher.py) feeds each; the service's /v1/locations and /metrics are read back. Every socket
binds port 0 and reads back where it is (service.py, publisher.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.integrations.vllm.publisher import FramePublisher, stream
from tests.integrations.vllm.service import REPO, Service, child_env, wait_for
from tests.integrations.vllm.test_attacks import DEEP

pytestmark = pytest.mark.slow


def locations(url: str) -> dict[str, int]:
    doc = httpx.get(f"{url}/v1/locations", timeout=5).json()
    return {loc["location"]: loc["blocks"] for loc in doc["locations"]}


def ingested_vllm_batches(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    m = re.search(r'^kvprefetch_events_ingested_total\{type="vllm_kv_events"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def feed(pub: FramePublisher, deep_after: int | None = None) -> None:
    # array_int: 4 batches storing 2 GPU blocks each, one removed, one CPU copy; with
    # `deep_after`, a message nested 100,000 deep under the next sequence number after that
    # batch, the later ones numbered on past it
    time.sleep(0.5)
    for i, frames in enumerate(stream("array_int")):
        if deep_after is not None and i > deep_after:
            frames = [frames[0], (i + 1).to_bytes(8, "big"), frames[2]]
        pub.publish(frames)
        if i == deep_after:
            pub.publish([b"", (i + 1).to_bytes(8, "big"), DEEP])


def test_the_service_subscribes_to_the_endpoints_it_is_given(tmp_path: Path) -> None:
    pub = FramePublisher()
    server = Service(tmp_path, {"KVP_VLLM_KV_ENDPOINTS": pub.spec("gpu-0")})
    try:
        server.wait_ready()
        feed(pub)
        wait_for(lambda: ingested_vllm_batches(server.url) == 4, "4 batches ingested")
        assert locations(server.url) == {"hbm@gpu-0": 7, "host@gpu-0": 1}
    finally:
        server.kill()
        pub.close()


def test_connect_vllm_posts_a_publishers_batches_to_the_service(tmp_path: Path) -> None:
    """A message nested too deep among the batches: refused, reported, the rest posted."""
    pub = FramePublisher()
    server = Service(tmp_path, {})
    connect = None
    try:
        server.wait_ready()
        connect = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvprefetch_cli",
                "connect",
                "vllm",
                "--service",
                server.url,
                "--endpoint",
                pub.endpoint,
                "--replay-endpoint",
                str(pub.replay_endpoint),
                "--instance-id",
                "gpu-0",
            ],
            cwd=REPO,
            env=child_env({}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        feed(pub, deep_after=1)
        wait_for(lambda: ingested_vllm_batches(server.url) == 4, "4 batches ingested")
        assert locations(server.url) == {"hbm@gpu-0": 7, "host@gpu-0": 1}
        connect.send_signal(signal.SIGINT)
        out, err = connect.communicate(timeout=60)
        assert connect.returncode == 0, err[-2000:]
        # A first-contact replay may have resent some: the service took each batch once.
        assert re.search(
            r"\d+ batches \(\d+ events\) posted, .* 0 lost, 0 restarts, [1-9]\d* refused "
            r"\(nesting [1-9]\d*\), 0 intake deaths",
            out,
        ), out
        assert ingested_vllm_batches(server.url) == 4
    finally:
        if connect is not None and connect.poll() is None:
            connect.kill()
            connect.wait()
        server.kill()
        pub.close()
    assert os.path.isdir(tmp_path / "var" / "events")
