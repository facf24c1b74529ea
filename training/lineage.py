"""What a model card says of where the model came from: each event log's path and SHA-256, the
span of event time the logs cover, the rows of each horizon, the command and the code version.

A card is read by people and tools alike, so these are plain JSON: seconds as the logs stamp
them (event time), hashes as hex.
"""

from __future__ import annotations

import hashlib
import shlex
import subprocess
import sys
from collections.abc import Iterable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pandas as pd

from app.ingest.eventlog import list_segments

# What builds a model: the code whose changes since the commit make a card's commit not enough.
CODE_PATHS = ("app", "sim", "training", "client", "pyproject.toml", "setup.py")
# Bytes read at a time while hashing: a log may be gigabytes.
HASH_CHUNK_BYTES = 1 << 20


def file_sha256(path: Path, *also: Any) -> str:
    """The file's SHA-256, read in chunks; each of `also` (hashlib objects) is fed the same bytes
    (a log directory's digest of all its segments)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(HASH_CHUNK_BYTES), b""):
            digest.update(chunk)
            for other in also:
                other.update(chunk)
    return digest.hexdigest()


def log_record(path: Path, events: int, first_ts: float, last_ts: float) -> dict[str, Any]:
    """One log as the card names it: its path, its content's SHA-256 (a log directory's: of its
    segments' bytes in order, each segment also listed), how many events (each id once), and the
    event time of its first and last."""
    record: dict[str, Any] = {"path": str(path.resolve())}
    if path.is_dir():
        digest = hashlib.sha256()
        segments = []
        for _, segment in list_segments(path):
            segments.append({"path": segment.name, "sha256": file_sha256(segment, digest)})
        record["sha256"] = digest.hexdigest()
        record["segments"] = segments
    else:
        record["sha256"] = file_sha256(path)
    record["events"] = events
    record["first_event_ts"] = first_ts
    record["last_event_ts"] = last_ts
    return record


def data_span(records: Iterable[dict[str, Any]]) -> dict[str, float | None]:
    """The first and last event time over the logs (None where none is known)."""
    firsts = [r["first_event_ts"] for r in records if r.get("first_event_ts") is not None]
    lasts = [r["last_event_ts"] for r in records if r.get("last_event_ts") is not None]
    return {
        "first_event_ts": min(firsts) if firsts else None,
        "last_event_ts": max(lasts) if lasts else None,
    }


def rows_per_horizon(train_df: pd.DataFrame, valid_df: pd.DataFrame) -> dict[str, dict[str, int]]:
    """Rows of each horizon in the data, on each side of the split (0 where a side has none)."""
    train_counts = train_df.groupby("horizon_seconds").size()
    valid_counts = valid_df.groupby("horizon_seconds").size()
    horizons = sorted({*train_counts.index, *valid_counts.index})
    return {
        _horizon_key(h): {
            "train": int(train_counts.get(h, 0)),
            "valid": int(valid_counts.get(h, 0)),
        }
        for h in horizons
    }


def _horizon_key(h: float) -> str:
    # As the card's per-horizon metrics name them (training.train.evaluate_rows).
    return str(int(h))


def git_commit(where: Path) -> str | None:
    """The commit checked out where this code lies; None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=where
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def git_dirty(where: Path) -> bool | None:
    """Whether the code's tracked files (CODE_PATHS) differ from the commit: the commit alone
    would not rebuild what ran. Models and docs are left out (a rebuilt model changes its own
    files). None outside a git checkout."""
    # From the checkout's top, whatever `where` is: relative to training/, "app" named nothing
    # and a changed app/ read clean.
    paths = [f":(top){p}" for p in CODE_PATHS]
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", *paths],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=where,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def code_version() -> dict[str, str | bool | None]:
    """The git commit (when the code runs from a checkout), whether the checkout had changes
    beyond it, and the installed package version."""
    try:
        package: str | None = version("kvprefetch")
    except PackageNotFoundError:
        package = None
    here = Path(__file__).resolve().parent
    return {"git_commit": git_commit(here), "git_dirty": git_dirty(here), "kvprefetch": package}


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that ran, as a shell would take it (default: this process's arguments)."""
    return shlex.join(list(sys.argv if argv is None else argv))
