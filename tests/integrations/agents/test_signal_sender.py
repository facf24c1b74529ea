"""SignalSender, what both agent integrations post through: it never raises, counts what it
could not send, and closes only a client of its own. In the service's venv (it needs no
framework), against a port where nothing listens: these checks are about what is queued."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kvprefetch_client.client import KvpClient
from kvprefetch_client.integrations._signal_sender import MAX_TOOL_CHARS, SignalSender
from tests.ports import dead_port


@pytest.fixture
def url() -> Iterator[str]:
    with dead_port() as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def sender(url: str) -> Iterator[SignalSender]:
    made = SignalSender(None, url, None, "test")
    try:
        yield made
    finally:
        made.close(0)


def test_needs_exactly_one_of_client_and_base_url(url: str) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        SignalSender(None, None, None, "test")
    client = KvpClient(url)
    try:
        with pytest.raises(ValueError, match="exactly one"):
            SignalSender(client, url, None, "test")
    finally:
        client.close(0)


def test_posts_a_signal_with_its_tool(sender: SignalSender) -> None:
    event = sender.post(42, "tool_started", "web.search")
    assert event is not None
    assert (event.session_id, event.kind, event.tool) == ("42", "tool_started", "web.search")
    assert sender.client.stats.queued == 1


def test_no_session_id_is_counted_and_logged_once_not_sent(
    sender: SignalSender, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "kvprefetch.integrations"):
        assert sender.post(None, "tool_started", "bash") is None
        assert sender.post("", "tool_finished", "bash") is None
    assert sender.unattributed == 2
    assert sender.client.stats.queued == 0
    assert [r.getMessage() for r in caplog.records if "no session id" in r.getMessage()] == [
        "kvprefetch test: no session id for a tool_started signal, not sent (see its docs for "
        "where the session id comes from; 1 so far, logged at most once a minute)"
    ]


def test_an_invalid_signal_is_counted_never_raised(sender: SignalSender) -> None:
    assert sender.post("a/b", "tool_started", "bash") is None  # '/' is not in a session id
    assert sender.post("s1", "Not A Kind", None) is None
    stats = sender.client.stats
    assert (stats.signal_errors, stats.queued) == (2, 0)


def test_a_long_tool_name_is_cut_not_lost(sender: SignalSender) -> None:
    event = sender.post("s1", "tool_started", "t" * (MAX_TOOL_CHARS + 50))
    assert event is not None and event.tool == "t" * MAX_TOOL_CHARS


def test_hook_errors_are_counted_and_logged_once(
    sender: SignalSender, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "kvprefetch.integrations"):
        sender.hook_failed("on_tool_start", KeyError("x"))
        sender.hook_failed("on_tool_end", KeyError("y"))
    assert sender.hook_errors == 2
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1


def test_closes_its_own_client_only(url: str) -> None:
    own = SignalSender(None, url, None, "test")
    own.post("s1", "typing")
    assert own.close(0) is False  # the service is down: the signal was not delivered
    own.post("s1", "typing")
    assert own.client.stats.dropped == 1  # sent after close
    client = KvpClient(url)
    try:
        borrowed = SignalSender(client, None, None, "test")
        assert borrowed.close(0) is True
        borrowed.post("s1", "typing")
        assert client.stats.queued == 1 and client.stats.dropped == 0
    finally:
        client.close(0)
