"""`kvprefetch replay --report DIR`: a markdown summary and two plots of one or more replays.

Everything is computed from ReplayResult.requests. The computations (`byte_hit_rate_series`,
`ecdf`) are plain functions; matplotlib is imported only to draw, through its object-oriented
API (a Figure saved to PNG with the Agg renderer, no pyplot, no display).

- byte_hit_rate_over_time.png: per window of request arrival (60 s by default), the reused blocks
  that were in HBM when their request was admitted over all reused blocks, of reuse requests;
- stall_distribution.png: the ECDF of per-request stall seconds of reuse requests, on a symlog x
  axis (most stalls are 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from sim.cluster import SimRequest
from sim.commands import markdown_table
from sim.metrics import SHARED_BLOCK_SHARE
from sim.replay import ReplayResult

REPORT_MD = "report.md"
HIT_RATE_PNG = "byte_hit_rate_over_time.png"
STALL_PNG = "stall_distribution.png"
STALL_LINTHRESH = 0.01  # seconds: the symlog x axis is linear below 10 ms, logarithmic above


def measured_reuse(
    requests: Sequence[SimRequest], measure_from_seconds: float = 0.0
) -> list[SimRequest]:
    """The requests the summary counts as reuse requests (sim.replay.summarize)."""
    return [r for r in requests if r.arrival >= measure_from_seconds and r.reused_blocks]


def byte_hit_rate_series(
    requests: Sequence[SimRequest], window_seconds: float = 60.0, measure_from_seconds: float = 0.0
) -> list[tuple[float, float]]:
    """(window start in seconds, byte hit rate) per window of arrival time that holds reuse
    requests.

    A request belongs to window floor(arrival / window_seconds); a window's rate is
    sum(hit_blocks) / sum(reused_blocks) over its reuse requests. Windows without any are left out.
    """
    if window_seconds <= 0:
        raise ValueError("window_seconds must be positive")
    hits: dict[int, int] = {}
    reused: dict[int, int] = {}
    for r in measured_reuse(requests, measure_from_seconds):
        w = math.floor(r.arrival / window_seconds)
        hits[w] = hits.get(w, 0) + r.hit_blocks
        reused[w] = reused.get(w, 0) + r.reused_blocks
    return [(w * window_seconds, hits[w] / reused[w]) for w in sorted(reused)]


def ecdf(values: Sequence[float]) -> list[tuple[float, float]]:
    """(x, fraction of values <= x) for each distinct value, ascending."""
    xs = sorted(values)
    n = len(xs)
    points: list[tuple[float, float]] = []
    for i, x in enumerate(xs, start=1):
        if points and points[-1][0] == x:
            points[-1] = (x, i / n)
        else:
            points.append((x, i / n))
    return points


def stall_ecdf(
    requests: Sequence[SimRequest], measure_from_seconds: float = 0.0
) -> list[tuple[float, float]]:
    return ecdf([r.stall_seconds for r in measured_reuse(requests, measure_from_seconds)])


# -- drawing ----------------------------------------------------------------------------------

# One look per policy, the same in both plots. Policies that behave alike draw identical lines
# (none and lookahead often do), so the styles differ in dash and width, not only in colour: a
# later, thinner, dashed line over an earlier, wider one leaves both visible.
STYLES = [("-", 3.0), ("--", 2.2), ("-.", 1.8), (":", 2.2), ("-", 1.2), ("--", 1.2)]


def _style(i: int) -> dict[str, object]:
    linestyle, width = STYLES[i % len(STYLES)]
    return {"color": f"C{i % 10}", "linestyle": linestyle, "linewidth": width}


def _figure():
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5), dpi=110, layout="constrained")
    return fig, fig.add_subplot()


def plot_byte_hit_rate(
    results: Sequence[ReplayResult],
    path: Path,
    window_seconds: float = 60.0,
    measure_from_seconds: float = 0.0,
) -> None:
    plot_byte_hit_rate_series(
        [
            (
                res.summary["policy"],
                byte_hit_rate_series(res.requests, window_seconds, measure_from_seconds),
            )
            for res in results
        ],
        path,
        window_seconds,
    )


def plot_byte_hit_rate_series(
    series_by_label: Sequence[tuple[str, Sequence[tuple[float, float]]]],
    path: Path,
    window_seconds: float = 60.0,
    legend_title: str = "policy",
) -> None:
    """The byte hit rate over time of each (label, byte_hit_rate_series) on one plot: the
    replays' (plot_byte_hit_rate), or several models' and baselines' (training/compare.py)."""
    from matplotlib.ticker import PercentFormatter

    fig, ax = _figure()
    for i, (label, series) in enumerate(series_by_label):
        ax.plot(
            [(t + window_seconds / 2) / 60 for t, _ in series],
            [rate for _, rate in series],
            marker=".",
            label=label,
            **_style(i),
        )
    ax.set_xlabel(
        f"request arrival (minutes since trace start; one point per {window_seconds:g} s window)"
    )
    ax.set_ylabel("byte hit rate (reused blocks in HBM at admission)")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Byte hit rate of reuse requests over time")
    ax.grid(alpha=0.3)
    ax.legend(title=legend_title)
    fig.savefig(path)


def plot_stall_distribution(
    results: Sequence[ReplayResult], path: Path, measure_from_seconds: float = 0.0
) -> None:
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    fig, ax = _figure()
    curves = [
        (res.summary["policy"], stall_ecdf(res.requests, measure_from_seconds)) for res in results
    ]
    right = max((pts[-1][0] for _, pts in curves if pts), default=1.0)
    bottom = 1.0
    for i, (policy, pts) in enumerate(curves):
        if not pts:
            continue
        no_stall = pts[0][1] if pts[0][0] == 0 else 0.0
        bottom = min(bottom, no_stall)
        # Run on to the largest stall of any policy, so every line spans the plot.
        xs = [0.0] + [x for x, _ in pts] + [right]
        ys = [0.0] + [y for _, y in pts] + [1.0]
        ax.step(xs, ys, where="post", label=f"{policy} ({no_stall:.1%} with no stall)", **_style(i))
    ax.set_xscale("symlog", linthresh=STALL_LINTHRESH)
    ax.set_xlim(left=0.0)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_xlabel(
        f"stall per request (seconds; linear below {STALL_LINTHRESH:g} s, logarithmic above)"
    )
    # Most requests never stall: start the y axis a little below the lowest share that did not,
    # and say so, so the tails get the room.
    floor = max(0.0, math.floor(bottom * 20) / 20 - 0.05)
    ax.set_ylim(floor, 1.005)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_ylabel(
        "share of reuse requests stalling at most x"
        + (f" (axis from {floor:.0%})" if floor else "")
    )
    ax.set_title("Stall distribution (ECDF) of reuse requests")
    ax.grid(alpha=0.3)
    ax.legend(title="policy", loc="lower right")
    fig.savefig(path)


# -- the report -------------------------------------------------------------------------------


def write_report(
    results: Sequence[ReplayResult],
    out_dir: Path,
    *,
    trace_path: Path,
    command: str,
    window_seconds: float = 60.0,
    measure_from_seconds: float = 0.0,
) -> list[Path]:
    """Write report.md and the two PNGs into out_dir; returns their paths."""
    if not results:
        raise ValueError("no replay results to report")
    out_dir.mkdir(parents=True, exist_ok=True)
    first = results[0].summary
    measured = (
        f", counting requests that arrived at or after {measure_from_seconds:g} s"
        if measure_from_seconds
        else ""
    )
    lines = [
        f"# Replay of {first['trace']}",
        "",
        f"- trace: `{trace_path.resolve()}`",
        f"- scenario: {first['scenario']}",
        f"- router: {first['router']}",
        f"- requests: {first['requests']:,} ({first['sessions']:,} sessions, "
        f"{first['reuse_requests']:,} reuse requests){measured}",
        f"- simulated seconds: {first['simulated_seconds']:,.0f}",
        f"- arrivals: {first.get('arrivals', 'open')} loop",
        f"- command: `{command}` (run in `{Path.cwd()}`)",
        f"- written: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M:%S')} UTC",
        "",
        markdown_table([r.summary for r in results]),
        "",
        "Hit rate: reuse requests whose every reused block was in HBM at admission; byte hit rate: "
        "reused blocks in HBM at admission (the longest prefix there, as an engine's prefix cache "
        "finds it) over all reused blocks; byte hit rate unshared: the same without the blocks "
        f"carried by more than {SHARED_BLOCK_SHARE:.0%} of the trace's requests "
        f"({first['shared_blocks']:,} here).",
        "",
        "## Latency",
        "",
        "| policy | TTFT p50 s | TTFT p90 s | TTFT p99 s | tasks | task mean s | task p90 s |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {s['policy']} | {s['ttft_seconds_p50']:.3f} | {s['ttft_seconds_p90']:.3f} | "
            f"{s['ttft_seconds_p99']:.3f} | {s['tasks']:,} | {s['task_seconds_mean']:,.1f} | "
            f"{s['task_seconds_p90']:,.1f} |"
            for s in (r.summary for r in results)
        ),
        "",
        "Time to first token (TTFT): a request's arrival to its first output token (queueing, "
        "waiting for room, loading or recomputing its reused blocks, prefill of the rest), over "
        "the requests counted. Task: a session's first arrival to its last finish (an agent's "
        "task, a chat's conversation), over the sessions that start in the counted window.",
        "",
        f"## Byte hit rate per {window_seconds:g} s of arrivals",
        "",
        f"![byte hit rate over time]({HIT_RATE_PNG})",
        "",
        "## Stall per reuse request",
        "",
        f"![stall distribution]({STALL_PNG})",
        "",
    ]
    paths = [out_dir / REPORT_MD, out_dir / HIT_RATE_PNG, out_dir / STALL_PNG]
    paths[0].write_text("\n".join(lines))
    plot_byte_hit_rate(results, paths[1], window_seconds, measure_from_seconds)
    plot_stall_distribution(results, paths[2], measure_from_seconds)
    return paths
