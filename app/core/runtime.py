"""Process-level tuning for a long-running service."""

from __future__ import annotations

import gc


def tune_gc() -> None:
    """Collect young objects far less often.

    Ingestion allocates many short-lived objects and the live state holds millions of long-lived
    ones that form no reference cycles, so the default thresholds (700, 10, 10) run full
    collections that free nothing: 17% of the server's busy time under load (bench/README.md).
    """
    gc.set_threshold(100_000, 50, 1000)
    gc.freeze()  # what exists at startup is never garbage
