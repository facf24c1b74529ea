"""`SignalSender`: what the agent-framework integrations share, posting a session's signals
through a `KvpClient` without ever raising into, or waiting in, the agent."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvprefetch_client.client import KvpClient
from kvprefetch_client.events import SessionSignal

log = logging.getLogger("kvprefetch.integrations")

# A client the integration makes itself (base_url=): short timeouts and a smaller queue than a
# router's, as an agent posts a few signals a turn and must not hold memory for a dead service.
OWN_CLIENT_TIMEOUT_SECONDS = 2.0
OWN_CLIENT_MAX_QUEUE_EVENTS = 10_000
# What close() waits at most for the signals still queued (the agent's exit must not hang).
CLOSE_TIMEOUT_SECONDS = 1.0
# The event's bound on `tool`: a longer name is cut rather than the signal lost.
MAX_TOOL_CHARS = 128
# A hook that finds no session id, or fails, logs at most this often: it happens on every tool.
LOG_INTERVAL_SECONDS = 60.0


class SignalSender:
    """Posts signals for one integration: never raises, only queues (the client's background
    thread posts, in batches, with its bounded queue and backoff).

    `client`: a `KvpClient` the caller owns and closes; or `base_url` (and `token`): a client
    of the integration's own, closed by `close()`. A signal that cannot be queued is counted in
    the client's `stats.signal_errors`; one with no session id is not sent and counted in
    `unattributed`; an error in the integration's own code is counted in `hook_errors`. Each
    is logged at most once a minute.
    """

    def __init__(
        self,
        client: KvpClient | None,
        base_url: str | None,
        token: str | None,
        integration: str,
    ) -> None:
        if (client is None) == (base_url is None):
            raise ValueError(f"{integration}: pass client= or base_url=, exactly one")
        if client is None:
            assert base_url is not None
            client = KvpClient(
                base_url,
                timeout_seconds=OWN_CLIENT_TIMEOUT_SECONDS,
                max_queue_events=OWN_CLIENT_MAX_QUEUE_EVENTS,
                token=token,
            )
            self._owned = True
        else:
            self._owned = False
        self.client = client
        self._integration = integration
        self._lock = threading.Lock()
        self.unattributed = 0
        self.hook_errors = 0
        self._log_at = float("-inf")

    def post(self, session_id: Any, kind: str, tool: str | None = None) -> SessionSignal | None:
        """Queue `kind` for the session; None when it was not queued (and why is counted)."""
        if session_id is None or session_id == "":
            with self._lock:
                self.unattributed += 1
                count = self.unattributed
                due = self._due()
            if due:
                log.warning(
                    "kvprefetch %s: no session id for a %s signal, not sent (see its docs for "
                    "where the session id comes from; %d so far, logged at most once a minute)",
                    self._integration,
                    kind,
                    count,
                )
            return None
        session = str(session_id)
        try:
            return self.client.signal(
                session, kind, tool=None if tool is None else tool[:MAX_TOOL_CHARS]
            )
        except Exception as exc:
            # The client's own count and rate-limited log, as for tool_call().
            self.client._signal_failed(kind, session, exc)
            return None

    def hook_failed(self, hook: str, exc: Exception) -> None:
        """Count and (at most once a minute) log an error in the integration's own code."""
        with self._lock:
            self.hook_errors += 1
            count = self.hook_errors
            due = self._due()
        if due:
            log.warning(
                "kvprefetch %s: %s failed (%s: %s); the agent goes on (%d such errors so far, "
                "logged at most once a minute)",
                self._integration,
                hook,
                type(exc).__name__,
                exc,
                count,
            )

    def _due(self) -> bool:
        now = time.monotonic()
        if now < self._log_at:
            return False
        self._log_at = now + LOG_INTERVAL_SECONDS
        return True

    def close(self, timeout_seconds: float = CLOSE_TIMEOUT_SECONDS) -> bool:
        """Close a client of the integration's own, waiting at most `timeout_seconds` for what
        is queued; True when all was delivered. A client passed in is left to its owner."""
        if not self._owned:
            return True
        return self.client.close(timeout_seconds)
