"""The client for threaded code: a background thread sends."""

from __future__ import annotations

import logging
import threading
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


class KvpClient(_EventHelpers):
    """Reports events from any thread; one daemon thread posts them.

    The lock is only ever held for queue bookkeeping, never across a request or a log call, so
    send() costs an encode and an append whatever the service is doing.
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
        transport: httpx.BaseTransport | None = None,
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
        self._http = httpx.Client(transport=transport, **options)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the sender waits here
        self._progress = threading.Condition(self._lock)  # flush() waits here
        self._closed = False
        self._stopping = False
        self._warned_closed = False
        # Answers settled but still being told to on_answer: flush() waits for them too.
        self._announcing = False
        # A daemon: a client nobody closed must not keep the process alive at exit.
        self._thread = threading.Thread(target=self._run, name="kvprefetch-client", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> ClientStats:
        with self._lock:
            return self._pipeline.stats()

    def send(self, event: BaseModel | Mapping[str, Any]) -> None:
        """Queue an event. Never waits for the service; when the queue is full the oldest goes.

        After close() the event is dropped and counted rather than raising, since a router's
        request threads may still be reporting while it shuts down.
        """
        event_id, data = _encode(event)
        with self._lock:
            if self._closed:
                self._pipeline.discard()
                warn, self._warned_closed = not self._warned_closed, True
                pushed = None
            else:
                warn = False
                pushed = self._pipeline.push(event_id, data, time.monotonic())
                if pushed.wake:
                    self._work.notify()
                if pushed.dropped:
                    self._progress.notify_all()
        if warn:
            log.warning("kvprefetch client is closed: events sent now are dropped")
        if pushed is not None and pushed.note:
            log.warning(pushed.note)

    def _signal_failed(self, kind: str, session_id: str, exc: Exception) -> None:
        with self._lock:
            errors = self._pipeline.signal_failed(time.monotonic())
        if errors is not None:
            _log_signal_error(kind, session_id, exc, errors)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every event queued before the call is answered for or dropped.

        Returns False when the timeout ran out first (the events stay queued) or the client is
        closed with events left. When it returns True, on_answer has been told of all of them.
        """
        with self._lock:
            target = self._pipeline.request_flush()
            self._work.notify()

            def done() -> bool:
                return self._pipeline.done_through(target) and not self._announcing

            self._progress.wait_for(lambda: done() or not self._thread.is_alive(), timeout)
            return done()

    def close(self, timeout: float | None = _DEFAULT_CLOSE_TIMEOUT) -> bool:
        """Flush for at most `timeout` seconds, then stop the sender; True when all was delivered.

        Events still queued when the timeout runs out are abandoned (they stay in stats.queued).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._closed = True
        flushed = self.flush(timeout)
        with self._lock:
            self._stopping = True
            self._work.notify_all()
        if self._thread is not threading.current_thread():
            # An attempt in progress ends within timeout_seconds; the thread exits after it.
            self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._lock:
            pending = self._pipeline.pending
        _log_unsent(pending)
        return flushed

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _next_batch(self) -> _Batch | None:
        with self._lock:
            while not self._stopping:
                wait = self._pipeline.ready(time.monotonic())
                if wait is not None and wait <= 0:
                    return self._pipeline.take()
                self._work.wait(wait)
            return None

    def _attempt(self, batch: _Batch) -> _Outcome:
        try:
            response = self._http.post(self._url, content=batch.body())
        except Exception as exc:
            return _judge_exception(exc)
        return _judge_response(response.status_code, response.headers, response.content, len(batch))

    def _run(self) -> None:
        try:
            while (batch := self._next_batch()) is not None:
                outcome = self._attempt(batch)
                with self._lock:
                    note = self._pipeline.settle(batch, outcome, time.monotonic())
                    answers = self._pipeline.take_answers()
                    self._announcing = bool(answers)
                    if not answers:
                        self._progress.notify_all()
                if note:
                    log.log(*note)
                if answers:
                    assert self._on_answer is not None
                    _announce(self._on_answer, answers)
                    with self._lock:
                        self._announcing = False
                        self._progress.notify_all()
        except Exception:
            log.exception("kvprefetch client sender crashed; events are no longer delivered")
        finally:
            self._http.close()
            with self._lock:
                self._announcing = False
                self._progress.notify_all()  # flush() waiters see the thread is gone
