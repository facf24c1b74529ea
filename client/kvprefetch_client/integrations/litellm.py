"""LiteLLM proxy plug-in: report each request to kvprefetch and steer it by the route hint.

In the proxy's config.yaml (the `kvprefetch` instance reads the KVPREFETCH_* variables)::

    litellm_settings:
      callbacks: kvprefetch_client.integrations.litellm.kvprefetch

or an instance of your own, `callbacks: my_module.handler` with
`handler = KvprefetchLogger("http://kvprefetch:8000", session_from="user")` in my_module.py
beside the config. What it does (docs/integrations/litellm.md):

- `async_filter_deployments`: asks POST /v1/route-hint which of the healthy deployments holds
  the session's context, within `hint_budget_seconds`, and keeps only the recommended one when
  the hint is confident (the context is known and the pick is strictly sooner than the rest);
- `async_pre_call_deployment_hook` (the deployment is chosen): `request_routed`;
- `async_log_success_event`: `request_finished` with the provider's token counts;
- `async_log_failure_event`: `request_finished` with no output (the request is over).

Events are queued and posted in batches by KvpClient's background thread; nothing here awaits
the service but the hint, which is bounded by its budget, paused after a failure, and answered
by the unchanged deployments whenever anything goes wrong.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
from litellm.integrations.custom_logger import CustomLogger

from kvprefetch_client.client import KvpClient
from kvprefetch_client.integrations._failure_log import FailureLog
from kvprefetch_client.integrations._fields import (
    DEFAULT_SESSION_FROM,
    estimate_prompt_tokens,
    find_session_id,
    parse_session_from,
)

__all__ = ["INSTANCE_KEY", "KvprefetchLogger", "confident_pick", "kvprefetch"]

log = logging.getLogger("kvprefetch.litellm")

# A deployment's `model_info` key naming its kvprefetch instance; without it the instance id is
# the deployment's api_base (trailing slashes stripped).
INSTANCE_KEY = "kvprefetch_instance_id"
# The service's bound on candidates per hint (app/api/routes/hints.py).
MAX_CANDIDATES = 64


class KvprefetchLogger(CustomLogger):
    """A LiteLLM CustomLogger posting routed and finished events and applying route hints.

    Args:
        url: the kvprefetch service, e.g. http://kvprefetch:8000.
        token: a token with the ingest scope, when the service asks for one.
        session_from: where the session id is, first match wins: `header:<name>`,
            `metadata:<key>` (the body's `metadata`), `user`; a list or a comma-joined string.
            A request with none is neither reported nor steered.
        instance_key: the `model_info` key that names a deployment's instance.
        steer: False reports events only and never asks for a hint.
        hint_budget_seconds: the most a request waits for its hint.
        min_gain_seconds: narrow only when the pick starts this much sooner than the next.
        hint_pause_seconds: after `hint_failures_to_pause` hints in a row fail (timeout,
            refused, an error answer), ask for none for this long, so a down or hung service
            costs a few budgets per pause, not one per request.
        max_queue_events: the event queue's bound (the oldest go first when it is full).
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        session_from: str | Sequence[str] = DEFAULT_SESSION_FROM,
        instance_key: str = INSTANCE_KEY,
        steer: bool = True,
        hint_budget_seconds: float = 0.03,
        min_gain_seconds: float = 0.0,
        hint_pause_seconds: float = 5.0,
        hint_failures_to_pause: int = 3,
        max_queue_events: int = 10_000,
        batch_size: int = 200,
        flush_interval_seconds: float = 0.05,
    ) -> None:
        super().__init__()
        if hint_budget_seconds <= 0:
            raise ValueError("hint_budget_seconds must be positive")
        self.url = url.rstrip("/")
        self.token = token
        self.session_from = parse_session_from(session_from)
        self.instance_key = instance_key
        self.steer = steer
        self.hint_budget_seconds = hint_budget_seconds
        self.min_gain_seconds = min_gain_seconds
        self.hint_pause_seconds = hint_pause_seconds
        self.hint_failures_to_pause = hint_failures_to_pause
        self._failed_in_a_row = 0
        self._new_client = functools.partial(
            KvpClient,
            self.url,
            token=token,
            max_queue_events=max_queue_events,
            batch_size=batch_size,
            flush_interval_seconds=flush_interval_seconds,
        )
        # Made on first use: importing the proxy's config starts no thread and opens nothing.
        self._events: KvpClient | None = None
        self._hint_http: httpx.AsyncClient | None = None
        self._hint_loop: asyncio.AbstractEventLoop | None = None
        self._hints_paused_until = 0.0
        self.failures = FailureLog(log)
        self.hints_asked = 0
        self.hints_failed = 0
        self.steered = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KvprefetchLogger:
        """KVPREFETCH_URL (default http://127.0.0.1:8000), KVPREFETCH_TOKEN,
        KVPREFETCH_SESSION_FROM (comma-separated sources), KVPREFETCH_STEER (0 to report only),
        KVPREFETCH_HINT_BUDGET_MS (default 30)."""
        env = os.environ if environ is None else environ
        return cls(
            env.get("KVPREFETCH_URL") or "http://127.0.0.1:8000",
            token=env.get("KVPREFETCH_TOKEN") or None,
            session_from=env.get("KVPREFETCH_SESSION_FROM") or DEFAULT_SESSION_FROM,
            steer=env.get("KVPREFETCH_STEER", "1").strip().lower() not in ("0", "false", "no"),
            hint_budget_seconds=float(env.get("KVPREFETCH_HINT_BUDGET_MS") or 30) / 1000,
        )

    # -- what the proxy calls --------------------------------------------------------------

    async def async_filter_deployments(
        self,
        model: str,
        healthy_deployments: list[dict[str, Any]],
        messages: Any,
        request_kwargs: dict[str, Any] | None = None,
        parent_otel_span: Any = None,
    ) -> list[dict[str, Any]]:
        try:
            return await self._narrow(healthy_deployments, request_kwargs or {})
        except Exception as exc:
            self.failures.note("the route hint", exc)
            return healthy_deployments

    async def async_pre_call_deployment_hook(
        self, kwargs: dict[str, Any], call_type: Any
    ) -> dict[str, Any] | None:
        try:
            self._routed(kwargs)
        except Exception as exc:
            self.failures.note("request_routed", exc)
        return None  # the request goes out unchanged

    async def async_log_success_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        try:
            self._finished(kwargs, ok=True)
        except Exception as exc:
            self.failures.note("request_finished", exc)

    async def async_log_failure_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        try:
            self._finished(kwargs, ok=False)
        except Exception as exc:
            self.failures.note("request_finished (failed request)", exc)

    def close(self, timeout_seconds: float = 2.0) -> None:
        """Flush what is queued for at most `timeout_seconds` and stop the sender."""
        if self._events is not None:
            self._events.close(timeout_seconds)

    # -- reading LiteLLM's dicts -----------------------------------------------------------

    def session_id_of(self, kwargs: Mapping[str, Any]) -> str | None:
        """The session id of a request, from the kwargs any of the hooks above is given."""
        params = kwargs.get("litellm_params")
        params = params if isinstance(params, Mapping) else {}
        metadata = kwargs.get("metadata") or params.get("metadata") or {}
        request = kwargs.get("proxy_server_request") or params.get("proxy_server_request") or {}
        headers = metadata.get("headers") or request.get("headers") or {}
        # The body's own metadata: LiteLLM merges it into `metadata` and keeps a copy apart.
        body_metadata = {**(metadata.get("requester_metadata") or {}), **metadata}
        return find_session_id(self.session_from, headers, body_metadata, kwargs.get("user"))

    def instance_id_of(self, api_base: Any, model_info: Any) -> str | None:
        """The deployment's `model_info[instance_key]`, else its api_base without trailing /."""
        if isinstance(model_info, Mapping):
            named = model_info.get(self.instance_key)
            if isinstance(named, str) and named:
                return named
        if isinstance(api_base, str) and api_base.strip("/"):
            return api_base.rstrip("/")
        return None

    def _instance_of_call(self, kwargs: Mapping[str, Any]) -> str | None:
        params = kwargs.get("litellm_params")
        params = params if isinstance(params, Mapping) else kwargs
        metadata = params.get("metadata") or {}
        model_info = params.get("model_info") or metadata.get("model_info")
        return self.instance_id_of(params.get("api_base"), model_info)

    # -- events ----------------------------------------------------------------------------

    def _client(self) -> KvpClient:
        if self._events is None:
            self._events = self._new_client()
            atexit.register(self.close)
        return self._events

    def _routed(self, kwargs: Mapping[str, Any]) -> None:
        session_id = self.session_id_of(kwargs)
        instance_id = self._instance_of_call(kwargs)
        request_id = kwargs.get("litellm_call_id")
        if session_id is None or instance_id is None or not request_id:
            return
        self._client().request_routed(
            session_id=session_id,
            request_id=str(request_id),
            instance_id=instance_id,
            prompt_tokens=estimate_prompt_tokens(kwargs.get("messages")),
        )

    def _finished(self, kwargs: Mapping[str, Any], *, ok: bool) -> None:
        session_id = self.session_id_of(kwargs)
        instance_id = self._instance_of_call(kwargs)
        request_id = kwargs.get("litellm_call_id")
        if session_id is None or instance_id is None or not request_id:
            return
        logged = kwargs.get("standard_logging_object") or {}
        prompt = _count(logged.get("prompt_tokens"))
        output = _count(logged.get("completion_tokens")) if ok else 0
        self._client().request_finished(
            session_id=session_id,
            request_id=str(request_id),
            instance_id=instance_id,
            output_tokens=output or 0,
            # What the session now holds: the prompt and the answer, when the provider said.
            context_tokens=prompt + (output or 0) if ok and prompt is not None else None,
        )

    # -- the route hint ----------------------------------------------------------------------

    async def _narrow(
        self, healthy: list[dict[str, Any]], request_kwargs: Mapping[str, Any]
    ) -> list[dict[str, Any]]:
        if not self.steer or len(healthy) < 2 or time.monotonic() < self._hints_paused_until:
            return healthy
        session_id = self.session_id_of(request_kwargs)
        if session_id is None:
            return healthy
        by_instance: dict[str, list[dict[str, Any]]] = {}
        for deployment in healthy:
            params = deployment.get("litellm_params") or {}
            instance_id = self.instance_id_of(params.get("api_base"), deployment.get("model_info"))
            if instance_id is None:
                return healthy  # a deployment we cannot name: let LiteLLM choose
            by_instance.setdefault(instance_id, []).append(deployment)
        if not 2 <= len(by_instance) <= MAX_CANDIDATES:
            return healthy
        hint = await self._ask(session_id, list(by_instance))
        pick = None if hint is None else confident_pick(hint, self.min_gain_seconds)
        if pick is None or pick not in by_instance:
            return healthy
        self.steered += 1
        return by_instance[pick]

    async def _ask(self, session_id: str, candidates: list[str]) -> Mapping[str, Any] | None:
        self.hints_asked += 1
        try:
            async with asyncio.timeout(self.hint_budget_seconds):
                response = await self._http().post(
                    "/v1/route-hint", json={"session_id": session_id, "candidates": candidates}
                )
            if response.status_code != 200:
                raise RuntimeError(f"POST /v1/route-hint answered {response.status_code}")
            answer = response.json()
            if not isinstance(answer, Mapping):
                raise RuntimeError("POST /v1/route-hint answered no object")
            self._failed_in_a_row = 0
            return answer
        except Exception as exc:
            self.hints_failed += 1
            # One slow answer (a cold connection, a busy moment) is no outage.
            self._failed_in_a_row += 1
            if self._failed_in_a_row >= self.hint_failures_to_pause:
                self._failed_in_a_row = 0
                self._hints_paused_until = time.monotonic() + self.hint_pause_seconds
            self.failures.note("the route hint", exc)
            return None

    def _http(self) -> httpx.AsyncClient:
        # An AsyncClient belongs to the loop it first ran on; a proxy worker has one loop.
        loop = asyncio.get_running_loop()
        if self._hint_http is None or self._hint_loop is not loop:
            headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
            self._hint_http = httpx.AsyncClient(
                base_url=self.url,
                headers=headers,
                timeout=self.hint_budget_seconds,
                limits=httpx.Limits(max_connections=32, max_keepalive_connections=8),
            )
            self._hint_loop = loop
        return self._hint_http


def confident_pick(hint: Mapping[str, Any], min_gain_seconds: float = 0.0) -> str | None:
    """The recommended instance when the hint is worth following: the session's context is
    known, and the pick starts more than `min_gain_seconds` sooner than every other candidate.
    A tie, or a session the service knows nothing of, leaves the choice to LiteLLM."""
    if hint.get("context_known") is not True:
        return None
    pick = hint.get("recommended")
    seconds = {
        c.get("instance_id"): c.get("expected_seconds")
        for c in hint.get("candidates") or ()
        if isinstance(c, Mapping)
    }
    best = seconds.get(pick)
    others = [s for i, s in seconds.items() if i != pick]
    if not isinstance(pick, str) or not isinstance(best, int | float) or not others:
        return None
    if not all(isinstance(s, int | float) and s - best > min_gain_seconds for s in others):
        return None
    return pick


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


# What `litellm_settings: callbacks: kvprefetch_client.integrations.litellm.kvprefetch` loads:
# configured by the KVPREFETCH_* variables; it holds settings only until its first request.
kvprefetch = KvprefetchLogger.from_env()
