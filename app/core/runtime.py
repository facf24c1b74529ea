"""Process-level tuning for a long-running service."""

from __future__ import annotations

import contextlib
import gc
import importlib
import sys
from collections.abc import Sized

# Events between two collections of the young generations by the pacer: a pause walks what the
# service allocated and still held over this many events, so the pause scales with it and the
# total does not. At 20,000 the pauses (60-100 ms) were the longest holds of the event loop
# under `bench load` at half its capacity (docs/decisions.md, "Ingest at half the ceiling, and
# steady", has the measurements).
YOUNG_COLLECTION_EVENTS = 5_000
# The collector's own full collections: never (the count of young collections they wait for).
_NO_FULL_COLLECTIONS = 2**31 - 1

_paced = False

# What LightGBM and lleaves import where these are installed, for their scikit-learn, pandas,
# Dask and plotting interfaces: none of which the service calls (its base install has none).
MODEL_LIBRARY_BRIDGES = (
    "sklearn",
    "pandas",
    "dask",
    "distributed",
    "pyarrow",
    "cffi",
    "matplotlib",
    "graphviz",
)


def import_model_libraries_bare() -> None:
    """Import LightGBM (and lleaves, when installed) as the service's base install has them:
    without their bridges to scikit-learn, pandas and Dask.

    Where the extras are installed (the `all` install, the tests' venv) LightGBM imports
    scikit-learn, pandas and SciPy's statistics at import: 1.4 to 2.3 s of every service start
    on this 2-core machine, for interfaces the service never calls. Those packages stay
    importable afterwards; only LightGBM and lleaves, in this process, go without them.
    """
    if "lightgbm" in sys.modules:
        return
    hidden = [name for name in MODEL_LIBRARY_BRIDGES if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # makes `import name` fail
    try:
        importlib.import_module("lightgbm")
        with contextlib.suppress(ImportError):  # lleaves is the `fast` extra's
            importlib.import_module("lleaves")
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


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
    """An ingest observer: collects the young generations (0 and 1) every `every_events`
    events, so that a pause walks at most what that many events left alive.

    Both at once: each object then is walked once on its way to the oldest generation. What is
    alive at a collection goes there, in flight or not; collecting the youngest alone in between
    would walk the long-lived twice and move nothing less (the objects in flight at the
    collection of both are the same).
    """

    def __init__(self, every_events: int = YOUNG_COLLECTION_EVENTS) -> None:
        if every_events < 1:
            raise ValueError("every_events must be at least 1")
        self.every_events = every_events
        self.collections = 0
        self._events = 0

    def observe(self, events: Sized) -> None:
        self._events += len(events)
        if self._events >= self.every_events:
            self._events = 0
            self.collections += 1
            gc.collect(1)


def young_collector() -> YoungCollector | None:
    """The pacer, in a process `tune_gc` tuned (`serve`); None elsewhere (tests, tools), whose
    collector keeps Python's defaults."""
    return YoungCollector() if _paced else None
