"""kvprefetch_client.integrations.openai_agents in a real OpenAI Agents SDK run (a fake Model of
the SDK's interface that calls tools, the SDK running them), run in .venv-agents against a real
service: the tools' signals arrive with their names and the run's session id, and with
kvprefetch down, no session id, or a session lookup that raises, the run is exactly as without
the hooks."""

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

SCRIPT = "openai_agents_run.py"


def without_kvprefetch() -> dict[str, Any]:
    return run_script(SCRIPT)


@pytest.mark.parametrize("via", ["context", "group_id"])
def test_tool_signals_reach_kvprefetch(service: ServiceProcess, via: str) -> None:
    session = f"oa-{via}"
    out = run_script(
        SCRIPT,
        *("--kvp-url", service.url, "--session", session, "--session-via", via),
        *("--close-timeout", str(CLOSE_TIMEOUT_SECONDS)),
    )
    assert out["final_output"] == "The build fails; the notes say why."
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


@pytest.mark.parametrize("via", ["none", "broken"])
def test_no_session_id_sends_nothing_and_the_run_is_as_without_it(
    service: ServiceProcess, via: str
) -> None:
    out = run_script(
        SCRIPT,
        *("--kvp-url", service.url, "--session-via", via),
        *("--close-timeout", str(CLOSE_TIMEOUT_SECONDS)),
    )
    baseline = without_kvprefetch()
    assert (out["final_output"], out["items"]) == (baseline["final_output"], baseline["items"])
    # No tool signal was sent: with no session id each was counted as unattributed; with a
    # session_id_from that raises, as a hook error. typing() was given its session.
    skipped = 2 * len(TOOLS)
    assert (out["kvp"]["unattributed"], out["kvp"]["hook_errors"]) == (
        (skipped, 0) if via == "none" else (0, skipped)
    )
    assert out["kvp"]["sent"] == 1 and out["kvp"]["delivered"]
    assert tool_calls(service.url) == {}


@pytest.mark.parametrize("how", ["refused", "hanging"])
def test_kvprefetch_down_the_run_is_as_without_it(how: str) -> None:
    with unreachable(how) as url:
        out = run_script(SCRIPT, "--kvp-url", url)
    baseline = without_kvprefetch()
    assert (out["final_output"], out["items"]) == (baseline["final_output"], baseline["items"])
    # Every signal was queued and none delivered; nothing in the hooks failed.
    assert out["kvp"]["delivered"] is False
    assert out["kvp"]["sent"] == 0
    assert out["kvp"]["queued"] == sum(SIGNALS.values())
    assert out["kvp"]["hook_errors"] == out["kvp"]["signal_errors"] == 0
