"""What the agent-framework tests share: the agents' venv (.venv-agents, built by
`bash .ci/ensure-agents`; a missing one fails the tests, never skips them), running a script
there, a real service (tests/e2e/conftest.py's `service_factory`), and reading back what reached
it over its HTTP API."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import ServiceProcess, service_factory
from tests.ports import dead_port, listener, port_of

__all__ = ["service_factory"]

REPO = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
AGENTS_PYTHON = Path(
    os.environ.get("KVP_TEST_AGENTS_PYTHON", REPO / ".venv-agents" / "bin" / "python")
)
# Only reached when something hangs: a run takes seconds.
RUN_TIMEOUT_SECONDS = 120.0
SIGNALS_TIMEOUT_SECONDS = 30.0
# Long enough for a busy machine to deliver everything before the script exits; a run with the
# service down waits the handler's default instead (at most a second).
CLOSE_TIMEOUT_SECONDS = 20.0
# Each run: three tools (two at once, then one that fails), then typing() after the run.
TOOLS = ("web_search", "read_file", "bash")
SIGNALS = Counter(
    [("typing", None)] + [(kind, t) for t in TOOLS for kind in ("tool_started", "tool_finished")]
)


def agents_python() -> Path:
    if not AGENTS_PYTHON.is_file():
        pytest.fail(
            f"{AGENTS_PYTHON} is missing: run `bash .ci/ensure-agents` first (make test does), "
            "or set KVP_TEST_AGENTS_PYTHON",
            pytrace=False,
        )
    return AGENTS_PYTHON


def run_script(script: str, *args: str) -> dict[str, Any]:
    """Run tests/integrations/agents/`script` in the agents' venv with this checkout's client;
    its stdout's JSON. A failing run fails the test with its stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
    env["PYTHONPATH"] = str(REPO / "client")
    env["OPENAI_API_KEY"] = "unused"  # the fake model never calls OpenAI
    proc = subprocess.run(
        [str(agents_python()), str(HERE / script), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=HERE,
        timeout=RUN_TIMEOUT_SECONDS,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"{script} {args} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return dict(json.loads(proc.stdout))


@pytest.fixture
def service(service_factory: Callable[..., ServiceProcess]) -> ServiceProcess:
    svc = service_factory()
    svc.start()
    return svc


@contextmanager
def unreachable(how: str) -> Iterator[str]:
    """A kvprefetch URL where nothing answers: `refused` (nothing listens) or `hanging` (a
    socket listens and never accepts: a connection waits in its backlog, never answered)."""
    if how == "refused":
        with dead_port() as port:
            yield f"http://127.0.0.1:{port}"
    else:
        sock = listener()
        try:
            yield f"http://127.0.0.1:{port_of(sock)}"
        finally:
            sock.close()


def session_signals(url: str, session_id: str, expected: int) -> list[dict[str, Any]]:
    """The session's signals once the service has counted `expected` of them (or fails)."""
    deadline = time.monotonic() + SIGNALS_TIMEOUT_SECONDS
    while True:
        r = httpx.get(f"{url}/v1/sessions/{session_id}", timeout=5)
        if r.status_code == 200 and r.json()["signals_total"] >= expected:
            return list(r.json()["signals"])
        assert time.monotonic() < deadline, f"signals never arrived: {r.status_code} {r.text}"
        time.sleep(0.05)


def kinds_and_tools(signals: list[dict[str, Any]]) -> Counter[tuple[str, str | None]]:
    return Counter((s["kind"], s.get("tool")) for s in signals)


def tool_calls(url: str) -> dict[str, tuple[int, int]]:
    """GET /v1/tools: each tool's (calls measured, calls in flight)."""
    tools = httpx.get(f"{url}/v1/tools", timeout=5).json()["tools"]
    return {t["tool"]: (t["calls"], t["in_flight"]) for t in tools}
