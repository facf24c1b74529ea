"""vLLM production-stack router plug-in: report each request to kvprefetch before it is sent.

The router loads it with `--callbacks kvprefetch_client.integrations.vllm_router.kvprefetch`
(the instance reads the KVPREFETCH_* variables), or `--callbacks my_module.handler` for an
instance of your own. The router calls (src/vllm_router/services/callbacks_service/):

- `pre_request(request, request_body, request_json)` before it routes: the router does not say
  where the request will go, so the target is recomputed the way its `session` router picks it
  (uhashring's consistent hash of the session id over the URLs of the model's awake endpoints,
  or the endpoint named by `?id=`), and `request_routed` is queued naming it. Other routing
  logics (round robin, kvaware, prefixaware) pick by state this plug-in cannot see: their
  requests are not reported.
- `post_request(request, response_content)`, a background task after a successful response:
  `request_finished` with the usage the response reports (a non-streamed body, or a streamed
  one's last chunk with `usage`, as `stream_options.include_usage` asks for).

Routing here is a closed set, so nothing is steered; the events let kvprefetch prefetch the
session's context to the instance its next request will hash to. Nothing raises into the router
and nothing waits on kvprefetch: events go through KvpClient's bounded queue and thread.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvprefetch_client.client import KvpClient
from kvprefetch_client.integrations._failure_log import FailureLog
from kvprefetch_client.integrations._fields import (
    MAX_SESSION_ID_CHARS,
    estimate_prompt_tokens,
)

__all__ = ["Endpoint", "KvprefetchCallback", "kvprefetch", "session_target", "usage_of"]

log = logging.getLogger("kvprefetch.vllm_router")

# (url, model names, endpoint Id, asleep): the fields of the router's EndpointInfo read here.
Endpoint = tuple[str, tuple[str, ...], str | None, bool]


def session_target(session_id: str, urls: Iterable[str]) -> str:
    """The URL the `session` router sends `session_id` to among `urls`: uhashring's ring of
    them, as SessionRouter builds it (its nodes depend on the set of URLs, not their order)."""
    from uhashring import HashRing

    nodes = sorted(set(urls))
    if not nodes:
        raise ValueError("no endpoint URLs")
    return str(HashRing(nodes=nodes).get_node(session_id))


def _router_endpoints() -> list[Endpoint]:
    """The router's own service discovery, as route_general_request reads it."""
    from vllm_router.service_discovery import get_service_discovery

    return [
        (e.url, tuple(e.model_names), getattr(e, "Id", None), bool(getattr(e, "sleep", False)))
        for e in get_service_discovery().get_endpoint_info()
    ]


class KvprefetchCallback:
    """A production-stack CustomCallbackHandler (it has the two methods the router calls).

    Args:
        url: the kvprefetch service.
        token: a token with the ingest scope, when the service asks for one.
        session_key: the header or body field with the session id; default: the router's own
            `--session-key` (its `router.session_key`).
        instance_ids: endpoint URL -> kvprefetch instance id; an URL not named is its own id.
        endpoints: returns the endpoints to hash over; default: the router's service discovery.
        max_queue_events: the event queue's bound (the oldest go first when it is full).
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        session_key: str | None = None,
        instance_ids: Mapping[str, str] | None = None,
        endpoints: Callable[[], list[Endpoint]] = _router_endpoints,
        max_queue_events: int = 10_000,
        batch_size: int = 200,
        flush_interval_seconds: float = 0.05,
    ) -> None:
        self.url = url
        self.token = token
        self.session_key = session_key
        self.instance_ids = dict(instance_ids or {})
        self.endpoints = endpoints
        self._new_client = functools.partial(
            KvpClient,
            self.url,
            token=token,
            max_queue_events=max_queue_events,
            batch_size=batch_size,
            flush_interval_seconds=flush_interval_seconds,
        )
        self._events: KvpClient | None = None  # made on first use
        self.failures = FailureLog(log)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KvprefetchCallback:
        """KVPREFETCH_URL (default http://127.0.0.1:8000), KVPREFETCH_TOKEN,
        KVPREFETCH_SESSION_KEY, KVPREFETCH_INSTANCE_IDS (a JSON object: URL -> instance id)."""
        env = os.environ if environ is None else environ
        ids = env.get("KVPREFETCH_INSTANCE_IDS")
        return cls(
            env.get("KVPREFETCH_URL") or "http://127.0.0.1:8000",
            token=env.get("KVPREFETCH_TOKEN") or None,
            session_key=env.get("KVPREFETCH_SESSION_KEY") or None,
            instance_ids=json.loads(ids) if ids else None,
        )

    def pre_request(self, request: Any, request_body: bytes, request_json: Any) -> None:
        """Queue `request_routed` for the endpoint the session router will pick. Returns None
        (a Response would end the request)."""
        try:
            self._routed(request, request_json)
        except Exception as exc:
            self.failures.note("request_routed", exc)
        return None

    def post_request(self, request: Any, response_content: bytes) -> None:
        try:
            self._finished(request, response_content)
        except Exception as exc:
            self.failures.note("request_finished", exc)

    def close(self, timeout_seconds: float = 2.0) -> None:
        if self._events is not None:
            self._events.close(timeout_seconds)

    def target_of(self, request: Any, request_json: Mapping[str, Any], session_id: str) -> str:
        """The URL the router will send this request to."""
        model = request_json.get("model")
        endpoints = [e for e in self.endpoints() if model in e[1] and not e[3]]
        wanted = request.query_params.get("id") if request.query_params else None
        if wanted:
            endpoints = [e for e in endpoints if e[2] == wanted]
            if not endpoints:
                raise LookupError(f"no awake endpoint {wanted!r} serves {model!r}")
            return endpoints[0][0]
        return session_target(session_id, (e[0] for e in endpoints))

    def _session_id(self, request: Any, request_json: Mapping[str, Any]) -> str | None:
        key = self.session_key
        if key is None:
            router = getattr(getattr(request.app, "state", None), "router", None)
            key = getattr(router, "session_key", None)
        if key is None:
            return None
        # As the router's extract_session_id: the header, else the body's field.
        value = request.headers.get(key)
        if value is None:
            value = request_json.get(key)
        if isinstance(value, str) and 0 < len(value) <= MAX_SESSION_ID_CHARS:
            return value
        return None

    def _client(self) -> KvpClient:
        if self._events is None:
            self._events = self._new_client()
            atexit.register(self.close)
        return self._events

    def _routed(self, request: Any, request_json: Any) -> None:
        if not isinstance(request_json, Mapping):
            return
        session_id = self._session_id(request, request_json)
        if session_id is None:
            return  # the session router routes it by load: where to, we cannot know
        target = self.target_of(request, request_json, session_id)
        instance_id = self.instance_ids.get(target, target)
        # The router forwards X-Request-Id when the client sent one; else it makes its own.
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        request.state.kvprefetch = (session_id, request_id, instance_id)
        self._client().request_routed(
            session_id=session_id,
            request_id=request_id,
            instance_id=instance_id,
            prompt_tokens=estimate_prompt_tokens(request_json.get("messages")),
        )

    def _finished(self, request: Any, response_content: bytes) -> None:
        routed = getattr(request.state, "kvprefetch", None)
        if routed is None:
            return
        session_id, request_id, instance_id = routed
        usage = usage_of(bytes(response_content))
        prompt = usage.get("prompt_tokens")
        output = usage.get("completion_tokens")
        output = output if isinstance(output, int) and output >= 0 else 0
        self._client().request_finished(
            session_id=session_id,
            request_id=request_id,
            instance_id=instance_id,
            output_tokens=output,
            context_tokens=prompt + output if isinstance(prompt, int) and prompt >= 0 else None,
        )


def usage_of(content: bytes) -> Mapping[str, Any]:
    """The `usage` of an OpenAI response body: a JSON object, or server-sent events whose last
    chunk with a usage counts; {} when there is none."""
    text = content.strip()
    if text.startswith(b"{"):
        body = json.loads(text)
        usage = body.get("usage") if isinstance(body, dict) else None
        return usage if isinstance(usage, dict) else {}
    found: Mapping[str, Any] = {}
    for line in text.splitlines():
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data.startswith(b"{"):
                chunk = json.loads(data)
                if isinstance(chunk, dict) and isinstance(chunk.get("usage"), dict):
                    found = chunk["usage"]
    return found


# What `--callbacks kvprefetch_client.integrations.vllm_router.kvprefetch` loads: configured by
# the KVPREFETCH_* variables; it holds settings only until its first request.
kvprefetch = KvprefetchCallback.from_env()
