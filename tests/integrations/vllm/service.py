"""The service as a real process for the vLLM tests: `python -m kvprefetch_cli serve --port 0`, the
port it bound read back from its log (no port is picked before it is bound). `wrapper` runs the
service through a script of the test's (which may patch a module first, then calls the CLI)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
READY_TIMEOUT_SECONDS = 120.0
_LISTENING = re.compile(rb"Uvicorn running on http://127\.0\.0\.1:(\d+)")


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """No inherited KVP_* knobs; this checkout importable first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "client")])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


class Service:
    def __init__(self, workdir: Path, env: dict[str, str], wrapper: Path | None = None) -> None:
        self.workdir = workdir
        self.log_path = workdir / "service.log"
        workdir.mkdir(parents=True, exist_ok=True)
        entry = [str(wrapper)] if wrapper is not None else ["-m", "kvprefetch_cli"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *entry, "serve", "--host", "127.0.0.1", "--port", "0"],
                cwd=workdir,  # no .env of the checkout is read
                env=child_env(
                    {
                        "KVP_DATA_DIR": str(workdir / "var"),
                        "KVP_LOG_FSYNC": "false",
                        "KVP_MODEL_DIR": str(workdir / "no-model"),
                        "KVP_SCORE_INTERVAL_SECONDS": "0",
                        "KVP_PLAN_INTERVAL_SECONDS": "0",
                        "KVP_DASHBOARD_SAMPLE_SECONDS": "0",
                        **env,
                    }
                ),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.url = ""

    def log(self) -> str:
        return self.log_path.read_bytes().decode(errors="replace")

    def wait_ready(self, path: str = "/healthz") -> None:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the service exited with {self.proc.returncode}:\n{self.log()}"
                )
            if not self.url:
                m = _LISTENING.search(self.log_path.read_bytes())
                if m:
                    self.url = f"http://127.0.0.1:{int(m.group(1))}"
            if self.url:
                try:
                    if httpx.get(self.url + path, timeout=5.0).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.05)
        raise AssertionError(f"the service was not ready:\n{self.log()[-4000:]}")

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def rss_bytes(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        return int(m.group(1)) * 1024 if m else 0

    def terminate(self) -> float:
        """SIGTERM; the seconds it took to exit (printed by the tests, never asserted)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)
        return time.monotonic() - t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def wait_for(check: object, what: str, timeout: float = 60.0) -> None:
    """Poll until `check()`; the deadline is generous, for a busy machine."""
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.05)
