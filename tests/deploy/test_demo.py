"""`make demo` (deploy/demo.sh): the service starts, a shared trace is replayed against it over
HTTP in accelerated time, with signals, its cluster carrying out the service's own orders
(tests/e2e/test_service_replay_e2e.py checks they land and are used), /metrics and the dashboard
fill while it runs, and Ctrl-C stops both.

A slice of the trace at a high speed keeps it to seconds; the real demo is the same script.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO, TRACES
from tests.ports import is_in_use, retry_in_use

pytestmark = pytest.mark.slow

SCRIPT = REPO / "deploy" / "demo.sh"
TRACE = TRACES / "mooncake_conversation_first60.jsonl"
REQUESTS = 300  # 102 s of the trace
SPEED = 25.0  # about 4 s


def wait_for(what: str, check, timeout: float = 90.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def totals(url: str) -> dict[str, float]:
    """Each kvprefetch counter family summed over its labels."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("kvprefetch_") and sample.name.endswith("_total"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


@pytest.fixture
def demo(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[subprocess.Popen[bytes], str, Path, Path]]:
    made: list[subprocess.Popen[bytes]] = []

    def start(port: int) -> tuple[subprocess.Popen[bytes], str, Path, Path]:
        run_dir = tmp_path / str(port)
        run_dir.mkdir()
        out, err = run_dir / "stdout", run_dir / "stderr"
        env = {
            **os.environ,
            "VENV": str(Path(sys.executable).parent.parent),
            "KVP_PORT": str(port),
            "DEMO_TRACE": str(TRACE),
            "DEMO_REQUESTS": str(REQUESTS),
            "DEMO_SPEED": str(SPEED),
            "DEMO_DATA_DIR": str(run_dir / "demo"),
            **getattr(request, "param", {}),
        }
        with out.open("wb") as o, err.open("wb") as e:
            # Its own process group, as a terminal's foreground job: Ctrl-C signals the whole
            # group. SIGINT as a terminal has it: a shell started with it ignored (pytest run as a
            # background job inherits that) can't trap it, and the script would not see the
            # Ctrl-C.
            proc = subprocess.Popen(
                ["bash", str(SCRIPT)],
                stdout=o,
                stderr=e,
                env=env,
                cwd=REPO,
                start_new_session=True,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )
        made.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_for(
            "the dashboard URL",
            lambda: f"{url}/dashboard" in out.read_text() or proc.poll() is not None,
        )
        # The script binds the port it is given: taken meanwhile, it is started on another.
        if proc.poll() is not None and is_in_use(err.read_text()):
            raise RuntimeError(f"port {port}: address in use")
        return proc, url, out, err

    try:
        yield retry_in_use(start)
    finally:
        for proc in made:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def test_the_demo_fills_the_metrics_and_ctrl_c_stops_it(
    demo: tuple[subprocess.Popen[bytes], str, Path, Path],
) -> None:
    proc, url, out, err = demo
    assert proc.poll() is None, err.read_text()

    # While the replay runs, the counters grow: events arrive, requests find (or miss) their
    # context.
    first = wait_for(
        "events ingested",
        lambda: totals(url).get("kvprefetch_events_ingested_total", 0) > 0 and totals(url),
    )
    later = wait_for(
        "the replay to go on",
        lambda: (
            (t := totals(url)).get("kvprefetch_events_ingested_total", 0)
            > first["kvprefetch_events_ingested_total"]
            and t
        ),
    )
    assert later["kvprefetch_events_ingested_total"] > first["kvprefetch_events_ingested_total"]
    assert httpx.get(f"{url}/dashboard", timeout=5).status_code == 200

    wait_for(
        "the replay to end", lambda: "replay done" in err.read_text() or proc.poll() is not None
    )
    assert proc.poll() is None, err.read_text()  # it lingers, serving the dashboard
    done = totals(url)
    assert done["kvprefetch_reuse_requests_total"] > 0  # arriving requests were judged
    assert done["kvprefetch_predictions_total"] > 0  # the bundled model scored the live sessions
    assert "requests" in out.read_text()  # the replay's table
    # The cluster ran on the service's own orders, with signals, and the script said how many.
    assert "policy service, signals coverage=0.5" in err.read_text()
    assert done["kvprefetch_signals_total"] > 0
    assert "the service's orders:" in err.read_text()

    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
    assert proc.wait(30) == 130  # the shell's status for an interrupted script
    # Both stopped: the script, and the service (nothing answers on its port any more).
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/healthz", timeout=2)
    assert "stopping the service" in err.read_text()


@pytest.mark.parametrize(
    "demo",
    # 40 tasks in a minute of trace time, at 60x: the agents' calls in a closed loop, seconds.
    [{"DEMO_AGENTS": "1", "DEMO_AGENT_TASKS": "40", "DEMO_SPEED": "60", "DEMO_REQUESTS": ""}],
    indirect=True,
)
def test_the_agent_demo_replays_agent_tasks_and_the_service_learns_their_tools(
    demo: tuple[subprocess.Popen[bytes], str, Path, Path],
) -> None:
    proc, url, _, err = demo
    wait_for(
        "the replay to end", lambda: "replay done" in err.read_text() or proc.poll() is not None
    )
    assert proc.poll() is None, err.read_text()
    assert "signals tools=1, scenario agents" in err.read_text()
    tools = httpx.get(f"{url}/v1/tools", timeout=5).json()["tools"]
    assert sum(t["calls"] for t in tools) > 0  # learned from the replay's tool signals
    assert "demo: tool " in err.read_text()
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(30) == 130


def test_each_demo_keeps_its_event_log_and_says_where(tmp_path: Path) -> None:
    """The next demo writes a directory of its own: the one before, and its log, stay."""
    root = tmp_path / "demos"

    def run(port: int) -> str:
        env = {
            **os.environ,
            "VENV": str(Path(sys.executable).parent.parent),
            "KVP_PORT": str(port),
            "DEMO_TRACE": str(TRACE),
            "DEMO_REQUESTS": "60",
            "DEMO_SPEED": "50",
            "DEMO_LINGER": "0",
            "DEMO_DATA_DIR": str(root),
        }
        done = subprocess.run(
            ["bash", str(SCRIPT)], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0 and is_in_use(done.stderr):
            raise RuntimeError(f"port {port}: address in use")
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stderr

    logs = []
    for _ in range(2):
        err = retry_in_use(run)
        said = [line for line in err.splitlines() if "the event log is at " in line]
        assert len(said) == 1, err
        logs.append(Path(said[0].split("the event log is at ")[1].split(" ")[0]))
    assert logs[0] != logs[1]
    for log in logs:
        assert log.parent.parent == root
        assert any(f.stat().st_size > 0 for f in log.iterdir())  # kept, with events in it
