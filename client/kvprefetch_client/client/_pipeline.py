"""What both clients share: the queue, batching, backoff, and what each answer means."""

from __future__ import annotations

import email.utils
import logging
import random
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, NamedTuple, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from kvprefetch_client._version import __version__
from kvprefetch_client.client._tool_call import ToolCall
from kvprefetch_client.events import (
    BlockHash,
    RequestFinished,
    RequestRouted,
    RequestStarted,
    SessionClosed,
    SessionSignal,
)

log = logging.getLogger("kvprefetch.client")

# The first retry waits about this long; each further failure doubles it, up to the cap.
_FIRST_BACKOFF_SECONDS = 0.1
# Answers that say "not now" rather than "never": the same batch is sent again.
_RETRY_STATUSES = frozenset({408, 429})
# How many rejected events one log line names; the rest are only counted.
_LOGGED_REJECTIONS = 5
_DEFAULT_CLOSE_TIMEOUT = 10.0
# A tool_call() signal that cannot be queued is logged at most this often: an agent loop with a
# bad tool name would otherwise log on every call.
_SIGNAL_ERROR_LOG_INTERVAL_SECONDS = 60.0

_M = TypeVar("_M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class ClientStats:
    """A snapshot of a client's counters; every event sent ends up in exactly one of the first five.

    queued: not yet acknowledged (waiting, or in the batch being sent).
    sent: acknowledged as accepted. duplicates: acknowledged as already known (a resend).
    rejected: refused by the service as invalid; sending them again would fail again.
    dropped: given up unsent, the oldest first when the queue was full, or sent after close.
    retries: failed attempts that were retried. last_error: why the latest attempt failed.
    signal_errors: signals tool_call() could not queue (a bad field, no running loop), so never
    sent and in none of the five; logged at most once a minute instead of raised.
    """

    queued: int
    sent: int
    duplicates: int
    rejected: int
    dropped: int
    retries: int
    last_error: str | None
    signal_errors: int = 0


@dataclass(frozen=True, slots=True)
class Answer:
    """The service's last word on one batch: each of its events is in exactly one of the three.

    accepted: applied now. duplicates: the service had them already (a resend, or the retry of a
    batch whose answer was lost). rejected: refused for good (invalid, or the batch refused).
    An event is acknowledged, durably held by the service, when accepted or a duplicate.
    """

    accepted: tuple[str, ...]
    duplicates: tuple[str, ...]
    rejected: tuple[str, ...]


# Told of each answer, in the order the batches were sent: on the sender thread (KvpClient) or
# the loop (AsyncKvpClient). Events dropped or left queued at close() get none.
AnswerCallback = Callable[[Answer], None]


@dataclass(slots=True)
class _Item:
    seq: int
    event_id: str
    data: bytes  # the event's JSON, encoded once when sent so every retry posts the same bytes
    queued_at: float


class _Batch:
    __slots__ = ("_body", "items")

    def __init__(self, items: list[_Item]) -> None:
        self.items = items
        self._body: bytes | None = None

    def __len__(self) -> int:
        return len(self.items)

    @property
    def event_ids(self) -> list[str]:
        return [item.event_id for item in self.items]

    def body(self) -> bytes:
        if self._body is None:
            self._body = b'{"events":[' + b",".join(item.data for item in self.items) + b"]}"
        return self._body


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What an attempt's result means for its batch.

    done: the service answered for every event (some may be duplicates or rejected).
    retry: nothing is known to be applied; send the same batch again later.
    split: the batch is too large; send each half. reject: the whole batch is refused for good.
    duplicate_ids: as the service listed them. rejections: the rejected events, each by its index
    in the batch (or its event_id where the service gave no index). accepted_ids: set when the
    service left rejections out of its answer (it lists a bounded number): then an event is
    accepted or a duplicate only as listed, and rejected otherwise.
    """

    action: Literal["done", "retry", "split", "reject"]
    duplicate_ids: tuple[str, ...] = ()
    rejections: tuple[int | str, ...] = ()
    accepted_ids: tuple[str, ...] | None = None
    retry_after: float | None = None
    error: str | None = None


class _Pushed(NamedTuple):
    wake: bool  # the sender may be idle or lingering and should look again
    dropped: bool  # the oldest event was dropped, which may complete a flush
    note: str | None  # a warning to log, outside any lock


def _encode(event: BaseModel | Mapping[str, Any]) -> tuple[str, bytes]:
    """Encode in the caller's thread: a dict changed after send() cannot change what is sent."""
    if isinstance(event, BaseModel):
        event_id = getattr(event, "event_id", None)
        data = event.model_dump_json(exclude_none=True).encode()
    elif isinstance(event, Mapping):
        event_id = event.get("event_id")
        data = orjson.dumps(event if isinstance(event, dict) else dict(event))
    else:
        raise TypeError(f"send() takes an event model or a dict, not {type(event).__name__}")
    if not isinstance(event_id, str) or not event_id:
        raise ValueError("an event needs a non-empty string event_id: retries are recognised by it")
    return event_id, data


def _json(content: bytes) -> Any:
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return None


def _describe_error(status: int, doc: Any, content: bytes) -> str:
    if isinstance(doc, dict) and "detail" in doc:
        field = f" (field {doc['field']})" if doc.get("field") else ""
        return f"HTTP {status}: {doc['detail']}{field}"
    text = content[:200].decode("utf-8", "replace").strip()
    return f"HTTP {status}: {text}" if text else f"HTTP {status}"


def _describe_rejections(rejections: list[dict[str, Any]], events: int) -> str:
    named = "; ".join(
        f"{r.get('field', '?')}: {r.get('message', '?')} (event_id {r.get('event_id')!r})"
        for r in rejections[:_LOGGED_REJECTIONS]
    )
    more = len(rejections) - _LOGGED_REJECTIONS
    tail = f"; and {more} more errors" if more > 0 else ""
    return f"the service rejected {events} invalid events, dropped: {named}{tail}"


def _retry_after_seconds(value: str | None) -> float | None:
    """Retry-After is either seconds or an HTTP date; anything else is ignored."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    return seconds if seconds > 0 else 0.0  # also maps NaN to 0


def _backoff_seconds(
    failures: int, *, cap: float, retry_after: float | None, rng: random.Random
) -> float:
    """Exponential backoff with jitter, so a fleet of routers does not retry in lockstep.

    The cap bounds every wait, Retry-After included: a misconfigured proxy asking for an hour
    must not silence reporting for an hour (the queue would overflow long before).
    """
    base = min(cap, _FIRST_BACKOFF_SECONDS * 2 ** min(failures - 1, 32))
    delay = base / 2 + rng.random() * base / 2
    if retry_after is not None:
        delay = max(delay, min(retry_after, cap))
    return delay


def _duplicate_ids(doc: Any) -> tuple[str, ...]:
    duplicates = doc.get("duplicates") if isinstance(doc, dict) else None
    if not isinstance(duplicates, list):
        return ()
    return tuple(d for d in duplicates if isinstance(d, str))


def _judge_response(
    status: int, headers: Mapping[str, str], content: bytes, batch_len: int
) -> _Outcome:
    """Map an answer of POST /v1/events (app/api/routes/events.py) to what becomes of the batch."""
    if 200 <= status < 300:
        return _Outcome("done", duplicate_ids=_duplicate_ids(_json(content)))
    doc = _json(content)
    if status == 422 and isinstance(doc, dict) and isinstance(doc.get("rejected"), list):
        # Per-event errors: the valid events were accepted, the others would fail again.
        rejections = [r for r in doc["rejected"] if isinstance(r, dict)]
        # One event can fail on several fields; count events, not errors.
        keys = dict.fromkeys(
            k for r in rejections if isinstance(k := r.get("index", r.get("event_id")), (int, str))
        )
        omitted = doc.get("rejections_omitted")
        accepted = doc.get("accepted")
        accepted_ids = (
            tuple(a for a in accepted if isinstance(a, str))
            if isinstance(omitted, int) and omitted > 0 and isinstance(accepted, list)
            else None
        )
        events = doc.get("rejected_events")
        return _Outcome(
            "done",
            duplicate_ids=_duplicate_ids(doc),
            rejections=tuple(keys),
            accepted_ids=accepted_ids,
            error=_describe_rejections(
                rejections, events if isinstance(events, int) else len(keys)
            ),
        )
    error = _describe_error(status, doc, content)
    if status in _RETRY_STATUSES or status >= 500:
        return _Outcome(
            "retry", retry_after=_retry_after_seconds(headers.get("retry-after")), error=error
        )
    if status == 413 and batch_len > 1:
        return _Outcome("split", error=error)
    return _Outcome("reject", error=error)


def _partition(batch: _Batch, outcome: _Outcome) -> Answer:
    """Which of the batch's events the service accepted, had already, or rejected."""
    if outcome.accepted_ids is not None:
        return _partition_as_listed(batch, outcome)
    if not outcome.duplicate_ids and not outcome.rejections:
        return Answer(tuple(batch.event_ids), (), ())
    items = batch.items
    refused = [False] * len(items)
    for key in outcome.rejections:
        if isinstance(key, int):
            if 0 <= key < len(items):
                refused[key] = True
        else:
            at = next(
                (i for i, it in enumerate(items) if it.event_id == key and not refused[i]), None
            )
            if at is not None:
                refused[at] = True
    # The service keeps the first of a repeated id and lists the later ones as duplicates, so
    # they are counted from the end.
    owed = Counter(outcome.duplicate_ids)
    accepted: list[str] = []
    duplicates: list[str] = []
    rejected: list[str] = []
    for i in range(len(items) - 1, -1, -1):
        event_id = items[i].event_id
        if refused[i]:
            rejected.append(event_id)
        elif owed[event_id] > 0:
            owed[event_id] -= 1
            duplicates.append(event_id)
        else:
            accepted.append(event_id)
    return Answer(tuple(reversed(accepted)), tuple(reversed(duplicates)), tuple(reversed(rejected)))


def _partition_as_listed(batch: _Batch, outcome: _Outcome) -> Answer:
    """An answer whose rejections were not all listed: what is not listed accepted or a
    duplicate was rejected."""
    listed_rejected = {k for k in outcome.rejections if isinstance(k, int)}
    owed_accepted = Counter(outcome.accepted_ids or ())
    owed_duplicates = Counter(outcome.duplicate_ids)
    accepted: list[str] = []
    duplicates: list[str] = []
    rejected: list[str] = []
    for i, item in enumerate(batch.items):
        event_id = item.event_id
        if i in listed_rejected:
            rejected.append(event_id)
        elif owed_accepted[event_id] > 0:  # the service accepts the first of a repeated id
            owed_accepted[event_id] -= 1
            accepted.append(event_id)
        elif owed_duplicates[event_id] > 0:
            owed_duplicates[event_id] -= 1
            duplicates.append(event_id)
        else:
            rejected.append(event_id)
    return Answer(tuple(accepted), tuple(duplicates), tuple(rejected))


def _judge_exception(exc: BaseException) -> _Outcome:
    # Whether the service applied the batch is unknown; a resend is safe since ids dedupe it.
    name = type(exc).__name__
    return _Outcome("retry", error=f"{name}: {exc}" if str(exc) else name)


class _Pipeline:
    """The queue and every decision about it, shared by both clients. No I/O, never waits.

    Not thread-safe: the thread client calls it under its lock, the asyncio client from its loop.
    Events leave the queue in order, one batch at a time; a batch stays "in flight" (kept for
    resending, not counted against max_queue_events) until the service has answered for it.
    """

    def __init__(
        self,
        *,
        batch_size: int,
        flush_interval_seconds: float,
        max_queue_events: int,
        max_backoff_seconds: float,
        rng: random.Random | None = None,
        keep_answers: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if max_queue_events < 1:
            raise ValueError("max_queue_events must be at least 1")
        if flush_interval_seconds < 0 or max_backoff_seconds < 0:
            raise ValueError("flush_interval_seconds and max_backoff_seconds cannot be negative")
        self._batch_size = batch_size
        self._flush_interval = flush_interval_seconds
        self._max_queue = max_queue_events
        self._max_backoff = max_backoff_seconds
        self._rng = rng or random.Random()
        self._queue: deque[_Item] = deque()
        self._inflight: list[_Batch] = []  # the batch being sent; two halves after a 413
        self._next_seq = 0
        self._flush_target = -1  # events up to this seq are sent without lingering
        self._retry_at = 0.0
        self._failures = 0  # consecutive failed attempts
        self._dropping = False  # warned about this overflow; again once the queue has drained
        self._sent = self._duplicates = self._rejected = self._dropped = self._retries = 0
        self._last_error: str | None = None
        self._signal_errors = 0
        self._signal_log_at = float("-inf")  # the next signal error is logged from then on
        self._keep_answers = keep_answers
        self._answers: list[Answer] = []  # settled, not yet handed to the client's callback

    @property
    def pending(self) -> int:
        return len(self._queue) + sum(len(b) for b in self._inflight)

    def push(self, event_id: str, data: bytes, now: float) -> _Pushed:
        note = None
        dropped = len(self._queue) >= self._max_queue
        if dropped:
            self._queue.popleft()
            self._dropped += 1
            if not self._dropping:
                self._dropping = True
                why = f" (last error: {self._last_error})" if self._failures else ""
                note = (
                    f"kvprefetch client queue is full ({self._max_queue} events): dropping "
                    f"the oldest events until the service catches up{why}"
                )
        self._queue.append(_Item(self._next_seq, event_id, data, now))
        self._next_seq += 1
        n = len(self._queue)
        return _Pushed(wake=n == 1 or n == self._batch_size, dropped=dropped, note=note)

    def discard(self) -> None:
        self._dropped += 1

    def request_flush(self) -> int:
        """Stop lingering over what is queued now; returns the seq to wait for."""
        self._flush_target = max(self._flush_target, self._next_seq - 1)
        return self._flush_target

    def done_through(self, target: int) -> bool:
        """Whether every event up to `target` has been answered for or dropped."""
        if self._inflight:
            return self._inflight[0].items[0].seq > target
        return not self._queue or self._queue[0].seq > target

    def ready(self, now: float) -> float | None:
        """Seconds until the next attempt is due (0: now), None when there is nothing to send.

        A partial batch lingers for flush_interval so that a busy router sends few large posts
        instead of many small ones; a flush or a full batch ends the linger.
        """
        if self._inflight:
            return max(0.0, self._retry_at - now)
        if not self._queue:
            return None
        head = self._queue[0]
        if len(self._queue) >= self._batch_size or head.seq <= self._flush_target:
            return 0.0
        return max(0.0, head.queued_at + self._flush_interval - now)

    def take(self) -> _Batch:
        if self._dropping and len(self._queue) <= self._max_queue // 2:
            self._dropping = False
        if not self._inflight:
            n = min(self._batch_size, len(self._queue))
            self._inflight.append(_Batch([self._queue.popleft() for _ in range(n)]))
        return self._inflight[0]

    def settle(self, batch: _Batch, outcome: _Outcome, now: float) -> tuple[int, str] | None:
        """Apply an attempt's outcome; returns (level, message) to log, outside any lock."""
        assert self._inflight and self._inflight[0] is batch, "settle() the batch take() gave"
        if outcome.action == "retry":
            self._failures += 1
            self._retries += 1
            self._last_error = outcome.error
            delay = _backoff_seconds(
                self._failures,
                cap=self._max_backoff,
                retry_after=outcome.retry_after,
                rng=self._rng,
            )
            self._retry_at = now + delay
            # One warning per outage, not one per attempt.
            level = logging.WARNING if self._failures == 1 else logging.DEBUG
            return level, (
                f"cannot deliver {len(batch)} events to kvprefetch ({outcome.error}); "
                f"retry {self._failures} in {delay:.2f}s with the same event ids"
            )
        failures, self._failures = self._failures, 0
        if outcome.action == "split":
            half = len(batch) // 2
            self._inflight[0:1] = [_Batch(batch.items[:half]), _Batch(batch.items[half:])]
            self._retry_at = now
            return logging.INFO, (
                f"kvprefetch refused a batch of {len(batch)} events as too "
                f"large ({outcome.error}); sending it in halves"
            )
        self._inflight.pop(0)
        note: tuple[int, str] | None = None
        if outcome.action == "reject":
            answer = Answer((), (), tuple(batch.event_ids))
            self._last_error = outcome.error
            note = (
                logging.ERROR,
                (
                    f"kvprefetch refused a batch of {len(batch)} events; they are "
                    f"dropped, since sending them again would fail again: "
                    f"{outcome.error}"
                ),
            )
        else:
            answer = _partition(batch, outcome)
            if answer.rejected:
                self._last_error = outcome.error
                note = logging.WARNING, str(outcome.error)
        self._sent += len(answer.accepted)
        self._duplicates += len(answer.duplicates)
        self._rejected += len(answer.rejected)
        if self._keep_answers:
            self._answers.append(answer)
        if note is None and failures:
            note = logging.INFO, f"kvprefetch answered again after {failures} failed attempts"
        return note

    def signal_failed(self, now: float) -> int | None:
        """Count a signal tool_call() could not queue; the count so far when it is time to log
        again, else None."""
        self._signal_errors += 1
        if now < self._signal_log_at:
            return None
        self._signal_log_at = now + _SIGNAL_ERROR_LOG_INTERVAL_SECONDS
        return self._signal_errors

    def take_answers(self) -> list[Answer]:
        answers, self._answers = self._answers, []
        return answers

    def stats(self) -> ClientStats:
        return ClientStats(
            queued=self.pending,
            sent=self._sent,
            duplicates=self._duplicates,
            rejected=self._rejected,
            dropped=self._dropped,
            retries=self._retries,
            last_error=self._last_error,
            signal_errors=self._signal_errors,
        )


class _EventHelpers:
    """Thin builders for the events a router reports; anything else goes through send()."""

    def send(self, event: BaseModel | Mapping[str, Any]) -> None:
        raise NotImplementedError

    def _signal_failed(self, kind: str, session_id: str, exc: Exception) -> None:
        raise NotImplementedError

    def _emit(self, model: type[_M], ts: float | None, event_id: str | None, **fields: Any) -> _M:
        event = model(
            event_id=event_id or uuid.uuid4().hex, ts=time.time() if ts is None else ts, **fields
        )
        self.send(event)
        return event

    def request_routed(
        self,
        *,
        session_id: str,
        request_id: str,
        instance_id: str,
        prompt_tokens: int,
        block_hashes: Sequence[BlockHash] | None = None,
        block_tokens: int | None = None,
        ts: float | None = None,
        event_id: str | None = None,
    ) -> RequestRouted:
        return self._emit(
            RequestRouted,
            ts,
            event_id,
            session_id=session_id,
            request_id=request_id,
            instance_id=instance_id,
            prompt_tokens=prompt_tokens,
            block_hashes=block_hashes,
            block_tokens=block_tokens,
        )

    def request_started(
        self,
        *,
        session_id: str,
        request_id: str,
        instance_id: str,
        ts: float | None = None,
        event_id: str | None = None,
    ) -> RequestStarted:
        return self._emit(
            RequestStarted,
            ts,
            event_id,
            session_id=session_id,
            request_id=request_id,
            instance_id=instance_id,
        )

    def request_finished(
        self,
        *,
        session_id: str,
        request_id: str,
        instance_id: str,
        output_tokens: int,
        context_tokens: int | None = None,
        block_hashes: Sequence[BlockHash] | None = None,
        block_tokens: int | None = None,
        ts: float | None = None,
        event_id: str | None = None,
    ) -> RequestFinished:
        return self._emit(
            RequestFinished,
            ts,
            event_id,
            session_id=session_id,
            request_id=request_id,
            instance_id=instance_id,
            output_tokens=output_tokens,
            context_tokens=context_tokens,
            block_hashes=block_hashes,
            block_tokens=block_tokens,
        )

    def session_closed(
        self, *, session_id: str, ts: float | None = None, event_id: str | None = None
    ) -> SessionClosed:
        return self._emit(SessionClosed, ts, event_id, session_id=session_id)

    def signal(
        self,
        session_id: str,
        kind: str,
        *,
        tool: str | None = None,
        instance_id: str | None = None,
        expected_in_seconds: float | None = None,
        expected_prompt_tokens: int | None = None,
        ts: float | None = None,
        event_id: str | None = None,
    ) -> SessionSignal:
        """Say a request of the session is probably coming: `kind` is one of SIGNAL_KINDS
        (`opened`, `typing`, `tool_started`, `tool_finished`, `queued`) or a short name of your
        own. Raises pydantic's ValidationError on a bad field, before anything is queued."""
        return self._emit(
            SessionSignal,
            ts,
            event_id,
            session_id=session_id,
            kind=kind,
            tool=tool,
            instance_id=instance_id,
            expected_in_seconds=expected_in_seconds,
            expected_prompt_tokens=expected_prompt_tokens,
        )

    def tool_call(self, session_id: str, *, tool: str) -> ToolCall:
        """An agent loop's tool run: `with kvp.tool_call(run_id, tool="bash"): ...` (or
        `async with`) queues `tool_started` on entry and `tool_finished` on exit, both naming
        `tool`, the latter also when the body raises (the exception propagates unchanged).
        Never raises because of kvprefetch: a signal it cannot queue is counted in
        `stats.signal_errors` and logged at most once a minute; delivery is the sender's, as
        for every event (retried with the same event ids, never waited on)."""
        return ToolCall(self, session_id, tool)


def _http_options(
    base_url: str,
    timeout_seconds: float,
    headers: Mapping[str, str] | None,
    token: str | None = None,
) -> tuple[str, dict[str, Any]]:
    if timeout_seconds <= 0:
        raise ValueError("timeout_seconds must be positive")
    all_headers = {"user-agent": f"kvprefetch-client/{__version__}"}
    all_headers.update(headers or {})
    # The ingest scope, or agent for an agent's reports (docs/operators/security.md).
    if token is not None:
        all_headers["authorization"] = f"Bearer {token}"
    all_headers["content-type"] = "application/json"
    return base_url.rstrip("/") + "/v1/events", {"timeout": timeout_seconds, "headers": all_headers}


def _announce(callback: AnswerCallback, answers: list[Answer]) -> None:
    for answer in answers:
        try:
            callback(answer)
        except Exception:
            log.exception("the kvprefetch client's on_answer callback failed")


def _log_signal_error(kind: str, session_id: str, exc: Exception, errors: int) -> None:
    if isinstance(exc, ValidationError):  # name the fields, not pydantic's multi-line text
        why = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
    else:
        why = str(exc)
    log.warning(
        "kvprefetch tool_call() could not queue %s for session %r (%s: %s); the agent goes on "
        "(%d such signals so far, stats.signal_errors; logged at most once every %.0f s)",
        kind,
        session_id,
        type(exc).__name__,
        why,
        errors,
        _SIGNAL_ERROR_LOG_INTERVAL_SECONDS,
    )


def _log_unsent(pending: int) -> None:
    if pending:
        log.warning("kvprefetch client closed with %d events undelivered", pending)
