"""The production-stack router plug-in, loaded by the router's own `--callbacks` loader and run
around the router's own SessionRouter (both vendored unchanged: vendor/README.md says why and
from where), reporting to a real kvprefetch service while two OpenAI-compatible stubs answer.

The request path below is route_general_request's (src/vllm_router/services/request_service/
request.py) cut to what a chat completion through the session router does: pre_request, the
awake endpoints serving the model, route_request, the backend call, post_request as a
background task. What kvprefetch is told must name the endpoint the router then picked.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest
from fastapi import BackgroundTasks, FastAPI, Request, Response
from fastapi.testclient import TestClient

from kvprefetch_client.integrations.vllm_router import session_target
from tests.e2e.conftest import ServiceProcess
from tests.integrations.openai_stub import COMPLETION_TOKENS, OpenAIStub, prompt_tokens_of
from tests.ports import unanswered_port

VENDOR = Path(__file__).resolve().parent / "vendor" / "production_stack_a6c01db"
SESSION_KEY = "x-user-id"
PLUGIN = "kvprefetch_client.integrations.vllm_router"


@pytest.fixture
def production_stack(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, ModuleType]]:
    """The vendored router modules, imported fresh for the test and forgotten after it."""
    monkeypatch.syspath_prepend(str(VENDOR))
    for name in [n for n in sys.modules if n == "vllm_router" or n.startswith("vllm_router.")]:
        monkeypatch.delitem(sys.modules, name)
    import vllm_router.routers.routing_logic as routing_logic
    import vllm_router.service_discovery as service_discovery
    import vllm_router.services.callbacks_service.callbacks as callbacks

    yield {
        "routing_logic": routing_logic,
        "service_discovery": service_discovery,
        "callbacks": callbacks,
    }
    routing_logic.SessionRouter._instances.clear()  # its metaclass keeps one per class
    for name in [n for n in sys.modules if n == "vllm_router" or n.startswith("vllm_router.")]:
        sys.modules.pop(name, None)


@pytest.fixture
def stubs() -> Iterator[tuple[OpenAIStub, OpenAIStub]]:
    a, b = OpenAIStub("stub-a").start(), OpenAIStub("stub-b").start()
    yield a, b
    a.stop()
    b.stop()


def base_url(stub: OpenAIStub) -> str:
    return stub.url.removesuffix("/v1")


def router_app(
    ps: dict[str, ModuleType],
    stubs: tuple[OpenAIStub, ...],
    kvprefetch_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> FastAPI:
    discovery = ps["service_discovery"]
    discovery.initialize_service_discovery(
        [
            discovery.EndpointInfo(base_url(s), ["tiny"], f"engine-{s.name}", 0.0, "", False)
            for s in stubs
        ]
        # An endpoint asleep: never a target, so never predicted.
        + [discovery.EndpointInfo("http://127.0.0.1:9", ["tiny"], "engine-zzz", 0.0, "", True)]
    )
    app = FastAPI()
    app.state.router = ps["routing_logic"].SessionRouter(session_key=SESSION_KEY)
    # `--callbacks kvprefetch_client.integrations.vllm_router.kvprefetch`, configured by the
    # environment: the plug-in module imported afresh by the router's loader.
    monkeypatch.setenv("KVPREFETCH_URL", kvprefetch_url)
    monkeypatch.delitem(sys.modules, PLUGIN, raising=False)
    ps["callbacks"].configure_custom_callbacks(f"{PLUGIN}.kvprefetch", app)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, background_tasks: BackgroundTasks) -> Response:
        body = await request.body()
        request_json = json.loads(body)
        overwrite = request.app.state.callbacks.pre_request(request, body, request_json)
        if overwrite:
            return overwrite  # type: ignore[no-any-return]
        endpoints = [
            e
            for e in discovery.get_service_discovery().get_endpoint_info()
            if request_json["model"] in e.model_names and not e.sleep
        ]
        server_url = await request.app.state.router.route_request(
            endpoints, {}, {}, request, request_json
        )
        async with httpx.AsyncClient() as client:
            backend = await client.post(f"{server_url}/v1/chat/completions", content=body)
        background_tasks.add_task(
            request.app.state.callbacks.post_request, request, backend.content
        )
        return Response(backend.content, backend.status_code, media_type="application/json")

    return app


def chat(client: TestClient, session_id: str, content: str) -> str:
    r = client.post(
        "/v1/chat/completions",
        headers={SESSION_KEY: session_id},
        json={"model": "tiny", "messages": [{"role": "user", "content": content}]},
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def test_each_request_is_reported_at_the_endpoint_the_session_router_then_picks(
    production_stack: dict[str, ModuleType],
    stubs: tuple[OpenAIStub, OpenAIStub],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = ServiceProcess(tmp_path / "data", tmp_path)
    try:
        reported_where_served(production_stack, stubs, service, monkeypatch)
    finally:
        service.kill()
        service.refuser.stop()
        service.listener.close()


def reported_where_served(
    production_stack: dict[str, ModuleType],
    stubs: tuple[OpenAIStub, OpenAIStub],
    service: ServiceProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service.start()
    by_name = {s.name: s for s in stubs}
    app = router_app(production_stack, stubs, service.url, monkeypatch)
    served: dict[str, str] = {}
    with TestClient(app) as client:
        for turn in range(2):
            for sid in ("vr-1", "vr-2", "vr-3", "vr-4"):
                served[sid] = base_url(by_name[chat(client, sid, f"{sid} turn {turn}")])
        assert app.state.callbacks.failures.count == 0
        assert app.state.callbacks.close(10) is None
    deadline = time.monotonic() + 60  # a busy machine's batches may come late, never lost
    for sid, url in served.items():
        while True:
            r = httpx.get(f"{service.url}/v1/sessions/{sid}", timeout=5)
            view = r.json() if r.status_code == 200 else {}
            if view.get("turns") == 2 and (view.get("last_request") or {}).get("finished_ts"):
                break
            assert time.monotonic() < deadline, f"{sid}: {r.text}\n{service.log_tail()}"
            time.sleep(0.1)
        assert view["instance_id"] == url, (sid, view)
        assert view["last_request"]["output_tokens"] == COMPLETION_TOKENS
        assert view["context_tokens"] == prompt_tokens_of([{}]) + COMPLETION_TOKENS


def test_the_recomputed_ring_agrees_with_the_session_routers_own(
    production_stack: dict[str, ModuleType],
) -> None:
    """The router grows and shrinks one ring as endpoints come and go; the plug-in builds one
    from the endpoints of the moment. Same picks, for each session, at every step."""
    router = production_stack["routing_logic"].SessionRouter(session_key=SESSION_KEY)
    endpoint = production_stack["service_discovery"].EndpointInfo
    fleets = [[f"http://engine-{i}:8000" for i in range(n)] for n in (3, 5, 8)] + [
        [f"http://engine-{i}:8000" for i in (0, 2, 5, 7)]
    ]
    for fleet in fleets:
        router._update_hash_ring([endpoint(u, ["m"], u, 0.0, "", False) for u in fleet])
        for k in range(200):
            sid = f"session-{k}"
            assert session_target(sid, reversed(fleet)) == router.hash_ring.get_node(sid), sid


def test_with_kvprefetch_unreachable_the_router_answers_every_request(
    production_stack: dict[str, ModuleType],
    stubs: tuple[OpenAIStub, OpenAIStub],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = router_app(production_stack, stubs, f"http://127.0.0.1:{unanswered_port()}", monkeypatch)
    with TestClient(app) as client:
        for k in range(6):
            assert chat(client, f"down-{k}", "hello") in {"stub-a", "stub-b"}
        # Whatever the sender is doing, the events wait in its queue, never in the request.
        assert app.state.callbacks.close(0.5) is None
