"""A LangGraph agent run by tests/integrations/agents/test_langgraph.py in .venv-agents (its own
process: LangGraph is not in the service's venv). A fake chat model (LangChain's own
GenericFakeChatModel) asks for two tools at once, then for one that fails, then answers; the
tools run in LangGraph's ToolNode. Prints what the run produced as JSON, and with --kvp-url the
handler's counters after close(), so that a run with kvprefetch can be compared with one without.

    python langgraph_agent.py [--kvp-url URL] [--session S] [--mode sync|async]
                              [--session-via thread_id|metadata|none] [--close-timeout SECONDS]

--session-via: the session id as LangGraph's thread_id, or as the run's metadata `session_id`
(under another thread_id), or nowhere the handler looks. After the run, the handler's typing()
is called as a chat backend would when its UI reports typing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from kvprefetch_client.integrations.langchain import KvpCallbackHandler


@tool
def web_search(query: str) -> str:
    """Search the web."""
    return f"3 results for {query!r}"


@tool
def read_file(path: str) -> str:
    """Read a file."""
    return f"{path}: 120 lines"


@tool
def bash(command: str) -> str:
    """Run a shell command."""
    raise RuntimeError(f"{command!r} exited with status 2")


def script() -> list[AIMessage]:
    """What the fake model answers, turn by turn."""
    return [
        AIMessage(
            content="",
            tool_calls=[
                {"name": "web_search", "args": {"query": "kv cache"}, "id": "call-1"},
                {"name": "read_file", "args": {"path": "notes.md"}, "id": "call-2"},
            ],
        ),
        AIMessage(
            content="", tool_calls=[{"name": "bash", "args": {"command": "make"}, "id": "call-3"}]
        ),
        AIMessage(content="The build fails; the notes say why."),
    ]


def build_graph() -> Any:
    model = GenericFakeChatModel(messages=iter(script()))

    def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        return {"messages": [model.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([web_search, read_file, bash], handle_tool_errors=True))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=InMemorySaver())


def described(message: BaseMessage) -> dict[str, Any]:
    """A message without its generated ids, for comparing two runs."""
    return {
        "type": message.type,
        "content": message.content,
        "tool_calls": [c["name"] for c in getattr(message, "tool_calls", [])],
        "tool": getattr(message, "name", None) if message.type == "tool" else None,
        "status": getattr(message, "status", None),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kvp-url")
    parser.add_argument("--session", default="lg-session")
    parser.add_argument(
        "--session-via", choices=["thread_id", "metadata", "none"], default="thread_id"
    )
    parser.add_argument("--mode", choices=["sync", "async"], default="sync")
    parser.add_argument("--close-timeout", type=float, default=1.0)
    args = parser.parse_args()

    # A checkpointer needs a thread; "none" leaves the session id out of the metadata too.
    config: dict[str, Any] = {"configurable": {"thread_id": args.session}}
    if args.session_via == "metadata":
        config = {
            "configurable": {"thread_id": "t-other"},
            "metadata": {"session_id": args.session},
        }
    handler = None
    if args.kvp_url:
        keys = ("nothing",) if args.session_via == "none" else ("session_id", "thread_id")
        handler = KvpCallbackHandler(base_url=args.kvp_url, metadata_keys=keys)
        config["callbacks"] = [handler]

    graph = build_graph()
    inputs = {"messages": [HumanMessage(content="Why does the build fail?")]}
    if args.mode == "sync":
        state = graph.invoke(inputs, config=config)
    else:
        state = asyncio.run(graph.ainvoke(inputs, config=config))

    out: dict[str, Any] = {"messages": [described(m) for m in state["messages"]]}
    if handler is not None:
        handler.typing(args.session)
        delivered = handler.close(args.close_timeout)
        stats = handler.sender.client.stats
        out["kvp"] = {
            "delivered": delivered,
            "sent": stats.sent,
            "queued": stats.queued,
            "rejected": stats.rejected,
            "signal_errors": stats.signal_errors,
            "unattributed": handler.sender.unattributed,
            "hook_errors": handler.sender.hook_errors,
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
