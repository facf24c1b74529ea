"""The light distribution alone: a fresh venv with only kvprefetch-client's wheel (and its
dependencies) talks to a running service, and carries none of the service's weight."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fresh_venv import (
    REPO,
    build_wheels,
    clean_env,
    installed,
    make_venv,
    run,
    serving,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# What a router or a transfer agent must not get by installing the client: distributions, and
# the modules they would import as.
HEAVY_DISTS = {
    "fastapi",
    "starlette",
    "uvicorn",
    "lightgbm",
    "numpy",
    "pandas",
    "matplotlib",
    "scikit-learn",
    "scipy",
    "redis",
    "typer",
    "kvprefetch",
}
HEAVY_MODULES = (
    "app",
    "fastapi",
    "starlette",
    "uvicorn",
    "lightgbm",
    "numpy",
    "pandas",
    "matplotlib",
    "sklearn",
    "scipy",
    "redis",
    "typer",
)

# Run with the fresh venv's python: import everything the light package offers, check nothing
# heavy came along, then post a session's turn and read it back from the service.
CLIENT_SCRIPT = """
import json, sys
import httpx
import kvprefetch_client, kvprefetch_client.agent, kvprefetch_client.agent.cli
import kvprefetch_client.events, kvprefetch_client.orders
from kvprefetch_client import KvpClient

url, heavy = sys.argv[1], sys.argv[2].split(",")
loaded = sorted(m for m in heavy if m in sys.modules)
with KvpClient(url) as kvp:
    kvp.request_routed(session_id="light-1", request_id="r1", instance_id="gpu-0",
                       prompt_tokens=1200)
    kvp.request_started(session_id="light-1", request_id="r1", instance_id="gpu-0")
    kvp.request_finished(session_id="light-1", request_id="r1", instance_id="gpu-0",
                         output_tokens=300)
    flushed = kvp.flush(timeout=15)
    stats = kvp.stats
session = httpx.get(f"{url}/v1/sessions/light-1", timeout=5).json()
print(json.dumps({"loaded": loaded, "flushed": flushed, "sent": stats.sent,
                  "rejected": stats.rejected, "dropped": stats.dropped, "session": session}))
"""


def test_the_client_alone_installs_light_and_talks_to_a_running_service(tmp_path: Path) -> None:
    wheels = build_wheels(tmp_path / "build", server=False)
    assert [w.name.split("-")[0] for w in wheels] == ["kvprefetch_client"]
    bin_dir = make_venv(tmp_path / "venv", wheels)

    names = installed(bin_dir)
    assert "kvprefetch-client" in names
    assert not names & HEAVY_DISTS, f"the light install pulled in {sorted(names & HEAVY_DISTS)}"

    work = tmp_path / "work"  # outside the checkout: nothing of it is on the path
    work.mkdir()
    env = clean_env()
    no_app = run(
        [
            str(bin_dir / "python"),
            "-c",
            "import importlib.util; print(importlib.util.find_spec('app'))",
        ],
        cwd=work,
        env=env,
    )
    assert no_app.stdout.strip() == "None"

    # The agent's command is there; without the redis extra the stream source says what is missing.
    help_text = run([str(bin_dir / "kvprefetch-agent"), "--help"], cwd=work, env=env).stdout
    assert "--instance-id" in help_text and "--source" in help_text
    no_redis = subprocess.run(
        [
            str(bin_dir / "kvprefetch-agent"),
            "--instance-id",
            "gpu-0",
            "--pool-dir",
            str(work),
            "--capacity-bytes",
            "1024",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert no_redis.returncode == 2 and "kvprefetch-client[redis]" in no_redis.stderr

    # The service runs from this checkout, with the test's own interpreter.
    service_env = clean_env(
        PYTHONPATH=f"{REPO}:{REPO / 'client'}",
        KVP_STORE="memory",
        KVP_HOST="127.0.0.1",
        KVP_DATA_DIR=str(tmp_path / "data"),
    )
    with serving(
        [sys.executable, "-m", "kvprefetch_cli", "serve"], cwd=work, env=service_env
    ) as url:
        done = run(
            [str(bin_dir / "python"), "-c", CLIENT_SCRIPT, url, ",".join(HEAVY_MODULES)],
            cwd=work,
            env=env,
            timeout=60,
        )
    report = json.loads(done.stdout)
    assert report["loaded"] == []
    assert report["flushed"]
    assert (report["sent"], report["rejected"], report["dropped"]) == (3, 0, 0)
    session = report["session"]
    assert (session["session_id"], session["turns"], session["instance_id"]) == (
        "light-1",
        1,
        "gpu-0",
    )
    assert session["last_request"]["request_id"] == "r1"
