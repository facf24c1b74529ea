"""The app each process of `kvprefetch serve --workers N` builds (uvicorn calls it as a factory).

Each worker is a whole service of its own (store client, scheduler, loops) sharing the Redis
store, so it needs what a replica needs alone: its own event log (one writer per directory) and
its own log checkpoint. A worker takes the first free slot k (an exclusive lock on
`<log dir>/worker-<k>.lock`, held for its life) and logs to `<log dir>/worker-<k>` as replica
`<replica id>-worker-<k>`. A worker uvicorn restarts takes the slot its predecessor left, and
with it that log's tail to replay.
"""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import IO

from fastapi import FastAPI

from app.api.main import create_app
from app.core.config import Settings
from app.core.errors import ConfigError
from app.core.runtime import import_model_libraries_bare, tune_gc

MAX_WORKERS = 256


def claim_worker_slot(directory: Path) -> tuple[int, IO[str]]:
    """The first slot no live process holds, and its locked file (the lock goes with the
    process)."""
    directory.mkdir(parents=True, exist_ok=True)
    for k in range(MAX_WORKERS):
        # Held open for the process's life: the lock goes when the process does.
        f = open(directory / f"worker-{k}.lock", "a")  # noqa: SIM115
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            continue
        return k, f
    raise ConfigError(f"{MAX_WORKERS} workers already hold slots in {directory}")


def create_worker_app() -> FastAPI:
    import_model_libraries_bare()
    settings = Settings()  # `serve` put its options in the environment
    slot, lock = claim_worker_slot(settings.event_log_dir)
    settings = settings.model_copy(
        update={
            "log_dir": settings.event_log_dir / f"worker-{slot}",
            "replica_id": f"{settings.replica_id}-worker-{slot}",
        }
    )
    tune_gc()
    app = create_app(settings)
    app.state.worker_slot_lock = lock
    return app
