"""kvprefetch_client.integrations.langchain in a real LangGraph agent (a fake chat model that
calls tools, LangGraph's ToolNode running them), run in .venv-agents against a real service:
the tools' signals arrive with their names and the run's session id, and with kvprefetch down,
or no session id, the agent runs exactly as without the handler."""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.conftest import ServiceProcess
from tests.integrations.agents.conftest import (
    CLOSE_TIMEOUT_SECONDS,
    SIGNALS,
    TOOLS,
    kinds_and_tools,
    run_script,
    session_signals,
    tool_calls,
    unreachable,
)

pytestmark = pytest.mark.slow

SCRIPT = "langgraph_agent.py"


def without_kvprefetch(mode: str) -> dict[str, Any]:
    return run_script(SCRIPT, "--mode", mode)


@pytest.mark.parametrize(
    ("mode", "via"), [("sync", "thread_id"), ("async", "metadata")], ids=["invoke", "ainvoke"]
)
def test_tool_signals_reach_kvprefetch(service: ServiceProcess, mode: str, via: str) -> None:
    session = f"lg-{mode}-{via}"
    out = run_script(
        SCRIPT,
        *("--kvp-url", service.url, "--session", session, "--session-via", via, "--mode", mode),
        *("--close-timeout", str(CLOSE_TIMEOUT_SECONDS)),
    )
    assert out["messages"][-1]["content"] == "The build fails; the notes say why."
    assert out["kvp"] == {
        "delivered": True,
        "sent": sum(SIGNALS.values()),
        "queued": 0,
        "rejected": 0,
        "signal_errors": 0,
        "unattributed": 0,
        "hook_errors": 0,
    }
    signals = session_signals(service.url, session, sum(SIGNALS.values()))
    assert kinds_and_tools(signals) == SIGNALS
    for tool in TOOLS:
        started, finished = (
            next(s["ts"] for s in signals if s["kind"] == kind and s.get("tool") == tool)
            for kind in ("tool_started", "tool_finished")
        )
        assert started <= finished, tool
    # The service paired each start with its finish, by session and tool: one call measured
    # per tool, none left running (the failing bash included).
    assert tool_calls(service.url) == dict.fromkeys(TOOLS, (1, 0))


def test_no_session_id_sends_nothing_and_the_agent_runs_as_without_it(
    service: ServiceProcess,
) -> None:
    out = run_script(
        SCRIPT,
        *("--kvp-url", service.url, "--session-via", "none"),
        *("--close-timeout", str(CLOSE_TIMEOUT_SECONDS)),
    )
    assert out["messages"] == without_kvprefetch("sync")["messages"]
    # Each tool start found no session id (typing() was given one); no finish was sent either.
    assert out["kvp"]["unattributed"] == len(TOOLS)
    assert out["kvp"]["sent"] == 1 and out["kvp"]["delivered"]
    assert out["kvp"]["hook_errors"] == 0
    assert tool_calls(service.url) == {}


@pytest.mark.parametrize("how", ["refused", "hanging"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kvprefetch_down_the_agent_runs_as_without_it(mode: str, how: str) -> None:
    with unreachable(how) as url:
        out = run_script(SCRIPT, "--kvp-url", url, "--mode", mode)
    assert out["messages"] == without_kvprefetch(mode)["messages"]
    # Every signal was queued and none delivered; nothing in the handler failed.
    assert out["kvp"]["delivered"] is False
    assert out["kvp"]["sent"] == 0
    assert out["kvp"]["queued"] == sum(SIGNALS.values())
    assert out["kvp"]["hook_errors"] == out["kvp"]["signal_errors"] == 0


def test_tools_left_open_are_bounded() -> None:
    """A tool whose end never comes is forgotten once MAX_OPEN_TOOLS newer ones are open: its
    end, if it comes after all, sends nothing (the service expires the start)."""
    with unreachable("refused") as url:
        out = run_script("langchain_open_tools.py", url)
    # Every start, and the end of the last run only.
    assert out["queued"] == out["max_open_tools"] + 2
