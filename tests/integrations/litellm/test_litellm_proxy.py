"""The LiteLLM plug-in in a real LiteLLM proxy (from .venv-litellm), in front of two
OpenAI-compatible stubs, reporting to a real kvprefetch service: the events each of three
sessions' requests leave in the service, a route hint steering a session to the instance that
holds its context, and the proxy answering as before while the service is down or hung.

One proxy and one service for the module (a proxy takes seconds to start); the tests run in
file order, the last one taking the service down.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from kvprefetch_client.client import KvpClient
from tests.e2e.conftest import ServiceProcess
from tests.integrations.litellm.proxy import LiteLLMProxy
from tests.integrations.openai_stub import COMPLETION_TOKENS, OpenAIStub, prompt_tokens_of

# Generous for a busy 2-core machine (a proxy, a service, two stubs and another test worker on
# it), so a hint that the service answers is never cut short here and the steering verdict does
# not hang on the machine's speed; the default (30 ms) is what a deployment runs with.
HINT_BUDGET_MS = 5_000
WAIT_SECONDS = 60.0


@pytest.fixture(scope="module")
def stubs() -> Iterator[tuple[OpenAIStub, OpenAIStub]]:
    a, b = OpenAIStub("stub-a").start(), OpenAIStub("stub-b").start()
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    work = tmp_path_factory.mktemp("service")
    svc = ServiceProcess(work / "data", work)
    svc.start()
    yield svc
    svc.kill()
    svc.refuser.stop()
    svc.listener.close()


@pytest.fixture(scope="module")
def proxy(
    tmp_path_factory: pytest.TempPathFactory,
    stubs: tuple[OpenAIStub, OpenAIStub],
    service: ServiceProcess,
) -> Iterator[LiteLLMProxy]:
    a, b = stubs
    config = {
        "model_list": [
            # One instance named in model_info, the other known by its api_base.
            {
                "model_name": "tiny",
                "litellm_params": {"model": "openai/tiny", "api_base": a.url, "api_key": "x"},
                "model_info": {"kvprefetch_instance_id": "gpu-a"},
            },
            {
                "model_name": "tiny",
                "litellm_params": {"model": "openai/tiny", "api_base": b.url, "api_key": "x"},
            },
        ],
        "router_settings": {"num_retries": 0},
        "litellm_settings": {"callbacks": "kvprefetch_client.integrations.litellm.kvprefetch"},
    }
    env = {"KVPREFETCH_URL": service.url, "KVPREFETCH_HINT_BUDGET_MS": str(HINT_BUDGET_MS)}
    p = LiteLLMProxy(tmp_path_factory.mktemp("proxy"), config, env)
    try:
        p.start()
        yield p
    finally:
        p.stop()


def instance_of(stub: OpenAIStub) -> str:
    return "gpu-a" if stub.name == "stub-a" else stub.url


# How each of the three sessions names itself to the proxy (the plug-in's default sources).
SESSIONS: dict[str, Callable[[str], dict[str, Any]]] = {
    "sess-header": lambda sid: {"headers": {"x-session-id": sid}},
    "sess-meta": lambda sid: {"metadata": {"session_id": sid}},
    "sess-user": lambda sid: {"user": sid},
}


def wait_for(what: str, check: Callable[[], Any], proxy: LiteLLMProxy) -> Any:
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen within {WAIT_SECONDS} s\n{proxy.log()}")
        time.sleep(0.1)


def session_view(service: ServiceProcess, session_id: str) -> dict[str, Any] | None:
    r = httpx.get(f"{service.url}/v1/sessions/{session_id}", timeout=5.0)
    return r.json() if r.status_code == 200 else None


def ingested(service: ServiceProcess, event_type: str) -> float:
    text = httpx.get(f"{service.url}/metrics", timeout=5.0).text
    prefix = f'kvprefetch_events_ingested_total{{type="{event_type}"}} '
    return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


def served_by(response: httpx.Response, stubs: tuple[OpenAIStub, OpenAIStub]) -> OpenAIStub:
    assert response.status_code == 200, response.text
    name = response.json()["choices"][0]["message"]["content"]
    return next(s for s in stubs if s.name == name)


def test_each_session_is_reported_routed_and_finished_where_it_was_served(
    proxy: LiteLLMProxy, service: ServiceProcess, stubs: tuple[OpenAIStub, OpenAIStub]
) -> None:
    last: dict[str, OpenAIStub] = {}
    for turn in range(2):
        for sid, how in SESSIONS.items():
            last[sid] = served_by(proxy.chat(f"{sid} turn {turn}", **how(sid)), stubs)
    # A request the provider fails is reported finished too, with no output.
    failed = proxy.chat("FAIL", **SESSIONS["sess-user"]("sess-user"))
    assert failed.status_code >= 500, failed.text

    expected_context = prompt_tokens_of([{}]) + COMPLETION_TOKENS
    for sid in SESSIONS:
        turns = 3 if sid == "sess-user" else 2

        def done(sid: str = sid, turns: int = turns) -> dict[str, Any] | None:
            view = session_view(service, sid)
            last_request = (view or {}).get("last_request") or {}
            if view and view["turns"] == turns and last_request.get("finished_ts"):
                return view
            return None

        view = wait_for(f"{sid}'s {turns} turns, the last finished", done, proxy)
        request = view["last_request"]
        if sid == "sess-user":
            # The failed request: routed to one of the two, finished with nothing out.
            assert request["instance_id"] in {instance_of(s) for s in stubs}
            assert request["output_tokens"] == 0
        else:
            assert view["instance_id"] == instance_of(last[sid])
            assert request["instance_id"] == instance_of(last[sid])
            assert request["output_tokens"] == COMPLETION_TOKENS
            assert view["context_tokens"] == expected_context
            # The prompt as the plug-in estimated it when routing (4 characters a token).
            assert request["prompt_tokens"] == (len(f"{sid} turn 1") + 3) // 4
    assert ingested(service, "request_routed") >= 7
    assert ingested(service, "request_finished") >= 7


def test_a_confident_route_hint_steers_the_session_to_the_instance_holding_its_context(
    proxy: LiteLLMProxy, service: ServiceProcess, stubs: tuple[OpenAIStub, OpenAIStub]
) -> None:
    _, b = stubs
    sid, home = "sess-steer", instance_of(b)
    # The session's last turn ran on b and its 8 blocks are in b's HBM (as an engine reports).
    blocks = [f"steer-{i}" for i in range(8)]
    with KvpClient(service.url) as kvp:
        kvp.request_routed(
            session_id=sid,
            request_id="seed",
            instance_id=home,
            prompt_tokens=128,
            block_hashes=blocks,
            block_tokens=16,
        )
        kvp.send(
            {
                "type": "kv_blocks_stored",
                "event_id": "seed-blocks",
                "ts": time.time(),
                "tier": "hbm",
                "instance_id": home,
                "block_hashes": blocks,
                "block_tokens": 16,
            }
        )
        kvp.request_finished(session_id=sid, request_id="seed", instance_id=home, output_tokens=0)
        assert kvp.flush(10)
    hint = httpx.post(
        f"{service.url}/v1/route-hint",
        json={"session_id": sid, "candidates": ["gpu-a", home]},
        timeout=5.0,
    ).json()
    assert hint["recommended"] == home and hint["context_known"], hint

    # LiteLLM alone shuffles between the two: eight on b by chance is 1 in 256.
    picked = [served_by(proxy.chat(f"steer {i}", user=sid), stubs).name for i in range(8)]
    assert picked == ["stub-b"] * 8, f"{picked}\n{proxy.log()}"


def test_with_kvprefetch_down_or_hung_the_proxy_answers_every_request(
    proxy: LiteLLMProxy, service: ServiceProcess, stubs: tuple[OpenAIStub, OpenAIStub]
) -> None:
    def answered_all(label: str) -> None:
        for sid, how in {**SESSIONS, "sess-steer": lambda s: {"user": s}}.items():
            for turn in range(2):
                r = proxy.chat(f"{label} {sid} {turn}", **how(sid))
                assert served_by(r, stubs).name in {"stub-a", "stub-b"}

    service.kill()  # connections to its port are reset, as a crashed service's would be
    answered_all("down")
    service.refuser.stop()  # now they are accepted by the kernel and never answered: a hang
    answered_all("hung")
