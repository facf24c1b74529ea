"""What `kvprefetch replay`, `kvprefetch events-from-trace` and `bench replay` do (sim/cli.py and
bench/cli.py parse)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sim.replay import ReplayResult, replay, write_events
from sim.scenario import Scenario, load_scenario
from sim.traces import TraceRequest, judged_from_seconds, load_trace

# The columns of the readable table, in order, with how to show them.
COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("policy", "policy", str),
    ("router", "router", str),
    ("hit_rate", "hit rate", lambda v: f"{v:.1%}"),
    ("byte_hit_rate", "byte hit rate", lambda v: f"{v:.1%}"),
    ("byte_hit_rate_unshared", "byte hit rate unshared", lambda v: f"{v:.1%}"),
    ("stall_seconds_total", "stall s", lambda v: f"{v:,.1f}"),
    ("stall_seconds_p50", "stall p50 s", lambda v: f"{v:.3f}"),
    ("stall_seconds_p99", "stall p99 s", lambda v: f"{v:.3f}"),
    ("ttft_seconds_p99", "TTFT p99 s", lambda v: f"{v:.3f}"),
    ("task_seconds_mean", "task mean s", lambda v: f"{v:,.1f}"),
    ("bytes_loaded_on_demand", "on-demand GB", lambda v: f"{v / 1e9:,.0f}"),
    ("bytes_prefetched", "prefetched GB", lambda v: f"{v / 1e9:,.0f}"),
    ("bytes_prefetched_unused", "unused GB", lambda v: f"{v / 1e9:,.0f}"),
    ("recompute_tokens", "recompute tok", lambda v: f"{v:,}"),
    ("gpu_wait_fraction", "GPU wait", lambda v: f"{v:.2%}"),
]

stderr = Console(stderr=True)


@contextmanager
def progress_bar(label: str, total: int, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    if not enabled:
        yield lambda n: None
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=stderr,
        transient=True,
    ) as progress:
        task = progress.add_task(label, total=total)
        yield lambda n: progress.advance(task, n)


def prepare(
    trace_path: Path, scenario_name: str, block_tokens: int | None
) -> tuple[list[TraceRequest], Scenario]:
    trace = load_trace(trace_path)
    scenario = load_scenario(scenario_name)
    if block_tokens is not None and block_tokens != scenario.block_tokens:
        scenario = scenario.model_copy(update={"block_tokens": block_tokens})
    return trace, scenario


def with_landing(scenario: Scenario, landing: str | None, chunk_tokens: int | None) -> Scenario:
    """The scenario with `kvprefetch replay --landing` and `--chunk-tokens` over its own landing
    rule and chunk size (None: the scenario's), validated."""
    update: dict[str, Any] = {}
    if landing is not None:
        update["landing"] = landing
    if chunk_tokens is not None:
        update["chunk_tokens"] = chunk_tokens
    if not update:
        return scenario
    return Scenario.model_validate({**scenario.model_dump(), **update})


def with_compute(scenario: Scenario, compute: str | None) -> Scenario:
    """The scenario with `kvprefetch replay --compute` over its own (sim/compute.py)."""
    if compute is None:
        return scenario
    if compute not in ("independent", "shared"):
        raise ValueError(f"{compute!r}: independent or shared")
    return scenario.model_copy(update={"compute": compute})


def with_arrivals(scenario: Scenario, open_loop: bool) -> Scenario:
    """The scenario with `kvprefetch replay --open-loop`: every request at its recorded time."""
    return scenario.model_copy(update={"arrivals": "open"}) if open_loop else scenario


def run_replays(
    trace: Sequence[TraceRequest],
    scenario: Scenario,
    policies: Sequence[str],
    router: str,
    *,
    trace_name: str,
    model_dir: str | None = None,
    measure_from_seconds: float = 0.0,
    show_progress: bool = True,
    via: str | None = None,
    speed: float | None = None,
    lru_guard: bool = True,
) -> list[ReplayResult]:
    """Each policy in turn; with `via`, the engine is the kvprefetch service at that URL (`speed`:
    its events paced at that many times the trace's pace, stamped with wall-clock times).
    `lru_guard`: whether the in-process engine runs the LRU guard (app/decide/guard.py)."""
    from sim.remote import replay_via

    results = []
    for policy in policies:
        with progress_bar(f"{policy:>10} / {router}", len(trace), show_progress) as advance:
            if via is not None:
                result = replay_via(
                    via,
                    trace,
                    scenario,
                    policy=policy,
                    router=router,
                    model_dir=model_dir,
                    measure_from_seconds=measure_from_seconds,
                    progress=advance,
                    speed=speed,
                )
            else:
                result = replay(
                    trace,
                    scenario,
                    policy=policy,
                    router=router,
                    model_dir=model_dir,
                    measure_from_seconds=measure_from_seconds,
                    progress=advance,
                    planner_options={"lru_guard": lru_guard},
                )
        result.summary["trace"] = trace_name
        results.append(result)
    return results


def render_table(summaries: Sequence[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for _, header, _ in COLUMNS:
        # Folded, not cut with an ellipsis, where the terminal is narrower than the table.
        table.add_column(
            header,
            justify="left" if header in ("policy", "router") else "right",
            overflow="fold",
        )
    for s in summaries:
        table.add_row(*(fmt(s[key]) for key, _, fmt in COLUMNS))
    return table


def markdown_table(summaries: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| " + " | ".join(h for _, h, _ in COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    for s in summaries:
        lines.append("| " + " | ".join(fmt(s[key]) for key, _, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def print_results(results: Sequence[ReplayResult], as_json: bool, compare: bool) -> None:
    summaries = [r.summary for r in results]
    if as_json:
        doc: dict[str, Any] = summaries[0] if not compare else {"compare": summaries}
        sys.stdout.write(json.dumps(doc) + "\n")
        return
    first = summaries[0]
    title = (
        f"{first['trace']}: {first['requests']:,} requests, {first['sessions']:,} sessions, "
        f"{first['reuse_requests']:,} reuse; scenario {first['scenario']}"
    )
    if not sys.stdout.isatty():
        # Piped or captured: rich would fit the table to 80 columns and cut every cell short.
        sys.stdout.write(f"{title}\n\n{markdown_table(summaries)}\n")
        return
    Console().print(render_table(summaries, title))


def trace_cut(
    trace: Sequence[TraceRequest], until_seconds: float | None, fraction: float | None
) -> float | None:
    """Where a time split cuts `trace` (its requests before it are kept): at `until_seconds` of
    trace time, or after the first `fraction` of its time span (sim.traces.judged_from_seconds,
    where `replay --measure-from` and training/evaluate.py start judging); None: no cut."""
    if until_seconds is not None and fraction is not None:
        raise ValueError("give --until or --fraction, not both")
    if fraction is not None:
        if not 0 < fraction <= 1:
            raise ValueError(f"--fraction {fraction:g}: a share of the time span, in (0, 1]")
        return judged_from_seconds(trace, fraction) if fraction < 1 else None
    return until_seconds


def events_from_trace(
    trace_path: Path,
    out: Path,
    scenario_name: str,
    router: str,
    policy: str,
    block_tokens: int | None,
    cut_seconds: float | None = None,
) -> int:
    """Write the event log that routers and engines would have posted while the trace ran
    (`cut_seconds`: only its requests arriving before that trace time: trace_cut)."""
    trace, scenario = prepare(trace_path, scenario_name, block_tokens)
    if cut_seconds is not None:
        trace = [r for r in trace if r.arrival_seconds < cut_seconds]
        if not trace:
            raise ValueError(f"no request of the trace arrives before {cut_seconds:g} s")
    with progress_bar("events", len(trace)) as advance:
        result = replay(
            trace, scenario, policy=policy, router=router, keep_events=True, progress=advance
        )
    return write_events(result, out)
