"""A LangChain callback handler (LangGraph agents run it too) that tells kvprefetch when a tool
starts and finishes, so that the session's KV cache can be kept, or brought back, for the
request that follows the tool's return. Needs the `langchain` extra.

Usage::

    from kvprefetch_client.integrations.langchain import KvpCallbackHandler

    kvp = KvpCallbackHandler(base_url="http://kvprefetch:8000")
    graph.invoke(inputs, config={"callbacks": [kvp], "configurable": {"thread_id": "chat-42"}})
    kvp.close()   # at exit; at most a second for what is still queued

The session id is read from the run's metadata, which LangChain passes down to every tool:
the first of `metadata_keys` there (by default `session_id`, then LangGraph's `thread_id`,
which LangGraph copies from `configurable` into the metadata), or `session_id=` fixed for
the handler. docs/integrations/langchain.md has the details.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler

from kvprefetch_client.client import KvpClient
from kvprefetch_client.integrations._signal_sender import CLOSE_TIMEOUT_SECONDS, SignalSender

DEFAULT_METADATA_KEYS = ("session_id", "thread_id")
# Tools started and not yet finished that the handler remembers (on_tool_end names neither the
# tool nor the session, only the run id); past this the oldest are forgotten, unsent.
MAX_OPEN_TOOLS = 10_000


class KvpCallbackHandler(BaseCallbackHandler):
    """Posts `tool_started` on `on_tool_start` and `tool_finished` on `on_tool_end` or
    `on_tool_error`, each with the tool's name and the run's session id.

    Never raises into the agent and never waits on the network: each hook only queues on a
    `KvpClient`, whose thread posts in batches (see `SignalSender` for what is counted where).
    LangChain skips this handler for model, chain, retriever and custom events.
    """

    # The hooks only queue: run them in the caller's thread, not handed to an executor per
    # event as LangChain does for a sync handler in an async run.
    run_inline = True
    raise_error = False

    def __init__(
        self,
        client: KvpClient | None = None,
        *,
        base_url: str | None = None,
        token: str | None = None,
        session_id: str | None = None,
        metadata_keys: Sequence[str] = DEFAULT_METADATA_KEYS,
    ) -> None:
        super().__init__()
        self.sender = SignalSender(client, base_url, token, "langchain")
        self.session_id = session_id
        self.metadata_keys = tuple(metadata_keys)
        # run id -> (session id, tool): tools run on several threads at once in LangGraph.
        self._open: OrderedDict[UUID, tuple[str, str | None]] = OrderedDict()
        self._lock = threading.Lock()

    # Not ignore_agent: LangChain gates the tool events by it too.
    @property
    def ignore_llm(self) -> bool:
        return True

    @property
    def ignore_chat_model(self) -> bool:
        return True

    @property
    def ignore_chain(self) -> bool:
        return True

    @property
    def ignore_retriever(self) -> bool:
        return True

    @property
    def ignore_retry(self) -> bool:
        return True

    @property
    def ignore_custom_event(self) -> bool:
        return True

    def session_of(self, metadata: Mapping[str, Any] | None) -> str | None:
        """The session id for a run with this metadata: `session_id=` when set, else the first
        of `metadata_keys` present and non-empty."""
        if self.session_id is not None:
            return self.session_id
        for key in self.metadata_keys:
            value = (metadata or {}).get(key)
            if value is not None and value != "":
                return str(value)
        return None

    def on_tool_start(
        self,
        serialized: dict[str, Any],
        input_str: str,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        tags: list[str] | None = None,
        metadata: dict[str, Any] | None = None,
        inputs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        try:
            name = (serialized or {}).get("name") or kwargs.get("name")
            tool = None if name is None else str(name)
            session = self.session_of(metadata)
            if self.sender.post(session, "tool_started", tool) is None or session is None:
                return
            with self._lock:
                self._open[run_id] = (session, tool)
                while len(self._open) > MAX_OPEN_TOOLS:
                    self._open.popitem(last=False)
        except Exception as exc:
            self.sender.hook_failed("on_tool_start", exc)

    def on_tool_end(
        self, output: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        self._finished(run_id, "on_tool_end")

    def on_tool_error(
        self,
        error: BaseException,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        self._finished(run_id, "on_tool_error")

    def _finished(self, run_id: UUID, hook: str) -> None:
        try:
            with self._lock:
                started = self._open.pop(run_id, None)
            if started is not None:
                self.sender.post(started[0], "tool_finished", started[1])
        except Exception as exc:
            self.sender.hook_failed(hook, exc)

    def typing(self, session_id: str) -> None:
        """Post `typing` for the session: for the chat backend to call when its UI reports the
        user typing, which no LangChain callback sees (the input reaches the agent only once
        sent). Never raises."""
        try:
            self.sender.post(session_id, "typing")
        except Exception as exc:
            self.sender.hook_failed("typing", exc)

    def close(self, timeout_seconds: float = CLOSE_TIMEOUT_SECONDS) -> bool:
        """Close the client made from `base_url` (a client passed in is its owner's to close),
        waiting at most `timeout_seconds` for what is queued; True when all was delivered."""
        return self.sender.close(timeout_seconds)
