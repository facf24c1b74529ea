"""`tool_call()`: an agent loop's tool run, told to kvprefetch as two signals, never failing it."""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Self

from kvprefetch_client.events import SessionSignal

if TYPE_CHECKING:
    from kvprefetch_client.client._pipeline import _EventHelpers


class ToolCall:
    """Posts `tool_started` on entry and `tool_finished` on exit, normal or not; use it as
    `with` or `async with` (both only queue, neither waits on the network).

    The body's exception propagates unchanged. A signal that cannot be queued (a bad field, an
    AsyncKvpClient used outside its loop) is counted in `stats.signal_errors` and logged at most
    once a minute, never raised: kvprefetch is a hint and must not break the agent. Delivery
    failures (service down, timeouts, 5xx) happen later, on the sender, as for any event.

    `started` and `finished` are the events queued, or None where queuing failed.
    """

    def __init__(self, client: _EventHelpers, session_id: str, tool: str) -> None:
        self._client = client
        self.session_id = session_id
        self.tool = tool
        self.started: SessionSignal | None = None
        self.finished: SessionSignal | None = None

    def _post(self, kind: str) -> SessionSignal | None:
        try:
            return self._client.signal(self.session_id, kind, tool=self.tool)
        except Exception as exc:
            self._client._signal_failed(kind, self.session_id, exc)
            return None

    def __enter__(self) -> Self:
        self.started = self._post("tool_started")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.finished = self._post("tool_finished")

    async def __aenter__(self) -> Self:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)
