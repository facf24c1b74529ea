"""prometheus-client's multiprocess mode, as `kvprefetch serve --workers N` prepares it.

Apart from app/observe/metrics.py so that the supervisor process, which serves nothing, does not
import the engine (or prometheus-client) just to prepare the directory.
"""

from __future__ import annotations

import os
from pathlib import Path


def multiprocess_dir() -> Path | None:
    """PROMETHEUS_MULTIPROC_DIR, as prometheus-client reads it: once, when its values module is
    first imported, so it must be set before that."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get(
        "prometheus_multiproc_dir"  # noqa: SIM112 - the old name prometheus-client still reads
    )
    return Path(path) if path else None


def prepare_multiprocess_dir(path: Path) -> None:
    """Create the directory and remove the value files of an earlier run, whose counters would
    otherwise be added to this run's (and whose dead workers' gauges would linger). Run once
    before the workers start, never while they run."""
    path.mkdir(parents=True, exist_ok=True)
    for f in path.glob("*.db"):
        f.unlink(missing_ok=True)
