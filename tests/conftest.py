"""Shared fixtures. Redis tests use the real server; a missing server fails them with a clear message."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

REDIS_URL = os.environ.get("KVP_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
REPO = Path(__file__).resolve().parent.parent
TRACES = REPO.parent / "shared" / "traces"


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The real Redis the tests use; fails (never skips) when it does not answer."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(
            f"Redis is required at {REDIS_URL} (set KVP_TEST_REDIS_URL) and did not answer: {exc}. "
            "Start it with: redis-server --daemonize yes --port 6379 --save ''",
            pytrace=False,
        )
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix of its own for each test, so tests never see each other's keys."""
    return f"kvptest-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def clean_redis(redis_url: str, redis_prefix: str) -> Iterator[str]:
    """Yields the prefix; deletes every key under it afterwards."""
    import redis

    yield redis_prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{redis_prefix}:*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i : i + 500])
    finally:
        client.close()


@contextmanager
def live_server(app: Any, hang_guard_seconds: float = 30.0) -> Iterator[str]:
    """Serve `app` with uvicorn in a thread, on a port bound before it starts (no race); yields its URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + hang_guard_seconds
    while not server.started:
        assert thread.is_alive(), "uvicorn exited during startup"
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(hang_guard_seconds)
        sock.close()


def trace_slice(tmp_path: Path, trace_name: str, requests: int) -> Path:
    """The first `requests` lines of a shared trace, as a file of its own (named e.g. synthetic300.jsonl)."""
    lines = (TRACES / f"mooncake_{trace_name}.jsonl").read_text().splitlines(keepends=True)[:requests]
    path = tmp_path / f"{trace_name.split('_')[0]}{requests}.jsonl"
    path.write_text("".join(lines))
    return path
