"""A transfer agent (`kvprefetch agent` or `kvprefetch-agent`) as a real process, for the suites
that kill one and watch another take over (tests/e2e/test_agent_e2e.py with the buffer tier,
tests/client/agent/test_mooncake_agents.py with Mooncake)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class AgentProcess:
    """`args` after the interpreter (`-m kvprefetch_cli agent ...`), which must not name the
    status file: it is added, at `<work>/<name>.json`. `env` on top of this environment less its
    KVP_ settings (so the test's are the only ones)."""

    def __init__(
        self, name: str, work: Path, args: Sequence[str], env: Mapping[str, str] | None = None
    ) -> None:
        self.name = name
        self.work = work
        self.status_path = work / f"{name}.json"
        self.log_path = work / f"{name}.log"
        self.args = [*args, "--status-file", str(self.status_path)]
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> AgentProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
        # The checkout's client too (as pytest's pythonpath has it), not an installed one.
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "client")])
        env.update(self.env)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *self.args],
                cwd=self.work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def status(self) -> dict[str, Any]:
        """The agent's status file, or {} before it writes one."""
        return json.loads(self.status_path.read_text()) if self.status_path.exists() else {}

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""


def wait_for(
    condition: Callable[[], Any],
    what: str,
    *agents: AgentProcess,
    limit_seconds: float,
    poll_seconds: float = 0.05,
) -> Any:
    """`condition()`'s first truthy value; fails at once, with its log, if an agent that was
    started has exited, and with every agent's log after `limit_seconds`."""
    deadline = time.monotonic() + limit_seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        for a in agents:
            assert a.proc is None or a.proc.poll() is None, f"{a.name} exited:\n{a.log_tail()}"
        time.sleep(poll_seconds)
    logs = "\n".join(f"--- {a.name}\n{a.log_tail()}" for a in agents)
    raise AssertionError(f"timed out waiting for {what}\n{logs}")
