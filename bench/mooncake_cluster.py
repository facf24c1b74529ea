"""A real Mooncake cluster on loopback TCP for the bench (bench/mooncake.py) and the tests: a
`mooncake_master` (with its HTTP metadata server) and a pool holder, a store process of its own
that puts blocks.

The holder (`python -m bench.mooncake_cluster holder ...`) reads commands on stdin:
`put <key> <size>` puts `pattern(key, size)` with its own segment preferred and answers
`ok <rc>`; `health` answers `ok <health_check>`. It exits when stdin closes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from bench._util import quiet_port

REPO = Path(__file__).resolve().parents[1]
START_LIMIT_SECONDS = 30.0


def pattern(key: str, size: int) -> bytes:
    """Bytes that differ from key to key, so a block read back is the one that was put."""
    unit = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (unit * (size // len(unit) + 1))[:size]


def master_binary() -> str:
    found = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    if not Path(found).exists():
        raise RuntimeError("mooncake_master not found: run .ci/ensure-mooncake")
    return found


class Master:
    """A mooncake_master on ports chosen once, so a restart comes back at the same address."""

    def __init__(self, work: Path, lease_ms: int = 200, flags: tuple[str, ...] = ()) -> None:
        self.work = work
        self.rpc_port = quiet_port()
        self.http_port = quiet_port()
        self.metrics_port = quiet_port()
        self.lease_ms = lease_ms
        self.flags = flags
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def start(self) -> None:
        self.starts += 1
        with open(self.work / f"master-{self.starts}.log", "wb") as log:
            self.proc = self._popen(log)
        deadline = time.monotonic() + START_LIMIT_SECONDS
        while not _answers(self.rpc_port) or not _answers(self.http_port):
            assert self.proc.poll() is None, f"mooncake_master exited: {self.log_tail()}"
            assert time.monotonic() < deadline, "mooncake_master did not start"
            time.sleep(0.05)

    def _popen(self, log: IO[bytes]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                master_binary(),
                f"--rpc_port={self.rpc_port}",
                "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
                # Short leases, so a test's demote need not wait the default 10 s after a read.
                f"--default_kv_lease_ttl={self.lease_ms}",
                *self.flags,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def log_tail(self) -> str:
        path = self.work / f"master-{self.starts}.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class Holder:
    """The pool: a store process whose segment holds the blocks the tests put."""

    def __init__(self, master: Master, work: Path, segment_bytes: int = 256 << 20) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "client")])
        self.log_path = work / "holder.log"
        with open(self.log_path, "wb") as log:
            self.proc = self._popen(master, env, log, segment_bytes)
        line = self._line()
        assert line.startswith("ready "), f"holder did not start: {line!r} {self.log_tail()}"
        self.segment = line.split()[1]

    def _popen(
        self, master: Master, env: dict[str, str], log: IO[bytes], segment_bytes: int
    ) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.mooncake_cluster",
                "holder",
                master.address,
                master.metadata_url,
                f"127.0.0.1:{quiet_port()}",
                str(segment_bytes),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().decode().strip()

    def _ask(self, command: str) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()
        line = self._line()
        assert line.startswith("ok "), f"holder answered {line!r} to {command}: {self.log_tail()}"
        return int(line.split()[1])

    def put(self, key: str, size: int) -> int:
        return self._ask(f"put {key} {size}")

    def health(self) -> int:
        return self._ask("health")

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:]


def _serve_holder(
    master: str, metadata_url: str, host: str, segment_bytes: int, out: IO[str]
) -> None:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    store = MooncakeDistributedStore()
    rc = store.setup(host, metadata_url, segment_bytes, 64 << 20, "tcp", "", master)
    if rc != 0:
        print(f"setup failed {rc}", file=out, flush=True)
        return
    config = ReplicateConfig()
    config.preferred_segment = store.get_hostname()
    print(f"ready {store.get_hostname()}", file=out, flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["put"]:
            key, size = words[1], int(words[2])
            print(f"ok {store.put(key, pattern(key, size), config)}", file=out, flush=True)
        elif words[:1] == ["health"]:
            print(f"ok {store.health_check()}", file=out, flush=True)
        else:
            print(f"unknown {line.strip()}", file=out, flush=True)
    store.close()


if __name__ == "__main__" and sys.argv[1:2] == ["holder"]:
    _serve_holder(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.stdout)
