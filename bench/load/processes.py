"""The bench's server processes, and what the OS says about them (RSS, CPU, load)."""

from __future__ import annotations

import os
from pathlib import Path

from bench._util import BenchError, ServerProcess

__all__ = ["BenchError", "Proc", "cpu_pressure", "cpu_seconds", "load_average", "rss"]


class Proc(ServerProcess):
    """A server process of this bench: its failures are BenchErrors."""

    error = BenchError


def rss(pid: int) -> int:
    import psutil

    p = psutil.Process(pid)
    total = p.memory_info().rss
    for c in p.children(recursive=True):
        try:
            total += c.memory_info().rss
        except psutil.Error:
            pass
    return int(total)


def cpu_seconds(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def cpu_pressure() -> float | None:
    """The share of the last 60 s some runnable task waited for a CPU (Linux PSI), in %."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(dict(kv.split("=") for kv in line.split()[1:])["avg60"])
    except (OSError, KeyError, ValueError, IndexError):
        return None


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None
