"""An OpenAI Agents SDK run for tests/integrations/agents/test_openai_agents.py, in .venv-agents
(its own process: the SDK is not in the service's venv). A fake Model (the SDK's own interface,
answering from a script, no network) asks for two tools at once, then for one that fails, then
answers. Prints what the run produced as JSON, and with --kvp-url the hooks' counters after
close(), so that a run with kvprefetch can be compared with one without.

    python openai_agents_run.py [--kvp-url URL] [--session S] [--close-timeout SECONDS]
                                [--session-via context|group_id|none|broken]

--session-via: the session id in the run's context (a dict), or as the run config's group_id,
or nowhere the hooks look, or from a `session_id_from` that raises. After the run, the hooks'
typing() is called as a chat backend would when its UI reports typing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from agents import (
    Agent,
    Model,
    ModelResponse,
    ModelSettings,
    RunConfig,
    Runner,
    Usage,
    function_tool,
    set_tracing_disabled,
)
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from kvprefetch_client.integrations.openai_agents import KvpRunHooks


@function_tool
def web_search(query: str) -> str:
    """Search the web."""
    return f"3 results for {query!r}"


@function_tool
def read_file(path: str) -> str:
    """Read a file."""
    return f"{path}: 120 lines"


@function_tool
def bash(command: str) -> str:
    """Run a shell command."""
    raise RuntimeError(f"{command!r} exited with status 2")


def call(name: str, arguments: dict[str, str], n: int) -> ResponseFunctionToolCall:
    return ResponseFunctionToolCall(
        type="function_call",
        id=f"fc-{n}",
        call_id=f"call-{n}",
        name=name,
        arguments=json.dumps(arguments),
        status="completed",
    )


class ScriptedModel(Model):
    """Answers each model call with the next turn of a fixed script."""

    def __init__(self) -> None:
        self.turns: list[list[Any]] = [
            [call("web_search", {"query": "kv cache"}, 1), call("read_file", {"path": "n.md"}, 2)],
            [call("bash", {"command": "make"}, 3)],
            [
                ResponseOutputMessage(
                    type="message",
                    id="msg-1",
                    role="assistant",
                    status="completed",
                    content=[
                        ResponseOutputText(
                            type="output_text",
                            text="The build fails; the notes say why.",
                            annotations=[],
                        )
                    ],
                )
            ],
        ]

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        return ModelResponse(output=self.turns.pop(0), usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("the test runs without streaming")


def described(item: Any) -> dict[str, Any]:
    """A run item without its generated parts, for comparing two runs."""
    raw = item.raw_item
    raw = raw if isinstance(raw, dict) else raw.model_dump()
    return {
        "type": item.type,
        "name": raw.get("name"),
        "call_id": raw.get("call_id"),
        "output": getattr(item, "output", None),
    }


def broken(context: Any) -> str:
    raise KeyError("session_id")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    hooks = None
    if args.kvp_url:
        key = "nothing" if args.session_via == "none" else "session_id"
        hooks = KvpRunHooks(
            base_url=args.kvp_url,
            context_key=key,
            session_id_from=broken if args.session_via == "broken" else None,
        )
    agent = Agent(
        name="assistant",
        instructions="Find out why the build fails.",
        model=ScriptedModel(),
        model_settings=ModelSettings(),
        tools=[web_search, read_file, bash],
    )
    context = {"session_id": args.session} if args.session_via == "context" else None
    group_id = args.session if args.session_via == "group_id" else None
    result = await Runner.run(
        agent,
        "Why does the build fail?",
        context=context,
        hooks=hooks,
        run_config=RunConfig(tracing_disabled=True, group_id=group_id),
    )
    out: dict[str, Any] = {
        "final_output": result.final_output,
        "items": [described(i) for i in result.new_items],
    }
    if hooks is not None:
        hooks.typing(args.session)
        delivered = hooks.close(args.close_timeout)
        stats = hooks.sender.client.stats
        out["kvp"] = {
            "delivered": delivered,
            "sent": stats.sent,
            "queued": stats.queued,
            "rejected": stats.rejected,
            "signal_errors": stats.signal_errors,
            "unattributed": hooks.sender.unattributed,
            "hook_errors": hooks.sender.hook_errors,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kvp-url")
    parser.add_argument("--session", default="oa-session")
    parser.add_argument(
        "--session-via", choices=["context", "group_id", "none", "broken"], default="context"
    )
    parser.add_argument("--close-timeout", type=float, default=1.0)
    args = parser.parse_args()
    set_tracing_disabled(True)  # no trace is exported anywhere
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
