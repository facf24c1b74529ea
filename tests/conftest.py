"""Shared fixtures. Redis tests use the real server; a missing server fails them with a clear
message."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

# LightGBM trains on OpenMP threads, which spin while they wait for work. With more busy threads
# than cores (two xdist workers on two cores, or any other load) the spinning took tests/training
# from 4 s to 40 s; passive threads sleep instead. It changes no result, and it is set before
# anything loads LightGBM (the service and bench processes the tests start inherit it).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REDIS_URL = os.environ.get("KVP_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
REPO = Path(__file__).resolve().parent.parent
TRACES = REPO.parent / "shared" / "traces"

# Under `make test` (pytest-xdist, --dist loadgroup) each test module keeps to one worker, so its
# module-scoped fixtures (a live service, a fuzzed app, a fetched tool) are built once, not once
# per worker. Tests whose id starts with one of these prefixes go to the group named instead (the
# first prefix that matches):
XDIST_GROUPS = {
    # Real service processes whose latencies and stalls are measured: one at a time, so two never
    # fight over the two cores (the other workers run the other tests meanwhile).
    "tests/e2e/": "e2e",
    # The full traces' bounds replay what no other test does: a group of their own, so that the
    # workers can share the sim's replays.
    "tests/sim/test_policies.py::test_oracle_and_belady_bound_none_on_full_traces": "sim-full",
    # test_policies' other bounds reuse test_cluster's cached replays (checked_replay).
    "tests/sim/test_cluster.py": "sim-replays",
    "tests/sim/test_policies.py": "sim-replays",
}


def xdist_group_of(nodeid: str) -> str:
    """The group a test runs in under xdist: its module's, or the one XDIST_GROUPS names."""
    for prefix, group in XDIST_GROUPS.items():
        if nodeid.startswith(prefix):
            return group
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; absent with -p no:xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """--dist loadgroup by the groups above. xdist's own loadgroup reads xdist_group marks into
    each test's id, which pytest 9.2's ids no longer take, so every test went its own way."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

        def schedule(self) -> None:
            # xdist hands out tests by id: of several tests with one id only the first would run.
            collection = next(iter(self.registered_collections.values()), [])
            twice = sorted(n for n, count in Counter(collection).items() if count > 1)
            if twice:
                raise pytest.UsageError(
                    f"tests sharing an id would not all run under xdist: {twice}"
                )
            super().schedule()

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker, the groups holding slow tests first, the wide ones above (the longest)
    before the modules, so that no long group is left to run by itself at the end (the Makefile's
    --no-loadscope-reorder keeps this order)."""
    # Schemathesis names each operation's test "name[GET /path]", but pytest 9.2 builds the id
    # from the function's name alone, so tests/api/test_fuzz.py's 18 tests share one id (and
    # xdist would run one of them): each gets the id its name says.
    ids = Counter(item.nodeid for item in items)
    for item in items:
        if ids[item.nodeid] > 1 and item.parent is not None:
            item._id = item.parent.id.child(item.name)  # type: ignore[attr-defined]
    if not hasattr(config, "workerinput"):
        return  # not under xdist: the order stays as collected
    groups = {item: xdist_group_of(item.nodeid) for item in items}
    slow = {groups[item] for item in items if item.get_closest_marker("slow") is not None}
    wide = set(XDIST_GROUPS.values())
    # Stable: collection order within each rank.
    items.sort(key=lambda item: (groups[item] not in slow, groups[item] not in wide))


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
    """Serve `app` with uvicorn in a thread, on a port bound before it starts (no race); yields
    its URL."""
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
    """The first `requests` lines of a shared trace, as a file of its own (named e.g.
    synthetic300.jsonl)."""
    lines = (
        (TRACES / f"mooncake_{trace_name}.jsonl").read_text().splitlines(keepends=True)[:requests]
    )
    path = tmp_path / f"{trace_name.split('_')[0]}{requests}.jsonl"
    path.write_text("".join(lines))
    return path


def small_model_dir(folder: Path) -> Path:
    """A small model over the service's features (five trees of four leaves) in `folder`: for
    the tests that compile a model with lleaves to check a command's output, not the bundled
    model's quality (whose 1,152 trees take a minute or two to compile)."""
    import lightgbm as lgb
    import numpy as np

    from app.predict.features import FEATURES
    from app.predict.predictors import probe_rows

    rng = np.random.default_rng(5)
    x = probe_rows(2000, seed=9)
    y = (rng.random(len(x)) < 0.3).astype(float)
    booster = lgb.train(
        {"objective": "binary", "num_leaves": 4, "verbose": -1, "seed": 1},
        lgb.Dataset(x, y, feature_name=list(FEATURES)),
        num_boost_round=5,
    )
    folder.mkdir(parents=True, exist_ok=True)
    booster.save_model(str(folder / "model.txt"))
    return folder
