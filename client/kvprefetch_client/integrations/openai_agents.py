"""OpenAI Agents SDK run hooks that tell kvprefetch when a tool starts and finishes, so that the
session's KV cache can be kept, or brought back, for the model call that follows the tool's
return. Needs the `openai-agents` extra.

Usage::

    from kvprefetch_client.integrations.openai_agents import KvpRunHooks

    kvp = KvpRunHooks(base_url="http://kvprefetch:8000")
    result = await Runner.run(agent, "question", context={"session_id": "chat-42"}, hooks=kvp)
    kvp.close()   # at exit; at most a second for what is still queued

The session id comes from `session_id=` fixed for the hooks, else `session_id_from(context)`
when given, else the run's context object (the `context=` of `Runner.run`): its `session_id`
key or attribute (`context_key` names another), else the run config's `group_id` (the SDK's
id for a conversation's traces), which function tools see. docs/integrations/openai-agents.md
has the details.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from agents import RunContextWrapper, RunHooks

from kvprefetch_client.client import KvpClient
from kvprefetch_client.integrations._signal_sender import CLOSE_TIMEOUT_SECONDS, SignalSender

SessionIdFrom = Callable[[RunContextWrapper[Any]], str | None]


class KvpRunHooks(RunHooks[Any]):
    """Posts `tool_started` on `on_tool_start` and `tool_finished` on `on_tool_end`, each with
    the tool's name and the run's session id.

    Never raises into the run and never waits on the network: each hook only queues on a
    `KvpClient`, whose thread posts in batches (see `SignalSender` for what is counted where).
    The SDK calls `on_tool_end` for a tool that failed too (with the error text the model
    sees), unless the tool was made with `failure_error_function=None`: then the run fails and
    kvprefetch ends the call after KVP_TOOL_MAX_RUN_SECONDS.
    """

    def __init__(
        self,
        client: KvpClient | None = None,
        *,
        base_url: str | None = None,
        token: str | None = None,
        session_id: str | None = None,
        session_id_from: SessionIdFrom | None = None,
        context_key: str = "session_id",
    ) -> None:
        self.sender = SignalSender(client, base_url, token, "openai-agents")
        self.session_id = session_id
        self.session_id_from = session_id_from
        self.context_key = context_key

    def session_of(self, context: RunContextWrapper[Any]) -> str | None:
        """The session id of the run `context` belongs to (see the module's docstring)."""
        if self.session_id is not None:
            return self.session_id
        if self.session_id_from is not None:
            return self.session_id_from(context)
        user_context = getattr(context, "context", None)
        if isinstance(user_context, Mapping):
            found = user_context.get(self.context_key)
        else:
            found = getattr(user_context, self.context_key, None)
        if found is None or found == "":
            # A function tool's ToolContext carries the run config.
            found = getattr(getattr(context, "run_config", None), "group_id", None)
        return None if found is None or found == "" else str(found)

    async def on_tool_start(self, context: RunContextWrapper[Any], agent: Any, tool: Any) -> None:
        self._post(context, tool, "tool_started", "on_tool_start")

    async def on_tool_end(
        self, context: RunContextWrapper[Any], agent: Any, tool: Any, result: object
    ) -> None:
        self._post(context, tool, "tool_finished", "on_tool_end")

    def _post(self, context: RunContextWrapper[Any], tool: Any, kind: str, hook: str) -> None:
        try:
            name = getattr(tool, "name", None)
            self.sender.post(self.session_of(context), kind, None if name is None else str(name))
        except Exception as exc:
            self.sender.hook_failed(hook, exc)

    def typing(self, session_id: str) -> None:
        """Post `typing` for the session: for the chat backend to call when its UI reports the
        user typing, which no hook of the SDK sees (the input reaches the run only once sent).
        Never raises."""
        try:
            self.sender.post(session_id, "typing")
        except Exception as exc:
            self.sender.hook_failed("typing", exc)

    def close(self, timeout_seconds: float = CLOSE_TIMEOUT_SECONDS) -> bool:
        """Close the client made from `base_url` (a client passed in is its owner's to close),
        waiting at most `timeout_seconds` for what is queued; True when all was delivered."""
        return self.sender.close(timeout_seconds)
