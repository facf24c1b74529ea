"""The `kvprefetch` command."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any

import typer

from app.core.config import Settings
from app.core.errors import KvpError

cli = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="Predictive KV-cache prefetching for LLM serving fleets.",
)
bench_cli = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="Benchmarks, each printing one JSON object with --json.",
)
cli.add_typer(bench_cli, name="bench")
connect_cli = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="Feed an engine's own event stream to a running service.",
)
cli.add_typer(connect_cli, name="connect")
log_cli = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="Work with the durable event log (JSON Lines segments).",
)
cli.add_typer(log_cli, name="log")
trace_cli = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="Work with replay traces (the agent trace format: sim/traces.py).",
)
cli.add_typer(trace_cli, name="trace")
registry_cli = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="MLflow's model registry, its aliases the service's slots (serving, shadow); needs the "
    "'mlflow' extra. The store: --mlflow-uri, else $MLFLOW_TRACKING_URI, else "
    "sqlite:///var/mlflow/mlflow.db.",
)
cli.add_typer(registry_cli, name="registry")


def _print_result(result: dict[str, Any], as_json: bool) -> None:
    """One JSON object on stdout with --json; otherwise the same, indented for people."""
    import json

    print(json.dumps(result) if as_json else json.dumps(result, indent=2), flush=True)


@bench_cli.command("ingest")
def bench_ingest(
    rounds: Annotated[
        int, typer.Option(min=1, help="Rounds; each posts to the service and the ceiling.")
    ] = 5,
    batches: Annotated[
        int | None,
        typer.Option(
            min=1, help="Batches per round and batch size (default: 100,000 events' worth)."
        ),
    ] = None,
    concurrency: Annotated[
        int, typer.Option(min=1, help="Client connections, one thread each.")
    ] = 3,
    fsync: Annotated[
        bool,
        typer.Option(
            "--fsync/--no-fsync",
            help="fsync the event log per batch (the service's default, KVP_LOG_FSYNC).",
        ),
    ] = True,
    data_dir: Annotated[
        Path | None,
        typer.Option(help="Where the temporary event log goes (default: the system's temp dir)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the generated traffic.")] = 0,
    store: Annotated[
        str,
        typer.Option(
            help="The service's store: memory, or redis (at KVP_REDIS_URL, under a prefix "
            "removed afterwards)."
        ),
    ] = "memory",
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """
    Events/s through POST /v1/events over HTTP (one uvicorn worker) against a bare FastAPI ceiling.
    """
    from bench._util import BenchError
    from bench.ingest import run

    try:
        result = run(
            rounds=rounds,
            batches=batches,
            concurrency=concurrency,
            fsync=fsync,
            data_dir=data_dir,
            seed=seed,
            store=store,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    except BenchError as exc:  # no Redis, or a server did not start or died: the message says
        typer.echo(f"kvprefetch bench ingest: {exc}", err=True)
        raise typer.Exit(1) from None
    _print_result(result, as_json)


@bench_cli.command("vllm-intake")
def bench_vllm_intake(
    rounds: Annotated[int, typer.Option(min=1, help="Rounds; each measures both paths.")] = 3,
    publishers: Annotated[int, typer.Option(min=1, help="vLLM publishers (ZMQ PUB).")] = 8,
    batches: Annotated[
        int, typer.Option(min=1, help="Batches per publisher per round (16 KV events each).")
    ] = 250,
    per_post: Annotated[int, typer.Option(min=1, help="vLLM batches per HTTP POST.")] = 32,
    concurrency: Annotated[int, typer.Option(min=1, help="HTTP client connections.")] = 3,
    data_dir: Annotated[
        Path | None,
        typer.Option(help="Where the temporary event logs go (default: the system's temp dir)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the generated events.")] = 0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """
    KV events/s from vLLM ZMQ publishers through the subscriber into the engine, beside HTTP.
    """
    from bench.vllm_intake import run

    _print_result(
        run(
            rounds=rounds,
            publishers=publishers,
            batches=batches,
            per_post=per_post,
            concurrency=concurrency,
            seed=seed,
            data_dir=data_dir,
        ),
        as_json,
    )


@bench_cli.command("memory")
def bench_memory(
    sessions: Annotated[
        int, typer.Option(min=1, help="Sessions loaded into the MemoryStore.")
    ] = 100_000,
    jobs: Annotated[
        int, typer.Option(min=1, help="Measurements run at once (each a fresh process).")
    ] = 2,
    seed: Annotated[int, typer.Option(help="Seed of the generated sessions.")] = 0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """
    Bytes per tracked session in the MemoryStore, excluding and including remembered event ids.
    """
    from bench.memory import run

    _print_result(run(sessions=sessions, jobs=jobs, seed=seed), as_json)


@bench_cli.command("replay")
def bench_replay(
    trace: Annotated[
        Path | None,
        typer.Option(
            help=(
                "A Mooncake-format trace "
                "(default: ../shared/traces/mooncake_conversation_first60.jsonl)."
            )
        ),
    ] = None,
    policy: Annotated[
        str,
        typer.Option(help="A policy, or all (every policy but learned), each in a fresh process."),
    ] = "none",
    router: Annotated[
        str, typer.Option(help="sticky, least-loaded, kv-aware or hinted.")
    ] = "sticky",
    scenario: Annotated[
        str, typer.Option(help="A shipped scenario name or a TOML file.")
    ] = "default",
    rounds: Annotated[
        int, typer.Option(min=1, help="Timed replays per policy (the median is reported).")
    ] = 3,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """Simulated requests per wall second, wall seconds and peak memory of a full trace replay."""
    from bench.replay import run

    try:
        result = run(trace=trace, policy=policy, router=router, scenario=scenario, rounds=rounds)
    except (KvpError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from None
    _print_result(result, as_json)


def _counts(text: str, option: str) -> tuple[int, ...]:
    """A comma-separated list of positive counts ('' for none)."""
    try:
        counts = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"{option}: {text!r} is not a list of counts") from None
    if any(n < 1 for n in counts):
        raise typer.BadParameter(f"{option}: counts must be positive")
    return counts


@bench_cli.command("predict")
def bench_predict(
    sessions: Annotated[int, typer.Option(min=1, help="How many live sessions to score.")] = 10_000,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds per figure (medians).")] = 7,
    model: Annotated[
        Path | None, typer.Option(help="Model directory (default: the bundled one).")
    ] = None,
    pass_sessions: Annotated[
        str,
        typer.Option(
            help="Live sessions of the service's own scoring pass, comma-separated ('' skips it)."
        ),
    ] = "10000,100000",
    redis_url: Annotated[
        str | None,
        typer.Option(help="Also time the pass over a RedisStore here (a key prefix of its own)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Scoring latency of the learned predictor beside the raw LightGBM Booster, and the
    service's scoring pass over every live session beside the table path."""
    from bench.predict import run

    sizes = _counts(pass_sessions, "--pass-sessions")
    result = run(
        sessions=sessions,
        rounds=rounds,
        model_dir=model,
        pass_sessions=sizes,
        redis_url=redis_url,
    )
    _print_result(result, as_json)


@bench_cli.command("mooncake")
def bench_mooncake(
    context_bytes: Annotated[int, typer.Option(min=1, help="The context's bytes.")] = 32 << 20,
    blocks: Annotated[int, typer.Option(min=1, help="Objects the context is stored as.")] = 1,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds (medians).")] = 7,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """The Mooncake agent's time to last byte for a context, beside a plain get of it."""
    from bench.mooncake import run

    _print_result(run(context_bytes=context_bytes, blocks=blocks, rounds=rounds), as_json)


@bench_cli.command("plan")
def bench_plan(
    sessions: Annotated[
        int, typer.Option(min=1, help="Sessions whose advice the scheduler holds.")
    ] = 100_000,
    instances: Annotated[int, typer.Option(min=1, help="Serving instances.")] = 16,
    ticks: Annotated[int, typer.Option(min=1, help="Ticks measured (p50, p99).")] = 200,
    page: Annotated[int, typer.Option(min=1, help="Sessions re-advised per tick.")] = 256,
    pass_sessions: Annotated[
        str,
        typer.Option(
            help="Live sessions of the service's own scoring pass, comma-separated ('' skips it)."
        ),
    ] = "10000,100000",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Planning time per tick of the scheduler, beside re-reading every session each tick, and
    the service's scoring pass and plan over every live session."""
    from bench.plan import run

    result = run(
        sessions=sessions,
        instances=instances,
        ticks=ticks,
        page=page,
        pass_sessions=_counts(pass_sessions, "--pass-sessions"),
    )
    _print_result(result, as_json)


@bench_cli.command("train-fleet")
def bench_train_fleet(
    events: Annotated[
        int, typer.Option(min=10_000, help="Events in the synthetic fleet log.")
    ] = 20_000_000,
    workers: Annotated[int, typer.Option(min=1, help="Dask workers (and build processes).")] = 2,
    max_rounds: Annotated[int, typer.Option(min=1, help="Most boosting rounds.")] = 300,
    work_dir: Annotated[
        Path | None, typer.Option(help="Where the fleet log goes (default: a temp dir).")
    ] = None,
    trace_requests: Annotated[
        int | None, typer.Option(min=50, help="Copy only each trace's first N requests.")
    ] = None,
    dask_only: Annotated[
        bool, typer.Option("--dask-only", help="Skip the single-process path (too big for it).")
    ] = False,
    reference_events: Annotated[
        int,
        typer.Option(
            min=0, help="Replay vs columnar build, rows compared, on this many events (0: skip)."
        ),
    ] = 200_000,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Dataset build, training time and peak RSS: one process beside Dask, on a fleet log."""
    from bench.train_fleet import run

    result = run(
        events=events,
        workers=workers,
        max_rounds=max_rounds,
        work_dir=work_dir,
        trace_requests=trace_requests,
        paths=("dask",) if dask_only else ("single", "dask"),
        reference_events=reference_events,
    )
    _print_result(result, as_json)


@bench_cli.command("load")
def bench_load(
    duration_seconds: Annotated[
        float, typer.Option(min=0.1, help="Measured seconds of sustained load.")
    ] = 120.0,
    warmup_seconds: Annotated[
        float, typer.Option(min=0, help="Load before the start RSS is taken.")
    ] = 10.0,
    sessions: Annotated[
        int, typer.Option(min=1, help="Live conversations (ended ones are replaced).")
    ] = 3000,
    instances: Annotated[
        int, typer.Option(min=1, help="Serving instances, split among the event connections.")
    ] = 16,
    hbm_blocks: Annotated[
        int, typer.Option(min=1, help="KV blocks an instance's HBM holds (LRU).")
    ] = 2000,
    batch_size: Annotated[int, typer.Option(min=1, help="Events per POST /v1/events.")] = 200,
    event_connections: Annotated[
        int, typer.Option(min=1, help="Routers posting batches, one connection each.")
    ] = 2,
    hint_connections: Annotated[
        int, typer.Option(min=0, help="Connections asking for route hints.")
    ] = 2,
    store: Annotated[
        str,
        typer.Option(
            help="memory, or redis (at KVP_REDIS_URL, under a prefix removed afterwards)."
        ),
    ] = "memory",
    fsync: Annotated[
        bool,
        typer.Option("--fsync/--no-fsync", help="fsync the event log per batch (the default)."),
    ] = True,
    dedupe_max_ids: Annotated[
        int | None, typer.Option(min=1, help="The service's KVP_DEDUPE_MAX_IDS (default: its own).")
    ] = None,
    # The bench's users answer in about a second, real ones in minutes: an hour of retention at a
    # human pace is about a minute at the bench's.
    session_retention_seconds: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="The service's KVP_SESSION_RETENTION_SECONDS, scaled to the bench's think times.",
        ),
    ] = 60.0,
    sample_seconds: Annotated[
        float, typer.Option(min=0.1, help="How often RSS and the store's counts are sampled.")
    ] = 5.0,
    ceiling_seconds: Annotated[
        float, typer.Option(min=0, help="Each of the two ceiling phases (0: none).")
    ] = 10.0,
    calibrate_sessions: Annotated[
        int,
        typer.Option(
            min=0,
            help="Sessions ingested to price each unit of state the bound counts (0: no bound).",
        ),
    ] = 10_000,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="KVP_BENCH_TOKEN",
            help="Sent as Authorization: Bearer (default: KVP_BENCH_TOKEN).",
        ),
    ] = None,
    service_env: Annotated[
        list[str] | None,
        typer.Option(
            metavar="KVP_X=V",
            help="A setting for the service process (repeat), e.g. KVP_INGEST_TOKEN=...",
        ),
    ] = None,
    data_dir: Annotated[
        Path | None, typer.Option(help="Where the temporary data dir goes.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the generated traffic.")] = 0,
    events_per_second: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            help="Offer this many events/s in all (open-loop; latency from each batch's "
            "scheduled start). Default: closed-loop, full speed.",
        ),
    ] = None,
    hints_per_second: Annotated[
        float | None,
        typer.Option(min=0.001, help="Offer this many route hints/s in all (open-loop)."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """Sustained event batches and route hints against the service in its own process: throughput,
    latency, errors, and its RSS against a bound computed from the run's configuration."""
    from bench.load import BenchError, run

    env = {}
    for item in service_env or []:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("KVP_"):
            raise typer.BadParameter(f"{item!r}: KVP_NAME=VALUE", param_hint="'--service-env'")
        env[key] = value
    try:
        result = run(
            duration_seconds=duration_seconds,
            warmup_seconds=warmup_seconds,
            sessions=sessions,
            instances=instances,
            hbm_blocks=hbm_blocks,
            batch_size=batch_size,
            event_connections=event_connections,
            hint_connections=hint_connections,
            store=store,
            fsync=fsync,
            dedupe_max_ids=dedupe_max_ids,
            session_retention_seconds=session_retention_seconds,
            sample_seconds=sample_seconds,
            ceiling_seconds=ceiling_seconds,
            calibrate_sessions=calibrate_sessions,
            token=token,
            service_env=env,
            data_dir=data_dir,
            seed=seed,
            events_per_second=events_per_second,
            hints_per_second=hints_per_second,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    except BenchError as exc:  # the service did not start or died: its log says why
        typer.echo(f"kvprefetch bench load: {exc}", err=True)
        raise typer.Exit(1) from None
    _print_result(result, as_json)


@bench_cli.command("redis-io")
def bench_redis_io(
    redis_url: Annotated[
        str, typer.Option(help="The Redis server, without a database (see --db).")
    ] = "redis://127.0.0.1:6379",
    db: Annotated[
        int, typer.Option(min=0, help="The database; keys under a prefix removed afterwards.")
    ] = 0,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds (medians).")] = 5,
    events: Annotated[
        int, typer.Option(min=1, help="Events each way posts per batch size, a round.")
    ] = 8000,
    reads: Annotated[
        int, typer.Option(min=1, help="Judging and page reads each way, a round.")
    ] = 16,
    callers: Annotated[int, typer.Option(min=1, help="Concurrent callers on the loop.")] = 4,
    seed: Annotated[int, typer.Option(help="Seed of the generated traffic.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """The Redis store's hot calls on the store thread, through redis.asyncio, and inline:
    calls/s and the event loop's lag."""
    from bench._util import BenchError
    from bench.redis_io import run

    try:
        result = run(
            redis_url=redis_url,
            db=db,
            rounds=rounds,
            events=events,
            reads=reads,
            callers=callers,
            seed=seed,
        )
    except BenchError as exc:
        typer.echo(f"kvprefetch bench redis-io: {exc}", err=True)
        raise typer.Exit(1) from None
    _print_result(result, as_json)


@cli.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (KVP_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (KVP_PORT).")] = None,
    store: Annotated[str | None, typer.Option(help="memory or redis (KVP_STORE).")] = None,
    workers: Annotated[int, typer.Option(help="uvicorn worker processes (memory store: 1).")] = 1,
    fd: Annotated[
        int | None,
        typer.Option(
            help="Serve on this inherited listening TCP socket (socket activation, a supervisor) "
            "instead of binding --host and --port."
        ),
    ] = None,
) -> None:
    """Run the service."""
    import os
    import socket

    # Settings' own field names: it validates each value.
    overrides: dict[str, Any] = {
        k: v for k, v in {"host": host, "port": port, "store": store}.items() if v is not None
    }
    settings = Settings(**overrides)
    if workers < 1:
        raise typer.BadParameter("at least 1", param_hint="'--workers'")
    if workers != 1 and settings.store == "memory":
        raise typer.BadParameter(
            "the memory store lives in one process: use --store redis for several workers"
        )
    from app.core.security import check_bind, load_tokens

    listener, bound_host = None, settings.host
    if fd is not None:
        try:
            listener = socket.socket(fileno=fd)
            bound_host = str(listener.getsockname()[0])
        except OSError as exc:
            raise typer.BadParameter(
                f"not a listening socket: {exc}", param_hint="'--fd'"
            ) from None
    try:
        # The address actually served is what the loopback rule judges.
        access = check_bind(bound_host, load_tokens(settings))
    except KvpError as exc:
        typer.echo(f"kvprefetch serve: {exc}", err=True)
        raise typer.Exit(2) from None
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("kvprefetch").info("%s", access)
    if workers > 1:
        # Worker processes read their settings from the environment (app/api/worker.py), and
        # /metrics must sum them all: prometheus-client's multiprocess mode, set before any
        # process imports it.
        os.environ.update({f"KVP_{k.upper()}": str(v) for k, v in overrides.items()})
        os.environ.setdefault(
            "PROMETHEUS_MULTIPROC_DIR", str((settings.data_dir / "prometheus").resolve())
        )
    from app.core.multiprocess import multiprocess_dir, prepare_multiprocess_dir

    metrics_dir = multiprocess_dir()
    if metrics_dir is not None:
        prepare_multiprocess_dir(metrics_dir)
    # Connection limits and timeouts at the edge, the same for one worker or several.
    from app.api.edge import serve as serve_app

    if workers > 1:
        serve_app(
            "app.api.worker:create_worker_app",
            settings,
            workers=workers,
            factory=True,
            listener=listener,
        )
        return
    from app.api.main import create_app
    from app.core.runtime import tune_gc

    tune_gc()
    serve_app(create_app(settings), settings, listener=listener)


@cli.command()
def token(
    name: Annotated[
        str, typer.Option(help="Who holds it: shown in 403s, rate limits and GET /v1/config.")
    ],
    scope: Annotated[list[str], typer.Option(help="ingest, agent or admin; repeat for several.")],
) -> None:
    """Make a bearer token: the token for its holder on stdout, its KVP_TOKENS_FILE entry (a digest,
    not the token) on stderr."""
    import re
    import secrets

    from app.core.security import Scope, token_digest

    if not re.fullmatch(r"[A-Za-z0-9._@:-]{1,64}", name):
        raise typer.BadParameter("1-64 of letters, digits and . _ @ : -", param_hint="'--name'")
    try:
        scopes = sorted({Scope(s) for s in scope} - {Scope.READ})
    except ValueError:
        raise typer.BadParameter("ingest, agent or admin", param_hint="'--scope'") from None
    if not scopes:
        raise typer.BadParameter("at least one of ingest, agent, admin", param_hint="'--scope'")
    value = secrets.token_urlsafe(32)
    scope_list = ", ".join(f'"{s}"' for s in scopes)
    typer.echo(
        f'[[tokens]]\nname = "{name}"\nscopes = [{scope_list}]\nsha256 = "{token_digest(value)}"',
        err=True,
    )
    typer.echo(value)


@cli.command()
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
            command=_command_line(ctx),
            measure_from_seconds=measure_from,
        )
        typer.echo(f"wrote {report / 'report.md'} and its plots", err=True)


def _command_line(ctx: typer.Context) -> str:
    """The running command as typed (options in declaration order; those left at their defaults
    omitted)."""
    import shlex

    # The subcommands' names (the root's is the program's, "python -m app.cli" run so).
    names: list[str] = []
    at: Any = ctx
    while at is not None and at.parent is not None:
        names.insert(0, at.info_name or "")
        at = at.parent
    words = ["kvprefetch", *names]
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name)
        if source is None or source.name == "DEFAULT" or param.param_type_name != "option":
            continue
        value = ctx.params[param.name]
        if getattr(param, "is_flag", False):
            words.append(param.opts[0] if value else param.secondary_opts[0])
        elif isinstance(value, list | tuple):  # a repeated option: once per value
            for one in value:
                words += [param.opts[0], str(one)]
        else:
            words += [param.opts[0], str(value)]
    return shlex.join(words)


@cli.command("agent-trace")
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


@trace_cli.command("import")
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


@cli.command()
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


@cli.command()
def evaluate(
    models: Annotated[
        str, typer.Option(metavar="DIR,DIR,...", help="Model directories, comma-separated.")
    ],
    trace: Annotated[Path, typer.Option(help="A Mooncake-format trace (JSON Lines).")],
    holdout: Annotated[
        float,
        typer.Option(
            help="The last share of the trace's time span that is judged (the models may have "
            "trained on the rest)."
        ),
    ] = 0.3,
    scenario: Annotated[
        str, typer.Option(help="A shipped scenario name or a TOML file.")
    ] = "default",
    router: Annotated[
        str, typer.Option(help="sticky, least-loaded, kv-aware or hinted.")
    ] = "sticky",
    signals: Annotated[
        str | None,
        typer.Option(
            metavar="NAME=V,...",
            help="Early signals, as replay --signals (e.g. coverage=0.5,lead_median=5,"
            "false_alarms=1).",
        ),
    ] = None,
    seeds: Annotated[
        int,
        typer.Option(
            min=1,
            help="With --signals: signal seeds 0..N-1; every row is the mean ± sd over them.",
        ),
    ] = 1,
    jobs: Annotated[int, typer.Option(min=1, help="Replays run in parallel.")] = 2,
    plots: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="Also write plots overlaying the models: byte hit rate over time, calibration, "
            "Brier and AUC per horizon.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    out: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="Also write the JSON object to FILE (the table still printed): a result kept.",
        ),
    ] = None,
    track: Annotated[
        bool,
        typer.Option(
            "--mlflow",
            help="Also log the comparison to MLflow (the 'mlflow' extra): a run with one "
            "nested run per model, linked to the run that trained it.",
        ),
    ] = False,
    mlflow_uri: Annotated[
        str | None,
        typer.Option(
            "--mlflow-uri",
            metavar="URI",
            help="The MLflow tracking store (implies --mlflow; default as `train --mlflow`).",
        ),
    ] = None,
) -> None:
    """Compare models on the held-out end of a trace: each replayed as `learned`, the baselines
    once, the split by time; a table (Markdown when stdout is not a terminal) or JSON."""
    import json
    import sys
    from contextlib import nullcontext

    from rich.console import Console
    from rich.measure import Measurement

    from training.compare import compare, markdown, rich_table
    from training.progress import rich_bars, stderr_is_terminal

    if signals is None and seeds > 1:
        raise typer.BadParameter("draws signals: use it with --signals", param_hint="'--seeds'")
    track = track or mlflow_uri is not None
    if track:
        _require_mlflow()  # before minutes of replays
    dirs = [m.strip() for m in models.split(",") if m.strip()]
    try:
        with rich_bars() if stderr_is_terminal() else nullcontext(None) as bars:
            result = compare(
                dirs,
                trace,
                holdout=holdout,
                scenario=scenario,
                router=router,
                signals=signals,
                seeds=seeds,
                jobs=jobs,
                plots_dir=plots,
                progress=None if bars is None else (lambda d, t: bars("replays", d, t)),
            )
    except (KvpError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    elif sys.stdout.isatty():
        # The terminal's full width, or wider where the table needs it: never cut.
        console = Console()
        table = rich_table(result)
        # Its natural width, measured without the terminal's bound.
        needed = Measurement.get(console, console.options.update_width(10_000), table).maximum
        # rich keeps a print to the console's width: a wider table needs a wider console.
        (console if needed <= console.width else Console(width=needed)).print(table)
    else:
        typer.echo(markdown(result))
    if plots is not None:
        typer.echo(f"wrote {len(result['plots'])} plots to {plots}", err=True)
    if track:
        _track_comparison(result, mlflow_uri, as_json)


@cli.command("events-from-trace")
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


@log_cli.command("compact")
def log_compact(
    events: Annotated[
        list[Path], typer.Option(help="Event logs: JSON Lines files or log directories (repeat).")
    ],
    out: Annotated[Path, typer.Option(help="The Parquet file to write.")],
) -> None:
    """Compact event logs to one Parquet file (pandas, Polars and DuckDB read it)."""
    from training.compact import compact_log

    try:
        n = compact_log(events, out)
    except KvpError as exc:
        raise typer.BadParameter(str(exc)) from None
    typer.echo(f"wrote {n} events to {out}", err=True)


@cli.command()
def train(
    ctx: typer.Context,
    events: Annotated[
        list[Path], typer.Option(help="Event logs: JSON Lines files or log directories (repeat).")
    ],
    out: Annotated[Path, typer.Option(help="The model directory to write (model.txt, card.json).")],
    valid_fraction: Annotated[
        float, typer.Option(help="The last share of each log's time span that validates.")
    ] = 0.2,
    seed: Annotated[
        int, typer.Option(help="LightGBM's and the tuner's seed (deterministic for a seed).")
    ] = 0,
    tune: Annotated[
        int,
        typer.Option(
            min=0,
            metavar="N",
            help="First run N Optuna trials on an inner time split of the training part "
            "(needs the 'tune' extra); train with the best parameters.",
        ),
    ] = 0,
    max_rounds: Annotated[
        int,
        typer.Option(
            min=1,
            metavar="N",
            help="Most boosting rounds per model (early stopping usually ends sooner).",
        ),
    ] = 1000,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="No progress bars or messages on stderr.")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the validation metrics as one JSON object.")
    ] = False,
    dask: Annotated[
        str | None,
        typer.Option(
            metavar="ADDRESS",
            help="Replay the logs and train (LightGBM's data-parallel learner) on a Dask "
            "cluster: a scheduler's address, or local:N for N local workers. Not with --tune.",
        ),
    ] = None,
    mlflow: Annotated[
        bool,
        typer.Option(
            "--mlflow",
            help="Log the run to MLflow (needs the 'mlflow' extra): params, metrics per horizon, "
            "the card, importance and calibration plots, the model. The store: --mlflow-uri, "
            "else $MLFLOW_TRACKING_URI, else sqlite:///var/mlflow/mlflow.db.",
        ),
    ] = False,
    mlflow_uri: Annotated[
        str | None,
        typer.Option(metavar="URI", help="The MLflow tracking store (implies --mlflow)."),
    ] = None,
) -> None:
    """Train the arrival model from event logs, split by time; write model.txt and card.json.

    Progress bars (logs replayed, tuning trials, boosting rounds) go to stderr, only when it is a
    terminal; stdout carries the result alone.
    """
    import json
    from contextlib import nullcontext

    from training import save_model
    from training import train as fit
    from training.dataset import build_dataset
    from training.progress import rich_bars, stderr_is_terminal

    if tune:
        from training.tune import MissingExtraError, require_optuna
        from training.tune import tune as search

        try:
            require_optuna()  # before minutes of replaying logs, not after
        except MissingExtraError as exc:
            raise typer.BadParameter(str(exc), param_hint="'--tune'") from None
    track = mlflow or mlflow_uri is not None
    if track:
        _require_mlflow()  # before minutes of replaying logs, not after
    options = {
        "events": [str(e) for e in events],
        "valid_fraction": valid_fraction,
        "seed": seed,
        "tune": tune,
        "max_rounds": max_rounds,
        "dask": dask,
    }
    if dask is not None:
        if tune:
            raise typer.BadParameter("not with --tune", param_hint="'--dask'")
        _train_dask(
            events, out, dask, valid_fraction, seed, max_rounds, quiet, as_json, _command_line(ctx)
        )
        if track:
            _track_training(out, options, mlflow_uri, quiet or as_json)
        return
    bars = not quiet and stderr_is_terminal()
    # Without bars (stderr piped or captured), one line per stage unless the output is for machines.
    say = (lambda _: None) if quiet or as_json or bars else (lambda msg: typer.echo(msg, err=True))
    extra: dict[str, object] = {}
    try:
        with rich_bars() if bars else nullcontext(None) as progress:
            say(f"building rows from {len(events)} log(s)")
            rows = build_dataset(events, progress)
            params = None
            if tune:
                say(f"{len(rows):,} rows; {tune} tuning trial(s)")
                tuning = search(
                    rows,
                    tune,
                    valid_fraction=valid_fraction,
                    seed=seed,
                    num_boost_round=max_rounds,
                    progress=progress,
                )
                params, extra = tuning.best_params, {"tuning": tuning.card()}
            say(f"{len(rows):,} rows; training")
            model = fit(
                rows,
                params,
                valid_fraction=valid_fraction,
                seed=seed,
                num_boost_round=max_rounds,
                progress=progress,
            )
    except (KvpError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from None
    save_model(model, out, extra=extra, command=_command_line(ctx))
    if track:
        _track_training(out, options, mlflow_uri, quiet or as_json)
    if as_json:
        typer.echo(json.dumps(model.metrics))
    else:
        m = model.metrics
        typer.echo(
            f"wrote {out}: validation AUC {m['auc']}, Brier {m['brier']} "
            f"(base rate {m['brier_of_base_rate']}), {model.data['rows_train']:,} training rows"
        )


def _require_mlflow() -> None:
    """The 'mlflow' extra is there, or a usage error naming it."""
    from training.tracking import require_mlflow
    from training.tune import MissingExtraError

    try:
        require_mlflow()
    except MissingExtraError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--mlflow'") from None


def _track_comparison(result: dict[str, Any], uri: str | None, silent: bool) -> None:
    """`evaluate --mlflow`: the comparison logged as a run with one nested run per model."""
    import logging

    from training.compare import for_tracking
    from training.tracking import log_comparison, tracking_uri

    if silent:
        logging.getLogger("mlflow").setLevel(logging.WARNING)
    run_id = log_comparison(for_tracking(result), uri)
    if not silent:
        typer.echo(f"logged MLflow run {run_id} to {tracking_uri(uri)}", err=True)


def _track_training(out: Path, options: dict[str, object], uri: str | None, silent: bool) -> None:
    """`train --mlflow`: the written model logged as a run (training/tracking.py)."""
    import logging

    from training.tracking import log_training_run, tracking_uri

    if silent:  # MLflow's INFO lines (a new store's tables) would break --quiet's promise
        logging.getLogger("mlflow").setLevel(logging.WARNING)
    run_id = log_training_run(out, options, uri=uri)
    if not silent:
        typer.echo(f"logged MLflow run {run_id} to {tracking_uri(uri)}", err=True)


RegistryUri = Annotated[
    str | None, typer.Option("--mlflow-uri", metavar="URI", help="The MLflow tracking store.")
]


def _registry(call: Any, *args: Any) -> Any:
    """A training/tracking.py call, its failures (no extra, unknown slot or model) as usage
    errors; MLflow's progress bars and INFO lines kept off stderr."""
    import logging
    import os

    from training.tracking import require_mlflow
    from training.tune import MissingExtraError

    try:
        require_mlflow()
    except MissingExtraError as exc:
        raise typer.BadParameter(str(exc)) from None
    from mlflow.exceptions import MlflowException

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    bar = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    before = os.environ.get(bar)
    os.environ[bar] = "false"
    try:
        return call(*args)
    except (ValueError, MlflowException, OSError) as exc:
        raise typer.BadParameter(str(exc)) from None
    finally:
        if before is None:
            os.environ.pop(bar, None)
        else:
            os.environ[bar] = before


@registry_cli.command("register")
def registry_register(
    model_dir: Annotated[Path, typer.Argument(help="A model directory (model.txt, card.json).")],
    name: Annotated[str, typer.Option(help="The registered model's name.")] = "kvprefetch-arrival",
    slot: Annotated[
        str | None,
        typer.Option(
            help="Point this slot's alias at the new version: serving or shadow (or the stages "
            "Production, Staging)."
        ),
    ] = None,
    mlflow_uri: RegistryUri = None,
) -> None:
    """Register a model as a new version (its training run found by its hashes, or logged now);
    prints the version as JSON."""
    import json

    from training.tracking import register

    typer.echo(json.dumps(_registry(register, model_dir, name, slot, mlflow_uri)))


@registry_cli.command("fetch")
def registry_fetch(
    ref: Annotated[str, typer.Argument(help="A version number, or a slot: serving or shadow.")],
    out: Annotated[Path, typer.Option(help="The directory to write (model.txt, card.json).")],
    name: Annotated[str, typer.Option(help="The registered model's name.")] = "kvprefetch-arrival",
    mlflow_uri: RegistryUri = None,
) -> None:
    """Download a registered version into a directory the service loads (KVP_MODEL_DIR, or PUT
    /v1/model/shadow under its models root); prints the directory."""
    from training.tracking import fetch

    typer.echo(_registry(fetch, name, ref, out, mlflow_uri))


@registry_cli.command("promote")
def registry_promote(
    name: Annotated[str, typer.Option(help="The registered model's name.")] = "kvprefetch-arrival",
    mlflow_uri: RegistryUri = None,
) -> None:
    """As the service's promote: the shadow's version takes the serving alias and the shadow
    alias is removed; prints the promoted version as JSON."""
    import json

    from training.tracking import promote

    typer.echo(json.dumps(_registry(promote, name, mlflow_uri)))


@registry_cli.command("list")
def registry_list(
    name: Annotated[str, typer.Option(help="The registered model's name.")] = "kvprefetch-arrival",
    mlflow_uri: RegistryUri = None,
) -> None:
    """Every version, oldest first, with its aliases and source: one JSON object a line."""
    import json

    from training.tracking import versions

    for version in _registry(versions, name, mlflow_uri):
        typer.echo(json.dumps(version))


def _train_dask(
    events: list[Path],
    out: Path,
    address: str,
    valid_fraction: float,
    seed: int,
    max_rounds: int,
    quiet: bool,
    as_json: bool,
    command: str,
) -> None:
    """`train --dask`: shards replayed on the cluster (training/fleet.py), then trained there
    from their files (training/dask_train.py)."""
    import json
    import tempfile

    from training import save_model
    from training.dask_train import dask_client, train_dask
    from training.fleet import build_rows_fleet

    say = (lambda _: None) if quiet or as_json else (lambda msg: typer.echo(msg, err=True))
    try:
        with dask_client(address) as client, tempfile.TemporaryDirectory() as tmp:
            workers = max(len(client.scheduler_info().get("workers", {})), 1)
            say(f"building rows from {len(events)} log(s) on {workers} Dask worker(s)")
            rows = build_rows_fleet(events, Path(tmp), workers=workers, client=client)
            say("training on the cluster")
            model = train_dask(
                rows, client, valid_fraction=valid_fraction, seed=seed, num_boost_round=max_rounds
            )
    except (KvpError, ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from None
    save_model(model, out, extra={"trained_on": f"dask {address}"}, command=command)
    m = model.metrics
    if as_json:
        typer.echo(json.dumps(m))
    else:
        typer.echo(
            f"wrote {out}: validation AUC {m['auc']}, Brier {m['brier']} "
            f"(base rate {m['brier_of_base_rate']}), {model.data['rows_train']:,} training rows"
        )


@cli.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def agent(ctx: typer.Context) -> None:
    """Run the reference transfer agent: carry out orders, pool directory -> in-memory buffer.

    The light package's `kvprefetch-agent` (its options: --help), its stream defaulting to the
    service's settings (KVP_REDIS_URL, KVP_ORDER_STREAM_PREFIX, .env included)."""
    from kvprefetch_client.agent.cli import StreamDefaults
    from kvprefetch_client.agent.cli import main as agent_main

    def from_settings() -> StreamDefaults:
        settings = Settings()
        return StreamDefaults(
            redis_url=settings.redis_url.get_secret_value(),
            stream_prefix=settings.stream_prefix,
            claim_idle_seconds=settings.order_claim_idle_seconds,
        )

    raise typer.Exit(agent_main(ctx.args, prog="kvprefetch agent", stream_defaults=from_settings))


@connect_cli.command("vllm")
def connect_vllm(
    service: Annotated[str, typer.Option(help="The service's base URL, e.g. http://kvp:8000.")],
    endpoint: Annotated[
        str, typer.Option(help="vLLM's KV-event PUB endpoint, e.g. tcp://127.0.0.1:5557.")
    ],
    instance_id: Annotated[
        str, typer.Option(help="The instance id the router uses for this engine.")
    ],
    replay_endpoint: Annotated[
        str | None,
        typer.Option(help="vLLM's replay_endpoint (recovers gaps and restarts): tcp://host:port."),
    ] = None,
    dp: Annotated[
        int, typer.Option(min=1, help="Data-parallel ranks: rank r publishes on port + r.")
    ] = 1,
    topic: Annotated[str, typer.Option(help="vLLM's kv-events topic (default: all).")] = "",
    token: Annotated[
        str | None,
        typer.Option(envvar="KVP_INGEST_TOKEN", help="A token with the ingest scope."),
    ] = None,
    replay_timeout_seconds: Annotated[
        float, typer.Option(min=0.01, help="Longest wait for a replay before a gap is lost.")
    ] = 2.0,
) -> None:
    """Subscribe to a vLLM engine's KV events (ZMQ) and post them to a running service."""
    from app.ingest.vllm.connect import connect
    from app.ingest.vllm.wire import parse_endpoints

    spec = f"{instance_id}={endpoint}"
    if replay_endpoint:
        spec += f",replay={replay_endpoint}"
    spec += f",dp={dp}"
    if topic:
        spec += f",topic={topic}"
    try:
        endpoints = parse_endpoints(spec)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    totals = connect(endpoints, service, token=token, replay_timeout_seconds=replay_timeout_seconds)
    reasons = ", ".join(f"{r} {n}" for r, n in sorted(totals.bad_input.items()) if n)
    typer.echo(
        f"kvprefetch connect vllm: {totals.batches} batches ({totals.events} events) posted, "
        f"{totals.recovered} recovered by replay, {totals.lost} lost, {totals.restarts} restarts, "
        f"{sum(totals.bad_input.values())} refused{f' ({reasons})' if reasons else ''}, "
        f"{totals.deaths} intake deaths"
    )


def main() -> None:
    import sys

    from app.core.result_stdout import result_alone_on_stdout, wants_json

    if wants_json(sys.argv[1:]):
        # One JSON object on stdout: library and worker output below Python goes to stderr.
        with result_alone_on_stdout():
            cli()
    else:
        cli()


if __name__ == "__main__":
    main()
