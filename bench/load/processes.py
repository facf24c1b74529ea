"""The bench's server processes, and what the OS says about them (RSS, CPU, load)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench._util import child_env


class BenchError(RuntimeError):
    """The service (or the ceiling, or a calibration) did not start or died: the message holds its log."""


class Proc:
    """A server process on a free port, its output in a log file."""

    def __init__(self, name: str, cmd_tail: list[str], *, workdir: Path, env: dict[str, str], port: int) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, *cmd_tail], cwd=workdir, env=child_env(env),
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, path: str, headers: dict[str, str], timeout: float = 90.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"the {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = httpx.get(self.url + path, headers=headers, timeout=2.0)
                if r.status_code == 200:
                    return
                last = f"{path} answered {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.1)
        raise BenchError(f"the {self.name} was not ready within {timeout:.0f} s ({last}):\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # uvicorn shuts down gracefully
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def rss(pid: int) -> int:
    import psutil

    p = psutil.Process(pid)
    total = p.memory_info().rss
    for c in p.children(recursive=True):
        try:
            total += c.memory_info().rss
        except psutil.Error:
            pass
    return int(total)


def cpu_seconds(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def cpu_pressure() -> float | None:
    """The share of the last 60 s some runnable task waited for a CPU (Linux PSI), in %."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(dict(kv.split("=") for kv in line.split()[1:])["avg60"])
    except (OSError, KeyError, ValueError, IndexError):
        return None


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None
