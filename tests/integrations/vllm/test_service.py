"""The two ways in, as real processes: the service subscribed by KVP_VLLM_KV_ENDPOINTS, and
`kvprefetch connect vllm` posting to a service over HTTP. A vLLM publisher (captured frames,
publisher.py) feeds each; the service's /v1/locations and /metrics are read back."""

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

from bench._util import Server, child_env
from tests.integrations.vllm.publisher import FramePublisher, free_ports, stream

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]


def locations(url: str) -> dict[str, int]:
    doc = httpx.get(f"{url}/v1/locations", timeout=5).json()
    return {loc["location"]: loc["blocks"] for loc in doc["locations"]}


def ingested_vllm_batches(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    m = re.search(r'^kvprefetch_events_ingested_total\{type="vllm_kv_events"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_for(check: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.05)


def feed(pub: FramePublisher) -> None:
    # array_int: 4 batches storing 2 GPU blocks each, one removed, one CPU copy
    time.sleep(0.5)
    for frames in stream("array_int"):
        pub.publish(frames)


def service_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        "KVP_DATA_DIR": str(tmp_path / "var"),
        "KVP_LOG_FSYNC": "false",
        "KVP_MODEL_DIR": str(tmp_path / "no-model"),
        **extra,
    }


def test_the_service_subscribes_to_the_endpoints_it_is_given(tmp_path: Path) -> None:
    port, replay = free_ports(2)
    pub = FramePublisher(port, replay)
    server = Server(
        "service",
        workdir=tmp_path,
        env=service_env(
            tmp_path,
            KVP_VLLM_KV_ENDPOINTS=f"gpu-0=tcp://127.0.0.1:{port},replay=tcp://127.0.0.1:{replay}",
        ),
    )
    try:
        server.wait_ready()
        feed(pub)
        wait_for(lambda: ingested_vllm_batches(server.url) == 4, "4 batches ingested")
        assert locations(server.url) == {"hbm@gpu-0": 7, "host@gpu-0": 1}
    finally:
        server.stop()
        pub.close()


def test_connect_vllm_posts_a_publishers_batches_to_the_service(tmp_path: Path) -> None:
    port, replay = free_ports(2)
    pub = FramePublisher(port, replay)
    server = Server("service", workdir=tmp_path, env=service_env(tmp_path))
    connect = None
    try:
        server.wait_ready()
        connect = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "app.cli",
                "connect",
                "vllm",
                "--service",
                server.url,
                "--endpoint",
                f"tcp://127.0.0.1:{port}",
                "--replay-endpoint",
                f"tcp://127.0.0.1:{replay}",
                "--instance-id",
                "gpu-0",
            ],
            cwd=REPO,
            env=child_env({}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        feed(pub)
        wait_for(lambda: ingested_vllm_batches(server.url) == 4, "4 batches ingested")
        assert locations(server.url) == {"hbm@gpu-0": 7, "host@gpu-0": 1}
        connect.send_signal(signal.SIGINT)
        out, err = connect.communicate(timeout=30)
        assert connect.returncode == 0, err[-2000:]
        # A first-contact replay may have resent some: the service took each batch once.
        assert re.search(
            r"\d+ batches \(\d+ events\) posted, .* 0 lost, 0 restarts, 0 refused", out
        )
        assert ingested_vllm_batches(server.url) == 4
    finally:
        if connect is not None and connect.poll() is None:
            connect.kill()
            connect.wait()
        server.stop()
        pub.close()
    assert os.path.isdir(tmp_path / "var" / "events")
