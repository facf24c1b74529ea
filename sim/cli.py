"""The simulator's commands: `kvprefetch replay`, `agent-trace`, `targets`,
`events-from-trace` and `trace import` (kvprefetch_cli/ adds them to the root command). Each
imports the simulator when it runs, after checking the 'sim' extra (app/core/extras.py); what they
do is in sim/commands.py and the modules it names."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from app.commands import command_line, needs
from app.core.errors import KvpError

SIM = needs("sim")

# The top-level commands, merged into the root (kvprefetch_cli adds them without a group name).
commands = typer.Typer()
trace = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="Work with replay traces (the agent trace format: sim/traces.py).",
)


@commands.command(cls=SIM)
def replay(
    ctx: typer.Context,
    trace: Annotated[Path, typer.Option(help="A Mooncake-format trace (JSON Lines).")],
    policy: Annotated[
        str,
        typer.Option(
            help="none, lookahead, belady, oracle, heuristic, learned, scheduled, clairvoyant, "
            "signal, or an agent anchor: ttl (ttl-N: N seconds), continuum, tokencake; with "
            "--via and --speed also service: the service's own orders drive the simulated "
            "cluster."
        ),
    ] = "none",
    scenario: Annotated[
        str, typer.Option(help="A shipped scenario name or a TOML file.")
    ] = "default",
    router: Annotated[
        str, typer.Option(help="sticky, least-loaded, kv-aware or hinted.")
    ] = "sticky",
    block_tokens: Annotated[
        int | None, typer.Option(help="Tokens per trace block (default: the scenario's).")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="Model directory for the learned policy.")
    ] = None,
    compare: Annotated[
        str | None, typer.Option(help="Several policies, comma-separated, side by side.")
    ] = None,
    measure_from: Annotated[
        float, typer.Option(help="Count only requests arriving after this many seconds.")
    ] = 0.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    report: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="Also write DIR/report.md and plots of hit rate over time and stalls.",
        ),
    ] = None,
    via: Annotated[
        str | None,
        typer.Option(
            metavar="URL", help="Use a running kvprefetch service as the engine, over HTTP."
        ),
    ] = None,
    speed: Annotated[
        float | None,
        typer.Option(
            metavar="X",
            help="With --via: post events at X times the trace's pace, stamped with wall-clock "
            "times, so the service sees live traffic (default: as fast as possible, trace times).",
        ),
    ] = None,
    signals: Annotated[
        str | None,
        typer.Option(
            metavar="NAME=V,...",
            help="Early signals before returning turns, over the scenario's [signals]: coverage, "
            "lead_median (seconds), lead_sigma, false_alarms (per true signal), tools (share of "
            "an agent trace's sessions posting tool_started/tool_finished), seed; e.g. "
            "coverage=0.5,lead_median=5,false_alarms=1 or tools=0.8.",
        ),
    ] = None,
    lru_guard: Annotated[
        bool,
        typer.Option(
            "--lru-guard/--no-lru-guard",
            help="Run the engine with the LRU guard (KVP_LRU_GUARD, on by default): advice that "
            "loses to plain LRU on an instance is turned off there. With --via, the service's "
            "own setting.",
        ),
    ] = True,
    landing: Annotated[
        str | None,
        typer.Option(
            metavar="RULE",
            help="How a prefetch becomes usable: chunked (chunk by chunk as it lands, head "
            "first) or whole (only once all of it has landed); default: the scenario's "
            "(chunked in the shipped ones).",
        ),
    ] = None,
    chunk_tokens: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Tokens per landing chunk, rounded down to whole blocks, at least one "
            "(default: the scenario's, 256 as LMCache's).",
        ),
    ] = None,
    compute: Annotated[
        str | None,
        typer.Option(
            metavar="MODEL",
            help="How an instance's running requests share its GPU: independent (each as if "
            "alone) or shared (chunked-prefill steps of the scenario's step_tokens, so a long "
            "prefill or recompute slows the others); default: the scenario's (independent in the "
            "shipped ones).",
        ),
    ] = None,
    open_loop: Annotated[
        bool,
        typer.Option(
            "--open-loop",
            help="Every request at its recorded timestamp, even one that carries after_seconds "
            "(an agent trace's call, by default closed-loop: that long after its session's "
            "previous request finished in the replay).",
        ),
    ] = False,
) -> None:
    """Replay a trace through the cluster model and the engine; report hit rates and stalls."""
    from sim.commands import (
        prepare,
        print_results,
        run_replays,
        with_arrivals,
        with_compute,
        with_landing,
    )
    from sim.signals import SignalSettings, parse_signal_overrides, with_signals

    if speed is not None and via is None:
        raise typer.BadParameter(
            "paces a replay over HTTP: use it with --via URL", param_hint="'--speed'"
        )
    if speed is not None and not 0 < speed < float("inf"):
        raise typer.BadParameter(
            f"{speed:g}: a positive number of times the trace's pace", param_hint="'--speed'"
        )
    overrides = None
    if signals is not None:
        try:
            overrides = parse_signal_overrides(signals)
            with_signals(SignalSettings(), overrides)  # its values checked before any loading
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="'--signals'") from None
    if landing is not None and landing not in ("chunked", "whole"):
        raise typer.BadParameter(f"{landing!r}: chunked or whole", param_hint="'--landing'")
    try:
        trace_requests, scen = prepare(trace, scenario, block_tokens)
        scen = with_arrivals(with_landing(scen, landing, chunk_tokens), open_loop)
        scen = with_compute(scen, compute)
        if overrides is not None:
            try:
                scen = scen.model_copy(update={"signals": with_signals(scen.signals, overrides)})
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint="'--signals'") from None
        policies = [p.strip() for p in compare.split(",")] if compare else [policy]
        results = run_replays(
            trace_requests,
            scen,
            policies,
            router,
            trace_name=trace.name,
            model_dir=model,
            measure_from_seconds=measure_from,
            via=via,
            speed=speed,
            lru_guard=lru_guard,
        )
    except (KvpError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from None
    print_results(results, as_json, compare=bool(compare))
    if report is not None:
        from sim.report import write_report

        write_report(
            results,
            report,
            trace_path=trace,
            command=command_line(ctx),
            measure_from_seconds=measure_from,
        )
        typer.echo(f"wrote {report / 'report.md'} and its plots", err=True)


@commands.command("agent-trace", cls=SIM)
def agent_trace_cmd(
    out: Annotated[
        Path,
        typer.Option(help="Where to write the trace (agent trace format: Mooncake JSON Lines)."),
    ],
    tasks: Annotated[int, typer.Option(min=1, help="Agent tasks.")] = 600,
    seconds: Annotated[
        float, typer.Option(min=1.0, help="Over how long the tasks arrive.")
    ] = 1200.0,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
) -> None:
    """Write an agent-like trace: tool loops seconds apart, a few human turns, shared system
    prompts and tool schemas, each request with its session, and after its first the tool it
    waited on and for how long (an assumed workload: sim/workloads.py)."""
    from sim.workloads import AgentWorkload, agent_trace, write_trace

    n = write_trace(agent_trace(AgentWorkload(tasks=tasks, seconds=seconds, seed=seed)), out)
    typer.echo(f"wrote {n} requests to {out}", err=True)


@trace.command("import", cls=SIM)
def trace_import(
    source_path: Annotated[Path, typer.Argument(metavar="IN", help="The trace to convert.")],
    source: Annotated[
        str, typer.Option("--from", help="Its format: tracelab (uw-syfi/TraceLab round traces).")
    ],
    out: Annotated[Path, typer.Option(help="Where to write the agent trace.")],
    block_tokens: Annotated[
        int, typer.Option(min=1, help="Tokens per block: the replay scenario's.")
    ] = 512,
    max_idle_seconds: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Cut a stretch when no session is in progress to this (inf: keep recorded times).",
        ),
    ] = 60.0,
    session_rate: Annotated[
        float | None,
        typer.Option(
            help="Start sessions as a Poisson process of this many a second (seeded by --seed), "
            "in their recorded order, instead of at their recorded times.",
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Random seed for --session-rate.")] = 0,
) -> None:
    """Convert a trace of real agent sessions to the agent trace format (one request a round, its
    session, the tool it waited on and for how long; block ids prefix-chained per session)."""
    from sim.tracelab import ImportOptions, import_tracelab
    from sim.workloads import write_trace

    if source != "tracelab":
        raise typer.BadParameter(
            f"unknown format {source!r}; choose from tracelab", param_hint="--from"
        )
    options = ImportOptions(
        block_tokens=block_tokens,
        max_idle_seconds=max_idle_seconds,
        session_rate=session_rate,
        seed=seed,
    )
    try:
        trace, summary = import_tracelab(source_path, options)
    except KvpError as exc:
        raise typer.BadParameter(str(exc), param_hint="IN") from None
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    write_trace(trace, out)
    skipped = {
        "without a timestamp": summary.skipped_untimed,
        "without tokens": summary.skipped_no_tokens,
        "duplicate": summary.skipped_duplicate,
    }
    said = ", ".join(f"{n} {why}" for why, n in skipped.items() if n)
    typer.echo(
        f"wrote {summary.requests} requests in {summary.sessions} sessions to {out} "
        f"from {summary.rounds} rounds" + (f" (skipped: {said})" if said else ""),
        err=True,
    )


@commands.command(cls=SIM)
def targets(
    traces: Annotated[Path, typer.Option(help="Where the shared traces are.")] = Path(
        "../shared/traces"
    ),
    model: Annotated[
        str | None, typer.Option(help="Model directory for `learned` (default: the bundled one).")
    ] = None,
    jobs: Annotated[int, typer.Option(min=1, help="Replays run in parallel.")] = 2,
    seeds: Annotated[
        int,
        typer.Option(
            min=1,
            help="Signal seeds (0..N-1) each policy that reads signals is replayed under; "
            "its row is the mean ± standard deviation over them.",
        ),
    ] = 4,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Replay issue 14's targets (signals, busy, route hints, an agent-like trace; judged on
    each trace's last 30%, under signals on the mean over --seeds signal seeds) and say which
    hold: a markdown table (sim/targets.py)."""
    from sim.targets import as_json as to_json
    from sim.targets import markdown, run

    results, verdicts = run(traces, model, jobs, seeds=tuple(range(seeds)))
    typer.echo(to_json(results, verdicts, model) if as_json else markdown(results, verdicts))


@commands.command("events-from-trace", cls=SIM)
def events_from_trace(
    trace: Annotated[Path, typer.Option(help="A Mooncake-format trace (JSON Lines).")],
    out: Annotated[Path, typer.Option(help="Where to write the event log (JSON Lines).")],
    scenario: Annotated[
        str, typer.Option(help="A shipped scenario name or a TOML file.")
    ] = "default",
    router: Annotated[
        str, typer.Option(help="sticky, least-loaded, kv-aware or hinted.")
    ] = "sticky",
    policy: Annotated[
        str, typer.Option(help="The policy the cluster ran under while the events happened.")
    ] = "none",
    block_tokens: Annotated[int | None, typer.Option(help="Tokens per trace block.")] = None,
    until: Annotated[
        float | None,
        typer.Option(
            metavar="SECONDS",
            help="Only the trace's requests arriving before this trace time (a time split: "
            "judge on the rest with `replay --measure-from SECONDS`).",
        ),
    ] = None,
    fraction: Annotated[
        float | None,
        typer.Option(
            metavar="F",
            help="Only the first F of the trace's time span (0 < F <= 1); the cut, in trace "
            "seconds, is printed for `replay --measure-from`.",
        ),
    ] = None,
) -> None:
    """Write the event log routers and engines would have posted while the trace ran."""
    from sim.commands import events_from_trace as run
    from sim.commands import prepare, trace_cut

    try:
        cut = None
        if until is not None or fraction is not None:
            requests, _ = prepare(trace, scenario, block_tokens)
            cut = trace_cut(requests, until, fraction)
        n = run(trace, out, scenario, router, policy, block_tokens, cut)
    except (KvpError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from None
    if cut is None:
        typer.echo(f"wrote {n} events to {out}", err=True)
    else:
        # The cut, printed to reuse as `replay --measure-from`: the log holds no trace time.
        typer.echo(
            f"wrote {n} events to {out}: the trace's requests before {cut:.10g} s "
            f"(judge the rest with --measure-from {cut:.10g})",
            err=True,
        )
