"""Subscribe to vLLM publishers, follow each one's sequence numbers, hand whole batches on.

A thread per publisher polls its SUB socket. Each publisher (an engine's data-parallel rank)
numbers its batches from 0; this follows them:
- the next number expected: handed on;
- further on (a gap: the PUB socket dropped batches, past its high-water mark or while
  reconnecting): the missed ones are asked of the replay socket first; those it no longer holds
  are reported lost (`lost`, and a warning), never hidden;
- a number already passed: the engine restarted (a new epoch): its batches from 0 are asked of
  the replay socket, and counted as a restart;
- on connecting (at start, and again after the publisher went away, which may be an engine
  restart the numbers alone do not show), and at the first message after a reconnect if the
  buffer was empty then: the replay socket's whole buffer, so what the engine sent before this
  subscriber heard it is not lost either. A buffered batch under a number already handed on but
  with another id (its ts differs) means a new engine: a restart.
Batches already handed on are remembered by sequence number and ts (with instance and rank, the
event id), so a replay overlapping the live stream hands nothing on twice; should one still
come twice (a second subscriber, a restart of this one), the ingestor drops it as a duplicate.
A message that does not decode, whatever the exception (a msgpack nested too deep for the
decoder included), is counted (`bad_input`, by reason), logged with its publisher and sequence
number at most once a minute per publisher and reason, and the stream goes on; so is a batch whose
delivery fails for its content alone. Sequence bookkeeping is arithmetic: a gap of any size costs
the same. Only the last `replay_buffer_steps` numbers of a gap are asked of the replay socket (it
holds no more); the rest are lost at once. A replay that times out is asked again, with backoff,
while the gap is open (at most `replay_retry_seconds`, the publisher's later messages held
meanwhile). Messages over `max_message_bytes` are cut off by ZMQ (the connection drops; it is made
again); at most `receive_queue` messages wait per publisher.

Each publisher has a thread of its own, so that one (or its replay socket) never holds another
back. Each is supervised: an exception that escapes it is counted (`deaths`), logged, and its
loop started again after a pause; `alive` is False until every loop runs again.

`deliver` is called on each publisher's thread with its decoded batches, in order (from several
threads at once: it must be thread-safe), and must not return before they are durable (the
engine's ingest, or a post to the service); a transient exception (the store or the log down) is
retried after a pause, the batches kept.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from app.core.errors import KvpError
from app.ingest.vllm.wire import (
    APPLY,
    ERROR,
    NESTING,
    SESSION_ID,
    BadInput,
    VllmEndpoint,
    decode_batch,
    split_live,
    split_replayed,
)
from kvprefetch_client.events import VllmKvEvents

log = logging.getLogger(__name__)

# How many messages one pass takes from the sockets before handing them on (one ingest call).
MAX_MESSAGES_PER_DELIVERY = 512
_POLL_MS = 100
_RETRY_SECONDS = 0.5
# As many as vLLM's replay buffer holds by default (buffer_steps): about 1 MB a publisher.
_RECENT_BATCHES = 10_000
_NO_END = 2**64
_LOG_EVERY_SECONDS = 60.0
# A replay asked again after a timeout: first after this, doubling up to the cap.
REPLAY_BACKOFF_SECONDS = 0.25
REPLAY_BACKOFF_CAP_SECONDS = 5.0
# The intake thread started again after a death: first after this, doubling up to the cap.
RESTART_BACKOFF_SECONDS = 0.5
RESTART_BACKOFF_CAP_SECONDS = 30.0
# Delivery failures that say nothing of the batches (the store or the log down, a network
# error): retried as long as it takes. Any other exception is the batches' own.
TRANSIENT = (KvpError, OSError)


def backoff_seconds(attempt: int, first: float, cap: float) -> float:
    """The pause before try `attempt` (1: the first retry): first, 2 first, 4 first... capped."""
    return min(cap, first * 2.0 ** min(max(attempt - 1, 0), 32))


def gap_to_ask(start: int, stop: int, buffer_steps: int) -> int:
    """Where a replay of start..stop-1 is asked from: a replay buffer of `buffer_steps` batches
    holds none before stop - buffer_steps, so those are not waited for."""
    return max(start, stop - buffer_steps)


def count_missing(lost_from: int, stop: int, held: Iterable[int]) -> int:
    """How many of lost_from..stop-1 are not in `held`: O(len(held)), whatever the gap."""
    if stop <= lost_from:
        return 0
    return (stop - lost_from) - sum(1 for seq in set(held) if lost_from <= seq < stop)


class IntakeCounters(Protocol):
    """What the subscriber reports (app/observe/metrics.py implements it)."""

    def vllm_batches_taken(self, batches: int, events: int) -> None: ...
    def vllm_input_refused(self, reason: str) -> None: ...
    def vllm_batches_recovered(self, batches: int) -> None: ...
    def vllm_batches_lost(self, batches: int) -> None: ...
    def vllm_publisher_restarted(self) -> None: ...
    def vllm_intake_died(self) -> None: ...


class NoCounters:
    def vllm_batches_taken(self, batches: int, events: int) -> None:
        pass

    def vllm_input_refused(self, reason: str) -> None:
        pass

    def vllm_batches_recovered(self, batches: int) -> None:
        pass

    def vllm_batches_lost(self, batches: int) -> None:
        pass

    def vllm_publisher_restarted(self) -> None:
        pass

    def vllm_intake_died(self) -> None:
        pass


@dataclass
class _Stream:
    endpoint: VllmEndpoint
    sub: zmq.Socket
    monitor: zmq.Socket
    expected: int | None = None  # the next sequence number; None: none seen yet
    reconnected: bool = False  # the publisher went away since the last message
    pending: list[tuple[int, bytes]] = field(default_factory=list)
    # sequence -> ts of the batches handed on lately (this epoch; with the sequence, the ts makes
    # the event id): a replay overlapping the live stream is told apart from a restarted engine
    # reusing the numbers.
    recent: dict[int, float] = field(default_factory=dict)
    # A gap whose replay timed out: when it opened, the tries so far, when to ask again.
    gap_opened: float | None = None
    gap_tries: int = 0
    gap_retry_at: float = 0.0
    # The message that waits for the gap, decoded (by its payload's identity): it is refused or
    # taken once, however many tries the gap takes.
    waiting: tuple[bytes, VllmKvEvents | None] | None = None


@dataclass
class IntakeTotals:
    """What the subscriber has seen, for tests and the CLI's summary."""

    batches: int = 0
    events: int = 0
    recovered: int = 0
    lost: int = 0
    restarts: int = 0
    bad_input: dict[str, int] = field(default_factory=dict)
    connects: int = 0  # SUB connections made (one per publisher, and one per reconnect)
    deaths: int = 0  # the intake thread died (and was started again)


class VllmSubscriber:
    def __init__(
        self,
        endpoints: Sequence[VllmEndpoint],
        deliver: Callable[[list[VllmKvEvents]], object],
        *,
        counters: IntakeCounters | None = None,
        replay_timeout_seconds: float = 2.0,
        replay_retry_seconds: float = 10.0,
        replay_buffer_steps: int = 10_000,
        max_message_bytes: int = 4 * 2**20,
        receive_queue: int = 1_000,
        context: zmq.Context | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("no vLLM endpoint to subscribe to")
        self.endpoints = list(endpoints)
        self.deliver = deliver
        self.counters: IntakeCounters = counters if counters is not None else NoCounters()
        self.replay_timeout_seconds = replay_timeout_seconds
        self.replay_retry_seconds = replay_retry_seconds
        self.replay_buffer_steps = replay_buffer_steps
        self.max_message_bytes = max_message_bytes
        self.receive_queue = receive_queue
        self.totals = IntakeTotals()
        self._ctx = context if context is not None else zmq.Context.instance()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._running: set[str] = set()  # the publishers whose loop runs, its sockets open
        self._lock = threading.Lock()  # the totals, counted from every publisher's thread
        self._logged: dict[tuple[str, str], tuple[float, int]] = {}  # (publisher, reason)

    # -- lifetime ---------------------------------------------------------------------------

    def start(self) -> None:
        """Run until `stop`: a daemon thread per publisher, so that what one publisher or its
        replay socket does (a replay waited on, a gap held open) never holds another's batches
        back; each thread started again whenever it dies."""
        if self._threads:
            return
        self._stop.clear()
        for ep in self.endpoints:
            thread = threading.Thread(
                target=self._supervise, args=(ep,), name=f"kvprefetch-vllm-{ep.name}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop and wait for the threads (each finishes the delivery in progress); every wait of
        theirs is cut short by the stop, so this takes about a poll's time."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("the vLLM intake %s did not stop within %g s", thread.name, timeout)
        self._threads = []

    @property
    def alive(self) -> bool:
        """The intake runs: every publisher's thread is up and its loop taking messages (none
        dead and waiting to be started again)."""
        return (
            bool(self._threads)
            and all(t.is_alive() for t in self._threads)
            and len(self._running) == len(self.endpoints)
        )

    def _supervise(self, ep: VllmEndpoint) -> None:
        deaths_in_a_row = 0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.run([ep])
                log.info("the vLLM intake of %s stopped", ep.name)
                return
            except Exception:
                if time.monotonic() - started > RESTART_BACKOFF_CAP_SECONDS:
                    deaths_in_a_row = 0  # it ran a while: the backoff starts anew
                deaths_in_a_row += 1
                with self._lock:
                    self.totals.deaths += 1
                self.counters.vllm_intake_died()
                pause = backoff_seconds(
                    deaths_in_a_row, RESTART_BACKOFF_SECONDS, RESTART_BACKOFF_CAP_SECONDS
                )
                log.exception(
                    "the vLLM intake of %s died (%d deaths so far); starting it again in %g s",
                    ep.name,
                    self.totals.deaths,
                    pause,
                )
                self._stop.wait(pause)

    def run(self, endpoints: Sequence[VllmEndpoint] | None = None) -> None:
        """The loop over these publishers (all by default), on the calling thread, until `stop`;
        an exception escapes (`start`'s supervisor catches it)."""
        streams: list[_Stream] = []
        try:
            for ep in self.endpoints if endpoints is None else endpoints:
                streams.append(self._open(ep))
            self._loop(streams)
        finally:
            for s in streams:
                self._running.discard(s.endpoint.name)
                s.sub.close(linger=0)
                s.monitor.close(linger=0)

    def _loop(self, streams: list[_Stream]) -> None:
        poller = zmq.Poller()
        by_socket: dict[object, tuple[_Stream, bool]] = {}
        for s in streams:
            poller.register(s.sub, zmq.POLLIN)
            poller.register(s.monitor, zmq.POLLIN)
            by_socket[s.sub] = (s, False)
            by_socket[s.monitor] = (s, True)
        log.info(
            "subscribed to vLLM publisher%s %s",
            "s" if len(streams) > 1 else "",
            ", ".join(f"{s.endpoint.name} at {s.endpoint.endpoint}" for s in streams),
        )
        self._running.update(s.endpoint.name for s in streams)
        while not self._stop.is_set():
            ready = dict(poller.poll(_POLL_MS))
            batches: list[VllmKvEvents] = []
            for sock in ready:
                stream, is_monitor = by_socket[sock]
                if is_monitor:
                    batches.extend(self._on_monitor(stream))
                else:
                    self._take(stream)
            for s in streams:
                if s.pending:
                    batches.extend(self._follow(s))
            if batches:
                self._hand_on(batches)

    def _open(self, ep: VllmEndpoint) -> _Stream:
        sub = self._ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, ep.topic.encode())
            sub.setsockopt(zmq.RCVHWM, self.receive_queue)
            # ZMQ drops a connection that sends a bigger frame, before it is held in memory.
            sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sub.connect(ep.endpoint)
        except BaseException:
            sub.close(linger=0)
            raise
        return _Stream(ep, sub, monitor)

    def _on_monitor(self, s: _Stream) -> list[VllmKvEvents]:
        out: list[VllmKvEvents] = []
        try:
            while True:
                event = recv_monitor_message(s.monitor, zmq.NOBLOCK)["event"]
                if event == zmq.EVENT_DISCONNECTED:
                    # It may come back as a new engine, its sequence from 0.
                    log.info("vLLM publisher %s disconnected", s.endpoint.name)
                    s.reconnected = True
                    # A connection dropped for a protocol error (a frame over MAXMSGSIZE) is
                    # never made again by ZMQ itself: made again here, once, for any drop.
                    with contextlib.suppress(zmq.ZMQError):
                        s.sub.disconnect(s.endpoint.endpoint)
                    s.sub.connect(s.endpoint.endpoint)
                elif event == zmq.EVENT_CONNECTED:
                    with self._lock:
                        self.totals.connects += 1
                    # What it sent before this SUB was connected (at startup, or an engine that
                    # came back and published before we did reconnect) is only in its buffer.
                    out.extend(self._catch_up(s))
        except zmq.Again:
            pass
        return out

    def _take(self, s: _Stream) -> None:
        try:
            for _ in range(MAX_MESSAGES_PER_DELIVERY):
                frames = s.sub.recv_multipart(zmq.NOBLOCK)
                try:
                    s.pending.append(split_live(frames))
                except BadInput as exc:
                    self._bad(s.endpoint, None, exc)
        except zmq.Again:
            pass

    # -- following one publisher's sequence -------------------------------------------------

    def _follow(self, s: _Stream) -> list[VllmKvEvents]:
        out: list[VllmKvEvents] = []
        ep = s.endpoint
        if s.gap_opened is not None and time.monotonic() < s.gap_retry_at:
            if len(s.pending) <= self.receive_queue:
                return out  # the gap's replay is asked again later; its successors wait
            s.gap_retry_at = 0.0  # too many waiting: the next try is the last
        messages, s.pending = s.pending, []
        for i, (seq, payload) in enumerate(messages):
            if i == 0 and s.waiting is not None and s.waiting[0] is payload:
                batch = s.waiting[1]
            else:
                batch = self._decode(ep, seq, payload)
            s.waiting = None
            if s.reconnected:
                # The first message since the publisher went away, and the catch-up on connecting
                # found its buffer empty: it may be a new engine whose first batches this SUB
                # missed, under numbers that look like the old one's next. Its buffer says.
                out.extend(self._catch_up(s))
                s.reconnected = False
            if batch is not None and s.recent.get(seq) == batch.ts:
                continue  # handed on already, from the replay socket
            expected = s.expected
            restarted = expected is not None and seq < expected
            if restarted:
                assert expected is not None
                self._restarted(s, seq, expected)
                expected = s.expected = 0  # a new epoch: its batches from 0 are missed
            replayed: list[VllmKvEvents] | None = []
            if expected is None:
                # First contact: whatever the buffer holds from before it (no loss of ours).
                if seq > 0:
                    replayed = self._replay(s, 0, seq, lost_from=seq)
            elif seq > expected:
                if s.gap_opened is None and not restarted:
                    self._warn(
                        ep.name,
                        "gap",
                        "vLLM publisher %s skipped from sequence %d to %d: asking its replay "
                        "socket",
                        ep.name,
                        expected,
                        seq,
                    )
                replayed = self._replay(
                    s, expected, seq, lost_from=expected, waiting=len(messages) - i
                )
            if replayed is None:
                # The replay timed out and the gap stays open: this message and those after it
                # wait for the next try, so the publisher's batches stay in order.
                s.pending = [*messages[i:], *s.pending]
                s.waiting = (payload, batch)
                return out
            out.extend(replayed)
            s.expected = seq + 1
            if batch is not None:
                out.append(self._handed(s, seq, batch))
        return out

    def _restarted(self, s: _Stream, seq: int, expected: int) -> None:
        with self._lock:
            self.totals.restarts += 1
        self.counters.vllm_publisher_restarted()
        s.recent.clear()
        self._warn(
            s.endpoint.name,
            "restart",
            "vLLM publisher %s restarted: sequence %d after %d (a new epoch)",
            s.endpoint.name,
            seq,
            expected - 1,
        )

    def _handed(self, s: _Stream, seq: int, batch: VllmKvEvents) -> VllmKvEvents:
        recent = s.recent
        recent[seq] = batch.ts
        if len(recent) > _RECENT_BATCHES:
            for old in sorted(recent)[: _RECENT_BATCHES // 2]:
                del recent[old]
        return batch

    def _catch_up(self, s: _Stream) -> list[VllmKvEvents]:
        """The publisher's whole replay buffer, on (re)connecting."""
        ep = s.endpoint
        if ep.replay_endpoint is None:
            return []
        try:
            got, _ = self._ask(s, 0, _NO_END)
        except (TimeoutError, zmq.ZMQError) as exc:
            log.warning("vLLM publisher %s: no catch-up from its replay socket: %s", ep.name, exc)
            return []
        if not got:
            return []  # nothing learned: still `reconnected` when it was
        s.reconnected = False
        expected = s.expected
        first, last = min(got), max(got)
        new_epoch = expected is not None and any(
            s.recent.get(seq, batch.ts) != batch.ts for seq, batch in got.items()
        )
        if new_epoch:
            assert expected is not None
            self._restarted(s, last, expected)
        elif expected is not None and first > expected:
            self._lost(ep, first - expected, expected, first - 1, None)
        out = [self._handed(s, seq, got[seq]) for seq in sorted(got) if seq not in s.recent]
        if out:
            with self._lock:
                self.totals.recovered += len(out)
            self.counters.vllm_batches_recovered(len(out))
        if new_epoch or expected is None or last + 1 > expected:
            s.expected = last + 1
        return out

    def _decode(self, ep: VllmEndpoint, seq: int, payload: bytes) -> VllmKvEvents | None:
        dropped: list[str] = []
        try:
            batch = decode_batch(ep, seq, payload, dropped)
        except BadInput as exc:
            self._bad(ep, seq, exc)
            return None
        except RecursionError:
            self._bad(ep, seq, BadInput(NESTING, "the payload is nested too deep to decode"))
            return None
        except Exception as exc:  # whatever a message does to the decoder, the stream goes on
            self._bad(ep, seq, BadInput(ERROR, f"the payload did not decode: {exc!r}"[:500]))
            return None
        for session_id in dropped:
            self._bad(
                ep,
                seq,
                BadInput(SESSION_ID, f"session_id {session_id} is no valid session id: dropped"),
            )
        return batch

    def _bad(self, ep: VllmEndpoint, seq: int | None, exc: BadInput) -> None:
        with self._lock:
            self.totals.bad_input[exc.reason] = self.totals.bad_input.get(exc.reason, 0) + 1
        self.counters.vllm_input_refused(exc.reason)
        self._warn(
            ep.name,
            exc.reason,
            "vLLM publisher %s (%s), sequence %s: message refused (%s): %s",
            ep.name,
            ep.endpoint,
            "?" if seq is None else seq,
            exc.reason,
            exc,
        )

    def _warn(self, publisher: str, kind: str, msg: str, *args: object) -> None:
        """A warning logged at most once a minute per publisher and kind, with how many were not:
        what a publisher sends costs no log volume, however much it sends."""
        key = (publisher, kind)
        now = time.monotonic()
        last, quiet = self._logged.get(key, (-_LOG_EVERY_SECONDS, 0))
        if now - last < _LOG_EVERY_SECONDS:
            self._logged[key] = (last, quiet + 1)
            return
        self._logged[key] = (now, 0)
        if quiet:
            msg += f" ({quiet} more such lines not logged in the last minute)"
        log.warning(msg, *args)

    def _lost(self, ep: VllmEndpoint, n: int, first: int, last: int, why: str | None) -> None:
        with self._lock:
            self.totals.lost += n
        self.counters.vllm_batches_lost(n)
        self._warn(
            ep.name,
            "lost",
            "vLLM publisher %s: %d batches between sequence %d and %d are lost (%s)",
            ep.name,
            n,
            first,
            last,
            why or "the replay buffer no longer holds them",
        )

    def _replay(
        self, s: _Stream, start: int, stop: int, *, lost_from: int, waiting: int = 0
    ) -> list[VllmKvEvents] | None:
        """Batches start..stop-1 from the publisher's replay socket (those not handed on yet);
        those of lost_from..stop-1 it does not hold are reported lost. None: the replay timed
        out and is to be asked again later (the gap stays open); `waiting`: the publisher's
        messages that would wait for it."""
        ep = s.endpoint
        got: dict[int, VllmKvEvents] = {}
        held: set[int] = set()
        error = None
        ask_from = gap_to_ask(start, stop, self.replay_buffer_steps)
        if ep.replay_endpoint is None:
            error = "no replay endpoint configured"
        else:
            try:
                got, held = self._ask(s, ask_from, stop)
            except (TimeoutError, zmq.ZMQError) as exc:
                error = str(exc) or type(exc).__name__
                if lost_from < stop and self._retry_later(s, error, waiting + len(s.pending)):
                    return None
        s.gap_opened = None
        s.gap_tries = 0
        # One the buffer held but that did not decode is counted as bad input, not lost.
        missing = count_missing(lost_from, stop, held)
        if missing:
            if error is None and ask_from > lost_from:
                error = f"more than the replay buffer's {self.replay_buffer_steps} batches"
            self._lost(ep, missing, lost_from, stop - 1, error)
        out = [
            self._handed(s, seq, got[seq])
            for seq in sorted(got)
            if s.recent.get(seq) != got[seq].ts
        ]
        if out:
            with self._lock:
                self.totals.recovered += len(out)
            self.counters.vllm_batches_recovered(len(out))
        return out

    def _retry_later(self, s: _Stream, error: str, waiting: int) -> bool:
        """After a replay that failed: whether the gap stays open for another try (and when)."""
        now = time.monotonic()
        if s.gap_opened is None:
            s.gap_opened = now
        s.gap_tries += 1
        if (
            self._stop.is_set()
            or now - s.gap_opened >= self.replay_retry_seconds
            or waiting > self.receive_queue
        ):
            return False
        pause = backoff_seconds(s.gap_tries, REPLAY_BACKOFF_SECONDS, REPLAY_BACKOFF_CAP_SECONDS)
        s.gap_retry_at = now + pause
        self._warn(
            s.endpoint.name,
            "retry",
            "vLLM publisher %s: replay try %d failed (%s); asking again in %g s",
            s.endpoint.name,
            s.gap_tries,
            error,
            pause,
        )
        return True

    def _ask(self, s: _Stream, start: int, stop: int) -> tuple[dict[int, VllmKvEvents], set[int]]:
        """The batches start..stop-1 the replay socket holds: those that decode, and the sequence
        numbers of all. Raises TimeoutError (also when stopped while waiting)."""
        ep = s.endpoint
        assert ep.replay_endpoint is not None
        # A fresh DEALER each time: one left connected to a dead engine would hold a stale
        # request for its successor.
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            dealer.setsockopt(zmq.RCVHWM, self.receive_queue)
            dealer.connect(ep.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            got: dict[int, VllmKvEvents] = {}
            held: set[int] = set()
            deadline = time.monotonic() + self.replay_timeout_seconds
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or self._stop.is_set():
                    raise TimeoutError(
                        f"the replay socket {ep.replay_endpoint} did not finish within "
                        f"{self.replay_timeout_seconds:g} s"
                    )
                if not dealer.poll(min(left_ms, _POLL_MS)):
                    continue
                frames = dealer.recv_multipart()
                try:
                    answer = split_replayed(frames)
                except BadInput as exc:
                    self._bad(ep, None, exc)
                    continue
                if answer is None:
                    return got, held
                seq, payload = answer
                # No more than its buffer can hold: a socket answering forever is cut short.
                if start <= seq < stop and len(held) < self.replay_buffer_steps:
                    held.add(seq)
                    batch = self._decode(ep, seq, payload)
                    if batch is not None:
                        got[seq] = batch
        finally:
            dealer.close(linger=0)

    # -- handing on -------------------------------------------------------------------------

    def _hand_on(self, batches: list[VllmKvEvents]) -> None:
        """Deliver, retrying transient failures as long as it takes; batches whose delivery
        fails otherwise are tried one by one, and one failing alone is refused (`apply`)."""
        failure = self._deliver(batches)
        if failure is None:
            self._taken(batches)
            return
        if len(batches) == 1:
            self._bad_batch(batches[0], failure)
            return
        for batch in batches:
            failure = self._deliver([batch])
            if failure is None:
                self._taken([batch])
            else:
                self._bad_batch(batch, failure)

    def _deliver(self, batches: list[VllmKvEvents]) -> Exception | None:
        """None once delivered (or stopping); the exception that is the batches' own."""
        while True:
            try:
                self.deliver(batches)
                return None
            except TRANSIENT:
                if self._stop.is_set():
                    log.exception("vLLM intake stopping: %d batches not delivered", len(batches))
                    return None
                log.exception("delivering %d vLLM batches failed; retrying", len(batches))
                self._stop.wait(_RETRY_SECONDS)
            except Exception as exc:
                if self._stop.is_set():
                    return None
                return exc

    def _bad_batch(self, batch: VllmKvEvents, exc: Exception) -> None:
        ep = VllmEndpoint(batch.instance_id, batch.data_parallel_rank or 0, "")
        for known in self.endpoints:
            if (known.instance_id, known.rank) == (ep.instance_id, ep.rank):
                ep = known
        seq = _seq_of(batch.event_id)
        self._bad(ep, seq, BadInput(APPLY, f"the batch could not be applied: {exc!r}"[:500]))

    def _taken(self, batches: list[VllmKvEvents]) -> None:
        events = sum(len(b.events) for b in batches)
        with self._lock:
            self.totals.batches += len(batches)
            self.totals.events += events
        self.counters.vllm_batches_taken(len(batches), events)


def _seq_of(event_id: str) -> int | None:
    """The sequence number in a batch's event id (wire.event_id)."""
    parts = event_id.split(":")
    return int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else None
