"""Process-level tuning for a long-running service."""

from __future__ import annotations

import gc
from collections.abc import Sized

# Events between two collections of the youngest generation by the pacer, and how many of those
# make one collection of the two young generations: a pause walks at most what the service
# allocated and still held over YOUNG_GENERATIONS_EVENTS events (docs/decisions.md, "The cyclic
# GC, paced by events", has the measurement).
YOUNG_COLLECTION_EVENTS = 5_000
YOUNG_GENERATIONS_EVERY = 4
# The collector's own full collections: never (the count of young collections they wait for).
_NO_FULL_COLLECTIONS = 2**31 - 1

_paced = False


def tune_gc() -> None:
    """Collect young objects far less often, by count and by the pacer; never the whole heap.

    Ingestion allocates many short-lived objects and the live state holds millions of long-lived
    ones that form no reference cycles, so the default thresholds (700, 10, 10) run full
    collections that free nothing: 17% of the server's busy time under load (bench/README.md).
    A high first threshold alone is not enough: the collector counts allocations *less
    deallocations*, and once the store forgets as fast as it learns (retention) the count stays
    near zero while the young generation grows to most of the heap, collected at last in one
    pause of seconds. So `serve` also collects the young generations by the events it ingests
    (`young_collector`).
    """
    global _paced
    gc.set_threshold(100_000, 50, _NO_FULL_COLLECTIONS)
    gc.freeze()  # what exists at startup is never garbage
    _paced = True


class YoungCollector:
    """An ingest observer: collects the youngest generation every `every_events` events, and
    both young generations every `generations_every`-th time, so that a pause walks at most
    what `every_events * generations_every` events left alive.

    Not both every time: what is alive at a collection of both goes to the oldest generation,
    which is never collected (full collections walk the whole heap: seconds). Objects in flight
    then (a request's, in reference cycles) would stay there once dead; in the middle generation
    they are collected at the next collection of both, by when they are gone.
    """

    def __init__(
        self,
        every_events: int = YOUNG_COLLECTION_EVENTS,
        generations_every: int = YOUNG_GENERATIONS_EVERY,
    ) -> None:
        if every_events < 1 or generations_every < 1:
            raise ValueError("every_events and generations_every must be at least 1")
        self.every_events = every_events
        self.generations_every = generations_every
        self.collections = [0, 0]  # of the youngest generation alone, and of both
        self._events = 0

    def observe(self, events: Sized) -> None:
        self._events += len(events)
        if self._events >= self.every_events:
            self._events = 0
            done = self.collections[0] + self.collections[1] + 1
            generation = 1 if done % self.generations_every == 0 else 0
            self.collections[generation] += 1
            gc.collect(generation)


def young_collector() -> YoungCollector | None:
    """The pacer, in a process `tune_gc` tuned (`serve`); None elsewhere (tests, tools), whose
    collector keeps Python's defaults."""
    return YoungCollector() if _paced else None
