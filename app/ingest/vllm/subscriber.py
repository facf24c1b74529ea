"""Subscribe to vLLM publishers, follow each one's sequence numbers, hand whole batches on.

One thread polls every publisher's SUB socket. Each publisher (an engine's data-parallel rank)
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
A message that does not decode is counted (`bad_input`, by reason) and logged with its publisher
and sequence number, and the stream goes on.

`deliver` is called on this thread with the decoded batches, in order per publisher, and must not
return before they are durable (the engine's ingest, or a post to the service); an exception is
retried after a pause, the batches kept.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from app.ingest.vllm.wire import (
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


class IntakeCounters(Protocol):
    """What the subscriber reports (app/observe/metrics.py implements it)."""

    def vllm_batches_taken(self, batches: int, events: int) -> None: ...
    def vllm_input_refused(self, reason: str) -> None: ...
    def vllm_batches_recovered(self, batches: int) -> None: ...
    def vllm_batches_lost(self, batches: int) -> None: ...
    def vllm_publisher_restarted(self) -> None: ...


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


class VllmSubscriber:
    def __init__(
        self,
        endpoints: Sequence[VllmEndpoint],
        deliver: Callable[[list[VllmKvEvents]], object],
        *,
        counters: IntakeCounters | None = None,
        replay_timeout_seconds: float = 2.0,
        context: zmq.Context | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("no vLLM endpoint to subscribe to")
        self.endpoints = list(endpoints)
        self.deliver = deliver
        self.counters: IntakeCounters = counters if counters is not None else NoCounters()
        self.replay_timeout_seconds = replay_timeout_seconds
        self.totals = IntakeTotals()
        self._ctx = context if context is not None else zmq.Context.instance()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifetime ---------------------------------------------------------------------------

    def start(self) -> None:
        """Run on a daemon thread until `stop`."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name="kvprefetch-vllm", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop and wait for the thread (it finishes the delivery in progress)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def run(self) -> None:
        streams = [self._open(ep) for ep in self.endpoints]
        poller = zmq.Poller()
        by_socket: dict[object, tuple[_Stream, bool]] = {}
        for s in streams:
            poller.register(s.sub, zmq.POLLIN)
            poller.register(s.monitor, zmq.POLLIN)
            by_socket[s.sub] = (s, False)
            by_socket[s.monitor] = (s, True)
        log.info(
            "subscribed to %d vLLM publishers: %s",
            len(streams),
            ", ".join(f"{s.endpoint.name} at {s.endpoint.endpoint}" for s in streams),
        )
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(_POLL_MS))
                if not ready:
                    continue
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
        finally:
            for s in streams:
                s.sub.close(linger=0)
                s.monitor.close(linger=0)

    def _open(self, ep: VllmEndpoint) -> _Stream:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, ep.topic.encode())
        sub.setsockopt(zmq.RCVHWM, 100_000)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(ep.endpoint)
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
                elif event == zmq.EVENT_CONNECTED:
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
        messages, s.pending = s.pending, []
        for seq, payload in messages:
            batch = self._decode(ep, seq, payload)
            if s.reconnected:
                # The first message since the publisher went away, and the catch-up on connecting
                # found its buffer empty: it may be a new engine whose first batches this SUB
                # missed, under numbers that look like the old one's next. Its buffer says.
                out.extend(self._catch_up(s))
                s.reconnected = False
            if batch is not None and s.recent.get(seq) == batch.ts:
                continue  # handed on already, from the replay socket
            expected = s.expected
            if expected is None:
                # First contact: whatever the buffer holds from before it (no loss of ours).
                if seq > 0:
                    out.extend(self._replay(s, 0, seq, lost_from=seq))
            elif seq > expected:
                log.warning(
                    "vLLM publisher %s skipped from sequence %d to %d: asking its replay socket",
                    ep.name,
                    expected,
                    seq,
                )
                out.extend(self._replay(s, expected, seq, lost_from=expected))
            elif seq < expected:
                self._restarted(s, seq, expected)
                if seq > 0:
                    out.extend(self._replay(s, 0, seq, lost_from=0))
            s.expected = seq + 1
            if batch is not None:
                out.append(self._handed(s, seq, batch))
        return out

    def _restarted(self, s: _Stream, seq: int, expected: int) -> None:
        self.totals.restarts += 1
        self.counters.vllm_publisher_restarted()
        s.recent.clear()
        log.warning(
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
        for session_id in dropped:
            self._bad(
                ep,
                seq,
                BadInput(SESSION_ID, f"session_id {session_id} is no valid session id: dropped"),
            )
        return batch

    def _bad(self, ep: VllmEndpoint, seq: int | None, exc: BadInput) -> None:
        self.totals.bad_input[exc.reason] = self.totals.bad_input.get(exc.reason, 0) + 1
        self.counters.vllm_input_refused(exc.reason)
        log.warning(
            "vLLM publisher %s (%s), sequence %s: message refused (%s): %s",
            ep.name,
            ep.endpoint,
            "?" if seq is None else seq,
            exc.reason,
            exc,
        )

    def _lost(self, ep: VllmEndpoint, n: int, first: int, last: int, why: str | None) -> None:
        self.totals.lost += n
        self.counters.vllm_batches_lost(n)
        log.warning(
            "vLLM publisher %s: %d batches between sequence %d and %d are lost (%s)",
            ep.name,
            n,
            first,
            last,
            why or "the replay buffer no longer holds them",
        )

    def _replay(self, s: _Stream, start: int, stop: int, *, lost_from: int) -> list[VllmKvEvents]:
        """Batches start..stop-1 from the publisher's replay socket (those not handed on yet);
        those of lost_from..stop-1 it does not hold are reported lost."""
        ep = s.endpoint
        got: dict[int, VllmKvEvents] = {}
        held: set[int] = set()
        error = None
        if ep.replay_endpoint is None:
            error = "no replay endpoint configured"
        else:
            try:
                got, held = self._ask(s, start, stop)
            except (TimeoutError, zmq.ZMQError) as exc:
                error = str(exc) or type(exc).__name__
        # One the buffer held but that did not decode is counted as bad input, not lost.
        missing = sum(1 for seq in range(lost_from, stop) if seq not in held)
        if missing:
            self._lost(ep, missing, lost_from, stop - 1, error)
        out = [
            self._handed(s, seq, got[seq])
            for seq in sorted(got)
            if s.recent.get(seq) != got[seq].ts
        ]
        if out:
            self.totals.recovered += len(out)
            self.counters.vllm_batches_recovered(len(out))
        return out

    def _ask(self, s: _Stream, start: int, stop: int) -> tuple[dict[int, VllmKvEvents], set[int]]:
        """The batches start..stop-1 the replay socket holds: those that decode, and the sequence
        numbers of all. Raises TimeoutError."""
        ep = s.endpoint
        assert ep.replay_endpoint is not None
        # A fresh DEALER each time: one left connected to a dead engine would hold a stale
        # request for its successor.
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(ep.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            got: dict[int, VllmKvEvents] = {}
            held: set[int] = set()
            deadline = time.monotonic() + self.replay_timeout_seconds
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not dealer.poll(left_ms):
                    raise TimeoutError(
                        f"the replay socket {ep.replay_endpoint} did not finish within "
                        f"{self.replay_timeout_seconds:g} s"
                    )
                frames = dealer.recv_multipart()
                try:
                    answer = split_replayed(frames)
                except BadInput as exc:
                    self._bad(ep, None, exc)
                    continue
                if answer is None:
                    return got, held
                seq, payload = answer
                if start <= seq < stop:
                    held.add(seq)
                    batch = self._decode(ep, seq, payload)
                    if batch is not None:
                        got[seq] = batch
        finally:
            dealer.close(linger=0)

    # -- handing on -------------------------------------------------------------------------

    def _hand_on(self, batches: list[VllmKvEvents]) -> None:
        while True:
            try:
                self.deliver(batches)
                break
            except Exception:
                if self._stop.is_set():
                    log.exception("vLLM intake stopping: %d batches not delivered", len(batches))
                    return
                log.exception("delivering %d vLLM batches failed; retrying", len(batches))
                self._stop.wait(_RETRY_SECONDS)
        events = sum(len(b.events) for b in batches)
        self.totals.batches += len(batches)
        self.totals.events += events
        self.counters.vllm_batches_taken(len(batches), events)
