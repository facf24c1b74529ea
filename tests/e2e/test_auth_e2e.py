"""Tokens and scopes on the real service process, with tokens made by `kvprefetch token`, the
router client and the agent's pull source as their users run them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from kvprefetch_client.agent import PullSource
from kvprefetch_client.client import Answer, KvpClient

if TYPE_CHECKING:
    from tests.e2e.conftest import ServiceProcess

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def make_token(tokens_file: Path, name: str, scope: str) -> str:
    """The token for its holder; its digest appended to the file, as README "Security" says."""
    done = subprocess.run(
        [sys.executable, "-m", "kvprefetch_cli", "token", "--name", name, "--scope", scope],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    with open(tokens_file, "a") as f:
        f.write(done.stderr + "\n")
    return done.stdout.strip()


def test_scopes_hold_on_the_real_service(
    service_factory: Callable[..., ServiceProcess], tmp_path: Path
) -> None:
    tokens_file = tmp_path / "tokens.toml"
    router, agent, ops = (
        make_token(tokens_file, n, s)
        for n, s in (("router-a", "ingest"), ("agent-gpu0", "agent"), ("ops", "admin"))
    )
    assert all(t not in tokens_file.read_text() for t in (router, agent, ops))
    svc = service_factory(env={"KVP_TOKENS_FILE": str(tokens_file)})
    svc.start()

    # The router's client, with its ingest token: accepted.
    answers: list[Answer] = []
    events = [
        dict(session_id=f"s{i}", request_id=f"r{i}", instance_id="gpu-0", prompt_tokens=1000)
        for i in range(20)
    ]
    with KvpClient(svc.url, token=router, on_answer=answers.append) as kvp:
        for e in events:
            kvp.request_routed(**e)  # type: ignore[arg-type]
        assert kvp.flush(20)
        assert (kvp.stats.sent, kvp.stats.rejected) == (20, 0)
    assert sum(len(a.accepted) for a in answers) == 20

    # The agent's token may not post a router's events: refused, nothing accepted.
    with KvpClient(svc.url, token=agent) as kvp:
        kvp.request_routed(session_id="x", request_id="rx", instance_id="gpu-0", prompt_tokens=10)
        assert kvp.flush(20)
        assert (kvp.stats.sent, kvp.stats.rejected) == (0, 1)
        assert "403" in (kvp.stats.last_error or "")
    # No token at all: 401.
    assert httpx.post(f"{svc.url}/v1/events", json={"events": []}, timeout=5).status_code == 401

    # The agent's pull source works with its token, and fails with the router's.
    with_agent = PullSource(svc.url, "gpu-0", token=agent)
    with_router = PullSource(svc.url, "gpu-0", token=router)
    try:
        assert with_agent.poll(0) == [] and not with_agent._failing
        assert with_router.poll(0) == [] and with_router._failing
    finally:
        with_agent.close()
        with_router.close()

    # Reads with any token; configuration with the admin's only.
    seen = httpx.get(
        f"{svc.url}/v1/sessions/s3", headers={"authorization": f"Bearer {agent}"}, timeout=5
    )
    assert seen.status_code == 200 and seen.json()["turns"] == 1
    config = httpx.get(
        f"{svc.url}/v1/config", headers={"authorization": f"Bearer {ops}"}, timeout=5
    )
    assert config.status_code == 200
    assert config.json()["tokens"] == {
        "router-a": ["ingest", "read"],
        "agent-gpu0": ["agent", "read"],
        "ops": ["admin", "read"],
    }
    assert (
        httpx.get(
            f"{svc.url}/v1/config", headers={"authorization": f"Bearer {router}"}, timeout=5
        ).status_code
        == 403
    )
    assert httpx.get(f"{svc.url}/metrics", timeout=5).status_code == 200

    log = svc.log_text()
    assert "authentication on: 3 token(s)" in log
    assert all(t not in log for t in (router, agent, ops))


def test_without_tokens_the_service_will_not_listen_beyond_loopback(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
    env.update(
        {
            "PYTHONPATH": str(REPO),
            "KVP_HOST": "0.0.0.0",
            "KVP_PORT": "0",
            "KVP_DATA_DIR": str(tmp_path),
        }
    )
    done = subprocess.run(
        [sys.executable, "-m", "kvprefetch_cli", "serve"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert (
        "no tokens are configured, so the service may listen on 127.0.0.1 only, not 0.0.0.0"
        in done.stderr
    )
    assert not (tmp_path / "events").exists()  # it stopped before opening anything


def test_a_token_bound_to_its_fleet_acts_for_no_other_on_the_real_service(
    service_factory: Callable[..., ServiceProcess], tmp_path: Path
) -> None:
    """Two fleets' agent tokens, each bound (lines added to the entry `kvprefetch token`
    wrote): one fleet can neither clear the other's HBM nor pull its orders."""
    tokens_file = tmp_path / "tokens.toml"
    fleet_a = make_token(tokens_file, "fleet-a", "agent")
    with open(tokens_file, "a") as f:
        f.write('instances = ["gpu-a-*"]\nagents = ["gpu-a-*"]\n')
    fleet_b = make_token(tokens_file, "fleet-b", "agent")
    with open(tokens_file, "a") as f:
        f.write('instances = ["gpu-b-*"]\n')
    svc = service_factory(env={"KVP_TOKENS_FILE": str(tokens_file)})
    svc.start()

    def post(token: str, events: list[dict[str, object]]) -> httpx.Response:
        headers = {"authorization": f"Bearer {token}"}
        return httpx.post(f"{svc.url}/v1/events", json={"events": events}, headers=headers)

    stored = {
        "type": "kv_blocks_stored",
        "event_id": "b-stored",
        "ts": time.time(),
        "instance_id": "gpu-b-0",
        "block_hashes": [1, 2, 3],
    }
    assert post(fleet_b, [stored]).status_code == 200
    clear = {"type": "kv_blocks_cleared", "event_id": "a-clear", "ts": time.time()}
    answer = post(fleet_a, [{**clear, "instance_id": "gpu-b-0"}])
    assert answer.status_code == 403, answer.text
    assert answer.json()["field"] == "events[0].instance_id"
    locations = httpx.get(
        f"{svc.url}/v1/locations", headers={"authorization": f"Bearer {fleet_b}"}
    ).json()["locations"]
    assert any(loc.get("instance_id") == "gpu-b-0" for loc in locations), locations
    assert post(fleet_a, [{**clear, "instance_id": "gpu-a-0"}]).status_code == 200

    # The agent's pull source, as run: fleet a's for its own instance, not for fleet b's.
    own = PullSource(svc.url, "gpu-a-0", token=fleet_a)
    other = PullSource(svc.url, "gpu-b-0", token=fleet_a)
    try:
        assert own.poll(0) == [] and not own._failing
        assert other.poll(0) == [] and other._failing
    finally:
        own.close()
        other.close()
