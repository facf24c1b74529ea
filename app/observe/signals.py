"""Session signals, counted: how many of each kind came, and how many were followed by a request.

A `session_signal` is followed when a `request_routed` of the same session comes at most
FOLLOW_WINDOW_SECONDS after it, by event time (`0 <= routed.ts - signal.ts <= window`). Each
signal counts once, followed or not. What is judged is what the ingest observer is told, in the
order accepted: a signal posted after the request it came before (late) is never followed.

Bounded whatever clients send:

- Kinds, as label values: the common SIGNAL_KINDS, then the first `max_deployment_kinds` other
  kinds seen (a deployment's own), then `other` for the rest. (With several workers each learns
  its own first ones: at most that many per worker.)
- Pending signals (not followed yet, inside the window): at most `max_pending_per_session` per
  session (a flood drops the oldest) and `max_pending` in all (the oldest go first); a pending
  signal is dropped once the newest event time seen is more than the window past it.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from app.predict.features import SIGNAL_FOLLOW_SECONDS
from kvprefetch_client.events import SIGNAL_KINDS, Event, RequestRouted, SessionSignal

# The same window the model's features and its card judge follow-through by.
FOLLOW_WINDOW_SECONDS = SIGNAL_FOLLOW_SECONDS
OTHER_KIND = "other"
# Told of each signal counted, and each signal followed, with its kind's label.
KindHook = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class KindCount:
    kind: str
    signals: int
    followed: int

    @property
    def followed_share(self) -> float | None:
        return self.followed / self.signals if self.signals else None


class SignalKinds:
    """Kinds as bounded label values (see the module docstring)."""

    def __init__(self, max_deployment_kinds: int = 8) -> None:
        if max_deployment_kinds < 0:
            raise ValueError("max_deployment_kinds must be >= 0")
        self.max_deployment_kinds = max_deployment_kinds
        self._known = set(SIGNAL_KINDS)
        self.deployment_kinds: list[str] = []

    def label(self, kind: str) -> str:
        if kind in self._known:
            return kind
        if len(self.deployment_kinds) < self.max_deployment_kinds and kind != OTHER_KIND:
            self.deployment_kinds.append(kind)
            self._known.add(kind)
            return kind
        return OTHER_KIND

    def labels(self) -> list[str]:
        """Every label given so far, and those always given: the common kinds first."""
        return [*SIGNAL_KINDS, *self.deployment_kinds, OTHER_KIND]


class SignalFollowups:
    """The ingest-side count of signals and their follow-through (module docstring)."""

    def __init__(
        self,
        *,
        window_seconds: float = FOLLOW_WINDOW_SECONDS,
        max_deployment_kinds: int = 8,
        max_pending: int = 100_000,
        max_pending_per_session: int = 8,
        on_signal: KindHook | None = None,
        on_followed: KindHook | None = None,
    ) -> None:
        if window_seconds <= 0 or max_pending < 1 or max_pending_per_session < 1:
            raise ValueError("the window and both caps must be positive")
        self.window_seconds = window_seconds
        self.max_pending = max_pending
        self.max_pending_per_session = max_pending_per_session
        self.kinds = SignalKinds(max_deployment_kinds)
        self._on_signal = on_signal
        self._on_followed = on_followed
        # session -> its pending signals (ts, label), in arrival order
        self._pending: dict[str, list[tuple[float, str]]] = {}
        # every pending signal in arrival order, for expiry and the cap; one matched or dropped
        # stays here until it comes up (it is then skipped), so this is bounded by max_pending
        self._order: collections.deque[tuple[float, str, str]] = collections.deque()
        self._newest = float("-inf")
        self._signals: collections.Counter[str] = collections.Counter()
        self._followed: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()  # observe() on the store thread, totals() on the loop

    @property
    def pending(self) -> int:
        """Signals held, waiting for a request (a bound on memory, not an exact count)."""
        return len(self._order)

    def observe(self, events: Sequence[Event]) -> None:
        """The ingest observer: every accepted event, in order (cheap for any but signals and
        routings; routings cost a dict lookup while nothing is pending)."""
        with self._lock:
            for e in events:
                if e.ts > self._newest:
                    self._newest = e.ts
                if e.type == "session_signal":
                    self._signal(e)
                elif e.type == "request_routed" and self._pending:
                    self._routed(e)
            self._expire()

    def _signal(self, e: SessionSignal) -> None:
        label = self.kinds.label(e.kind)
        self._signals[label] += 1
        if self._on_signal is not None:
            self._on_signal(label)
        entry = (e.ts, label)
        held = self._pending.setdefault(e.session_id, [])
        held.append(entry)
        if len(held) > self.max_pending_per_session:
            del held[0]  # a flood for one session: its oldest pending one is dropped
        self._order.append((e.ts, e.session_id, label))
        while len(self._order) > self.max_pending:
            self._drop(*self._order.popleft())

    def _routed(self, e: RequestRouted) -> None:
        held = self._pending.get(e.session_id)
        if held is None:
            return
        ts, window = e.ts, self.window_seconds
        kept = []
        for entry in held:
            if 0 <= ts - entry[0] <= window:
                self._followed[entry[1]] += 1
                if self._on_followed is not None:
                    self._on_followed(entry[1])
            else:
                kept.append(entry)  # newer than the request (it waits for the next), or stale
        if kept:
            self._pending[e.session_id] = kept
        else:
            del self._pending[e.session_id]

    def _drop(self, ts: float, session_id: str, label: str) -> None:
        held = self._pending.get(session_id)
        if held is None:
            return
        try:
            held.remove((ts, label))
        except ValueError:  # followed already, or dropped by the session's cap
            return
        if not held:
            del self._pending[session_id]

    def _expire(self) -> None:
        """Pending signals more than the window older than the newest event time cannot be
        followed any more: dropped (arrival order is about event order, so this stops at the
        first one still in the window)."""
        order, floor = self._order, self._newest - self.window_seconds
        while order and order[0][0] < floor:
            self._drop(*order.popleft())

    def totals(self) -> list[KindCount]:
        """Signals and followed signals per label, every label given so far (zero included)."""
        with self._lock:
            return [
                KindCount(kind, self._signals[kind], self._followed[kind])
                for kind in self.kinds.labels()
            ]
