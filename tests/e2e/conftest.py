"""Run the service as a real, separate process: `python -m kvprefetch_cli serve --fd N` on a
listening socket the test holds (tests/ports.py), so no other process can take its port.

`service_factory(data_dir=None)` returns a `ServiceProcess` (not yet started) with a temp data
dir of its own. It can be started, killed with SIGKILL, and started again on the same socket and
data dir, which is what a crash and a restart look like to the service. Every process started
through the factory is killed in the fixture's teardown, whether the test passed or not.

`routers` is a list the test fills with `tests.e2e.streams.Router`s; whatever happened, their
threads are stopped and their clients closed at teardown (without waiting on their queues).

`private_redis` is a `RedisServer`: a redis-server of the test's own on a quiet port (retried on
another when taken), that the test may stop and start again on the same port and data dir (its
append-only file keeps the data).
A missing redis-server binary fails the test, never skips it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import pytest
import redis

from tests.e2e.streams import Router
from tests.ports import Refuser, listener, port_of, retry_in_use

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_SECONDS = 30.0


@contextmanager
def redis_workers(
    tmp_path: Path,
    redis_url: str,
    prefix: str,
    metrics_dir: Path,
    extra_env: dict[str, str] | None = None,
    workers: int = 2,
) -> Iterator[str]:
    """`kvprefetch serve --workers N` on the Redis store, the heuristic and no loops (quick to
    start, quiet on 2 cores); yields its URL once /readyz answers, and stops the whole process
    group."""
    work = tmp_path / "work"
    work.mkdir()
    sock = listener()
    port = port_of(sock)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
    env.update(
        {
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
            "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
            "KVP_DATA_DIR": str(tmp_path / "data"),
            "KVP_REDIS_URL": redis_url,
            "KVP_REDIS_PREFIX": prefix,
            "KVP_REPLICA_ID": "e2e",
            "KVP_LOG_FSYNC": "false",
            "KVP_MODEL_DIR": str(tmp_path / "no-model"),
            "KVP_SCORE_INTERVAL_SECONDS": "0",
            "KVP_PLAN_INTERVAL_SECONDS": "0",
            "KVP_DASHBOARD_SAMPLE_SECONDS": "0",
            **(extra_env or {}),
        }
    )
    log_path = work / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvprefetch_cli",
                "serve",
                "--fd",
                str(sock.fileno()),
                "--store",
                "redis",
                "--workers",
                str(workers),
            ],
            cwd=work,
            env=env,
            pass_fds=[sock.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while True:
            assert proc.poll() is None, (
                f"the service exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}"
            )
            assert time.monotonic() < deadline, (
                f"the service was not ready:\n{log_path.read_text()[-4000:]}"
            )
            try:
                if httpx.get(f"{url}/readyz", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        yield url
    finally:
        # The whole group (the supervisor and its workers), by the id of the session we started.
        with_group = os.getpgid(proc.pid) if proc.poll() is None else None
        if with_group is not None:
            os.killpg(with_group, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(with_group, signal.SIGKILL)
                proc.wait(timeout=10)
        sock.close()


class ServiceProcess:
    """One service: a listening socket and a data dir that outlive the processes started on them.
    While no process serves it, a connection is reset, as a crashed server's port would refuse it
    (never queued for the next process: a client's abandoned try must not be served later)."""

    def __init__(self, data_dir: Path, work_dir: Path, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.listener = listener()
        self.port = port_of(self.listener)
        self.refuser = Refuser(self.listener)
        self.work_dir = work_dir
        self.extra_env = dict(env or {})
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._log_path: Path | None = None

    @property
    def events_dir(self) -> Path:
        return self.data_dir / "events"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _env(self) -> dict[str, str]:
        # Nothing from the developer's KVP_* settings leaks in (a KVP_STORE=redis, say).
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
        env["PYTHONUNBUFFERED"] = "1"
        env.update(
            {
                "KVP_DATA_DIR": str(self.data_dir),
                "KVP_STORE": "memory",
                "KVP_HOST": "127.0.0.1",
                "KVP_PORT": str(self.port),
                "KVP_REPLICA_ID": "e2e",
            }
        )
        env.update(self.extra_env)
        return env

    def start(self, timeout: float = READY_TIMEOUT_SECONDS) -> None:
        """Start the process and wait until GET /readyz answers 200."""
        assert not self.running, "the service is already running"
        self.refuser.stop()
        self.starts += 1
        self._log_path = self.work_dir / f"server-{self.starts}.log"
        with open(self._log_path, "wb") as log:
            # cwd is a scratch dir so that no .env of the checkout is read by Settings.
            fd = self.listener.fileno()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvprefetch_cli", "serve", "--fd", str(fd)],
                cwd=self.work_dir,
                env=self._env(),
                pass_fds=[fd],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        last_error = "no answer yet"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the service exited with {self.proc.returncode} before it was ready:\n"
                    f"{self.log_tail()}"
                )
            try:
                r = httpx.get(f"{self.url}/readyz", timeout=2.0)
                if r.status_code == 200:
                    return
                last_error = f"/readyz answered {r.status_code}: {r.text[:200]}"
            except httpx.TransportError as exc:
                last_error = repr(exc)
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(
            f"the service was not ready within {timeout} s ({last_error}):\n{self.log_tail()}"
        )

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to flush, close or clean up anything."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.refuser.start()

    def restart(self, timeout: float = READY_TIMEOUT_SECONDS) -> None:
        self.kill()
        self.start(timeout)

    def log_tail(self, chars: int = 4000) -> str:
        if self._log_path is None or not self._log_path.exists():
            return "(no server log)"
        return self._log_path.read_text(errors="replace")[-chars:]

    def log_text(self) -> str:
        """The whole log of the process started last."""
        return self._log_path.read_text(errors="replace") if self._log_path is not None else ""


@pytest.fixture
def service_factory(tmp_path: Path) -> Iterator[Callable[..., ServiceProcess]]:
    made: list[ServiceProcess] = []

    def make(data_dir: Path | None = None, env: dict[str, str] | None = None) -> ServiceProcess:
        n = len(made)
        work_dir = tmp_path / f"service-{n}"
        work_dir.mkdir()
        svc = ServiceProcess(data_dir or work_dir / "data", work_dir, env)
        made.append(svc)
        return svc

    try:
        yield make
    finally:
        for svc in made:
            try:
                svc.kill()
            except Exception:
                if svc.proc is not None and svc.proc.poll() is None:
                    svc.proc.kill()
            svc.refuser.stop()
            svc.listener.close()


@pytest.fixture
def service(service_factory: Callable[..., ServiceProcess]) -> ServiceProcess:
    """A started service with a fresh data dir."""
    svc = service_factory()
    svc.start()
    return svc


class RedisServer:
    """A redis-server process on `port` with its data in `data_dir`.

    Every write is in the append-only file, fsynced, before Redis answers it (`appendfsync
    always`): a stop, graceful or kill -9, and a start on the same dir lose nothing Redis
    acknowledged, as a production Redis configured for durability would.
    """

    def __init__(self, binary: str, data_dir: Path, port: int) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir / "redis.log"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 10.0) -> None:
        assert not self.running, "redis-server is already running"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.data_dir),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
                "--daemonize",
                "no",
                "--logfile",
                str(self.log_path),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        client = redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=1, socket_connect_timeout=1
        )
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited with {self.proc.returncode}:\n{self.log_tail()}"
                    )
                try:
                    if client.ping():
                        return
                except redis.RedisError:  # refused, or still loading its data
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(
                        f"redis-server did not answer within {timeout} s:\n{self.log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM: Redis flushes its append-only file and exits, as on a planned restart."""
        if self.running:
            assert self.proc is not None
            self.proc.terminate()
            self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log_tail(self, chars: int = 3000) -> str:
        return (
            self.log_path.read_text(errors="replace")[-chars:]
            if self.log_path.exists()
            else "(no log)"
        )


def redis_server_binary() -> str:
    """redis-server's path; fails (never skips) the test when there is none."""
    binary = os.environ.get("KVP_TEST_REDIS_SERVER") or shutil.which("redis-server")
    if binary is None and os.access("/usr/bin/redis-server", os.X_OK):
        binary = "/usr/bin/redis-server"
    if binary is None:
        pytest.fail(
            "redis-server is required to start a Redis of the test's own and was not found on "
            "PATH (set KVP_TEST_REDIS_SERVER to its path, or install it: apt-get install "
            "redis-server)",
            pytrace=False,
        )
    return binary


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A started redis-server of this test's own; killed at teardown whatever happened."""
    binary = redis_server_binary()
    made: list[RedisServer] = []

    def start(port: int) -> RedisServer:
        made.append(RedisServer(binary, tmp_path / "redis" / str(port), port))
        made[-1].start()
        return made[-1]

    try:
        yield retry_in_use(start)
    finally:
        for server in made:
            server.kill()


@pytest.fixture
def routers() -> Iterator[list[Router]]:
    made: list[Router] = []
    try:
        yield made
    finally:
        for r in made:
            r.stop.set()
        for r in made:
            r.thread.join(10)
            r.client.close(timeout=0)
