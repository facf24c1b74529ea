"""The client for asyncio code: a task on the caller's loop sends."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Self

import httpx
from pydantic import BaseModel

from kvprefetch_client.client._pipeline import (
    _DEFAULT_CLOSE_TIMEOUT,
    AnswerCallback,
    ClientStats,
    _announce,
    _Batch,
    _encode,
    _EventHelpers,
    _http_options,
    _judge_exception,
    _judge_response,
    _log_signal_error,
    _log_unsent,
    _Outcome,
    _Pipeline,
)

log = logging.getLogger("kvprefetch.client")


class AsyncKvpClient(_EventHelpers):
    """The asyncio flavour: one task posts, on the loop of the first send().

    send() is a plain method, so it can be called from sync code running on the loop; it must
    be called from the loop's thread (use KvpClient from other threads).
    """

    def __init__(
        self,
        base_url: str,
        *,
        batch_size: int = 500,
        flush_interval_seconds: float = 0.05,
        max_queue_events: int = 100_000,
        timeout_seconds: float = 5.0,
        max_backoff_seconds: float = 5.0,
        headers: Mapping[str, str] | None = None,
        token: str | None = None,
        on_answer: AnswerCallback | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._pipeline = _Pipeline(
            batch_size=batch_size,
            flush_interval_seconds=flush_interval_seconds,
            max_queue_events=max_queue_events,
            max_backoff_seconds=max_backoff_seconds,
            keep_answers=on_answer is not None,
        )
        self._on_answer = on_answer
        self._url, options = _http_options(base_url, timeout_seconds, headers, token)
        self._http = httpx.AsyncClient(transport=transport, **options)
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # the sender waits on this
        self._changed = asyncio.Event()  # replaced after each set: flush() waiters see each change
        self._closed = False
        self._stopping = False
        self._warned_closed = False

    @property
    def stats(self) -> ClientStats:
        return self._pipeline.stats()

    def send(self, event: BaseModel | Mapping[str, Any]) -> None:
        """Queue an event; never awaits. When the queue is full the oldest event goes."""
        event_id, data = _encode(event)
        if self._closed:
            self._pipeline.discard()
            if not self._warned_closed:
                self._warned_closed = True
                log.warning("kvprefetch client is closed: events sent now are dropped")
            return
        self._ensure_started()  # raises outside a loop, before the event is queued
        pushed = self._pipeline.push(event_id, data, time.monotonic())
        if pushed.wake:
            self._wake.set()
        if pushed.dropped:
            self._notify_progress()
        if pushed.note:
            log.warning(pushed.note)

    def _signal_failed(self, kind: str, session_id: str, exc: Exception) -> None:
        errors = self._pipeline.signal_failed(time.monotonic())
        if errors is not None:
            _log_signal_error(kind, session_id, exc, errors)

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every event queued before the call is answered for or dropped."""
        target = self._pipeline.request_flush()
        if self._pipeline.done_through(target):
            return True
        if not self._stopping:
            self._ensure_started()
        self._wake.set()
        try:
            async with asyncio.timeout(timeout):
                while not self._pipeline.done_through(target):
                    if self._task is None or self._task.done():
                        return False
                    await self._changed.wait()
        except TimeoutError:
            return False
        return True

    async def aclose(self, timeout: float | None = _DEFAULT_CLOSE_TIMEOUT) -> bool:
        """Flush for at most `timeout` seconds, then stop the sender; True if all was delivered."""
        if self._stopping:
            return self._pipeline.pending == 0
        self._closed = True
        flushed = await self.flush(timeout)
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            if not flushed:
                self._task.cancel()  # it may be backing off or waiting on a hung service
            await asyncio.wait({self._task})  # never raises, even when the task was cancelled
        await self._http.aclose()
        _log_unsent(self._pipeline.pending)
        return flushed

    async def __aenter__(self) -> Self:
        self._ensure_started()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _ensure_started(self) -> None:
        if self._task is not None and not self._task.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                "AsyncKvpClient needs a running event loop; use KvpClient from threads"
            ) from None
        self._task = loop.create_task(self._run(), name="kvprefetch-client")
        # Called once the task is done, so woken flush() waiters see it done and stop waiting.
        self._task.add_done_callback(lambda _: self._notify_progress())

    def _notify_progress(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _next_batch(self) -> _Batch | None:
        while not self._stopping:
            wait = self._pipeline.ready(time.monotonic())
            if wait is not None and wait <= 0:
                return self._pipeline.take()
            self._wake.clear()
            try:
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            except TimeoutError:
                pass
        return None

    async def _attempt(self, batch: _Batch) -> _Outcome:
        try:
            response = await self._http.post(self._url, content=batch.body())
        except Exception as exc:
            return _judge_exception(exc)
        return _judge_response(response.status_code, response.headers, response.content, len(batch))

    async def _run(self) -> None:
        try:
            while (batch := await self._next_batch()) is not None:
                outcome = await self._attempt(batch)
                note = self._pipeline.settle(batch, outcome, time.monotonic())
                if self._on_answer is not None:
                    # Before flush() waiters are woken: once flushed, every answer was told.
                    _announce(self._on_answer, self._pipeline.take_answers())
                self._notify_progress()
                if note:
                    log.log(*note)
        except Exception:
            log.exception("kvprefetch client sender crashed; events are no longer delivered")
