"""The bounded queue between ingestion and planning.

Ingestion acknowledges a batch once it is logged and applied to the store; what the planning side
does with it (advice hit rates, the scheduler's feedback, outcome judging, metrics) happens here,
off the request, in batches that amortise it. The queue holds at most `max_events`: the events
route asks `has_room` before it logs anything and answers 503 with Retry-After when there is
none, so a slow planning side pushes back on routers instead of growing memory.

Readers of what the planning side derives call `drain()` first, which makes the service
read-your-writes: a GET after an acknowledged POST sees its effect.

With a blocking store the Ingestor puts and the observers drain on the store thread
(app/state/storethread.py), one job at a time as on the loop; `run` then wakes on the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence

from app.ingest.ingestor import Observer
from app.state.storethread import Offload
from kvprefetch_client.events import Event

log = logging.getLogger(__name__)

# Events handed to the observer at once by the background loop, before it lets requests in.
CHUNK_EVENTS = 5_000


class Backlog:
    def __init__(self, observer: Observer, max_events: int) -> None:
        self.observer = observer
        self.max_events = max_events
        self._batches: deque[Sequence[Event]] = deque()
        self._events = 0
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.refused = 0

    @property
    def events(self) -> int:
        return self._events

    def has_room(self, events: int, coming: int = 0) -> bool:
        """Room for a batch of `events` once `coming` more (batches accepted, being logged) are
        put."""
        held = self._events + coming
        # An empty backlog takes any batch the batch limit allows (Settings checks it fits).
        return held == 0 or held + events <= self.max_events

    def put(self, events: Sequence[Event]) -> None:
        """The Ingestor's observer: never refuses, since `has_room` was asked before the batch was
        logged, and on the event loop nothing can come between."""
        self._batches.append(events)
        self._events += len(events)
        loop = self._loop
        if loop is None or _running_loop() is loop:
            self._wake.set()
        else:  # put on the store thread: asyncio.Event is the loop's alone
            loop.call_soon_threadsafe(self._wake.set)

    def drain(self, max_events: int | None = None) -> int:
        """Hand queued events to the observer, in order; all of them unless `max_events`."""
        handed = 0
        while self._batches and (max_events is None or handed < max_events):
            chunk: list[Event] = []
            while self._batches and len(chunk) < CHUNK_EVENTS:
                batch = self._batches.popleft()
                self._events -= len(batch)
                chunk.extend(batch)
            handed += len(chunk)
            try:
                self.observer(chunk)
            except Exception:  # the events are durable and applied; only the derived views lag
                log.exception("the planning side failed on %d events", len(chunk))
        return handed

    async def run(self, offload: Offload | None = None) -> None:
        """Drain in chunks as events come; `offload`, when given, runs each chunk's drain (on the
        store thread)."""
        self._loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._batches:
                if offload is None:
                    self.drain(CHUNK_EVENTS)
                else:
                    await offload(self.drain, CHUNK_EVENTS, fail_fast=False)
                await asyncio.sleep(0)  # let requests in between chunks


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
