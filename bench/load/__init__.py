"""`kvprefetch bench load`: sustained event batches and route hints from this process against
the real service, with its throughput, latency, errors and RSS against a bound.

The service runs as its own process (`python -m kvprefetch_cli serve`, one uvicorn worker, a
temp data dir, fsync on, the memory store unless `store="redis"`, scoring and planning loops at
their defaults, session retention scaled to the bench's pace); this process is the client.

- `traffic`: the routers' conversations and their instances' HBM, as events;
- `client`: the closed-loop connections and what they logged;
- `calibrate`: what each unit of state costs, measured in fresh processes;
- `ceiling`: the bare FastAPI baseline and its phase;
- `processes`, `probes`: the server processes, and what is read from them;
- `report`: the series, the memory bound, the JSON;
- `options`: `LoadOptions`, a run's settings and their defaults;
- `driver`: `run(options)`, the phases in order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.load.driver import run
    from bench.load.options import LoadOptions
    from bench.load.processes import BenchError

__all__ = ["BenchError", "LoadOptions", "run"]


def __getattr__(name: str) -> Any:
    # Imported on first use, not with the package: the child processes run submodules
    # (`python -m bench.load.calibrate`, `python -m bench.load.ceiling`), and a submodule
    # imported by its package before runpy executes it is imported twice (and warned about).
    if name == "run":
        from bench.load.driver import run

        return run
    if name == "BenchError":
        from bench.load.processes import BenchError

        return BenchError
    if name == "LoadOptions":
        from bench.load.options import LoadOptions

        return LoadOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
