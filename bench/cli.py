"""The benchmarks' commands: `kvprefetch bench ingest`, `bench load` and the rest (the `bench`
group; kvprefetch_cli/ adds it to the root command). Each imports its bench when it runs, after
checking the 'bench' extra (app/core/extras.py): `kvprefetch --help` needs none of it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from app.commands import needs, print_result
from app.core.errors import KvpError
from bench.load.options import LoadOptions
from bench.planner.options import PlannerOptions

BENCH = needs("bench")

bench = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="Benchmarks, each printing one JSON object with --json.",
)


@bench.command("ingest", cls=BENCH)
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
    print_result(result, as_json)


@bench.command("vllm-intake", cls=BENCH)
def bench_vllm_intake(
    rounds: Annotated[int, typer.Option(min=1, help="Rounds; each measures both paths.")] = 3,
    publishers: Annotated[int, typer.Option(min=1, help="vLLM publishers (ZMQ PUB).")] = 8,
    batches: Annotated[int, typer.Option(min=1, help="Batches per publisher per round.")] = 2500,
    events_per_batch: Annotated[
        float,
        typer.Option(
            min=1.0,
            help="KV events a batch, on average (each batch the whole part, or one more with the "
            "fraction's chance): vLLM 0.33's publisher sent 1.4 (1 or 2 a batch).",
        ),
    ] = 1.4,
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
    Batches/s and KV events/s from vLLM ZMQ publishers through the subscriber into the engine,
    beside HTTP.
    """
    from bench.vllm_intake import run

    print_result(
        run(
            rounds=rounds,
            publishers=publishers,
            batches=batches,
            events_per_batch=events_per_batch,
            per_post=per_post,
            concurrency=concurrency,
            seed=seed,
            data_dir=data_dir,
        ),
        as_json,
    )


@bench.command("memory", cls=BENCH)
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

    print_result(run(sessions=sessions, jobs=jobs, seed=seed), as_json)


@bench.command("replay", cls=BENCH)
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
    print_result(result, as_json)


def _counts(text: str, option: str) -> tuple[int, ...]:
    """A comma-separated list of positive counts ('' for none)."""
    try:
        counts = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"{option}: {text!r} is not a list of counts") from None
    if any(n < 1 for n in counts):
        raise typer.BadParameter(f"{option}: counts must be positive")
    return counts


@bench.command("predict", cls=BENCH)
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
    print_result(result, as_json)


@bench.command("mooncake", cls=BENCH)
def bench_mooncake(
    context_bytes: Annotated[int, typer.Option(min=1, help="The context's bytes.")] = 32 << 20,
    blocks: Annotated[int, typer.Option(min=1, help="Objects the context is stored as.")] = 1,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds (medians).")] = 7,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """The Mooncake agent's time to last byte for a context, beside a plain get of it."""
    from bench.mooncake import run

    print_result(run(context_bytes=context_bytes, blocks=blocks, rounds=rounds), as_json)


@bench.command("plan", cls=BENCH)
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
    print_result(result, as_json)


@bench.command("train-fleet", cls=BENCH)
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
    single_only: Annotated[
        bool, typer.Option("--single-only", help="Skip the Dask path (its figures exist).")
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

    if dask_only and single_only:
        raise typer.BadParameter("--dask-only and --single-only leave no path to run")
    result = run(
        events=events,
        workers=workers,
        max_rounds=max_rounds,
        work_dir=work_dir,
        trace_requests=trace_requests,
        paths=("dask",) if dask_only else ("single",) if single_only else ("single", "dask"),
        reference_events=reference_events,
    )
    print_result(result, as_json)


# The defaults are LoadOptions' (a dataclass field's plain default stays its class attribute), so
# the command and bench.load.run cannot disagree.
@bench.command("load", cls=BENCH)
def bench_load(
    duration_seconds: Annotated[
        float, typer.Option(min=0.1, help="Measured seconds of sustained load.")
    ] = LoadOptions.duration_seconds,
    warmup_seconds: Annotated[
        float, typer.Option(min=0, help="Load before the start RSS is taken.")
    ] = LoadOptions.warmup_seconds,
    sessions: Annotated[
        int, typer.Option(min=1, help="Live conversations (ended ones are replaced).")
    ] = LoadOptions.sessions,
    instances: Annotated[
        int, typer.Option(min=1, help="Serving instances, split among the event connections.")
    ] = LoadOptions.instances,
    hbm_blocks: Annotated[
        int, typer.Option(min=1, help="KV blocks an instance's HBM holds (LRU).")
    ] = LoadOptions.hbm_blocks,
    batch_size: Annotated[
        int, typer.Option(min=1, help="Events per POST /v1/events.")
    ] = LoadOptions.batch_size,
    event_connections: Annotated[
        int, typer.Option(min=1, help="Routers posting batches, one connection each.")
    ] = LoadOptions.event_connections,
    hint_connections: Annotated[
        int, typer.Option(min=0, help="Connections asking for route hints.")
    ] = LoadOptions.hint_connections,
    store: Annotated[
        str,
        typer.Option(
            help="memory, or redis (at KVP_REDIS_URL, under a prefix removed afterwards)."
        ),
    ] = LoadOptions.store,
    fsync: Annotated[
        bool,
        typer.Option("--fsync/--no-fsync", help="fsync the event log per batch (the default)."),
    ] = LoadOptions.fsync,
    dedupe_max_ids: Annotated[
        int | None, typer.Option(min=1, help="The service's KVP_DEDUPE_MAX_IDS (default: its own).")
    ] = LoadOptions.dedupe_max_ids,
    session_retention_seconds: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="The service's KVP_SESSION_RETENTION_SECONDS, scaled to the bench's think times.",
        ),
    ] = LoadOptions.session_retention_seconds,
    sample_seconds: Annotated[
        float, typer.Option(min=0.1, help="How often RSS and the store's counts are sampled.")
    ] = LoadOptions.sample_seconds,
    ceiling_seconds: Annotated[
        float, typer.Option(min=0, help="Each of the two ceiling phases (0: none).")
    ] = LoadOptions.ceiling_seconds,
    calibrate_sessions: Annotated[
        int,
        typer.Option(
            min=0,
            help="Sessions ingested to price each unit of state the bound counts (0: no bound).",
        ),
    ] = LoadOptions.calibrate_sessions,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="KVP_BENCH_TOKEN",
            help="Sent as Authorization: Bearer (default: KVP_BENCH_TOKEN).",
        ),
    ] = LoadOptions.token,
    service_env: Annotated[
        list[str] | None,
        typer.Option(
            metavar="KVP_X=V",
            help="A setting for the service process (repeat), e.g. KVP_INGEST_TOKEN=...",
        ),
    ] = None,
    data_dir: Annotated[
        Path | None, typer.Option(help="Where the temporary data dir goes.")
    ] = LoadOptions.data_dir,
    seed: Annotated[int, typer.Option(help="Seed of the generated traffic.")] = LoadOptions.seed,
    events_per_second: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            help="Offer this many events/s in all (open-loop; latency from each batch's "
            "scheduled start). Default: closed-loop, full speed.",
        ),
    ] = LoadOptions.events_per_second,
    hints_per_second: Annotated[
        float | None,
        typer.Option(min=0.001, help="Offer this many route hints/s in all (open-loop)."),
    ] = LoadOptions.hints_per_second,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """Sustained event batches and route hints against the service in its own process: throughput,
    latency, errors, and its RSS against a bound computed from the run's configuration."""
    from bench.load import BenchError, run

    options = LoadOptions(
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
        service_env=_service_env(service_env or []),
        data_dir=data_dir,
        seed=seed,
        events_per_second=events_per_second,
        hints_per_second=hints_per_second,
    )
    try:
        result = run(options)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    except BenchError as exc:  # the service did not start or died: its log says why
        typer.echo(f"kvprefetch bench load: {exc}", err=True)
        raise typer.Exit(1) from None
    print_result(result, as_json)


def _service_env(items: list[str]) -> dict[str, str]:
    """--service-env's KVP_X=V items, as a dict."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("KVP_"):
            raise typer.BadParameter(f"{item!r}: KVP_NAME=VALUE", param_hint="'--service-env'")
        env[key] = value
    return env


@bench.command("planner", cls=BENCH)
def bench_planner(
    rounds: Annotated[
        int, typer.Option(min=1, help="Rounds (the summary: their medians).")
    ] = PlannerOptions.rounds,
    replicas: Annotated[
        int, typer.Option(min=2, help="Replicas measured against one, on one Redis.")
    ] = PlannerOptions.replicas,
    connections: Annotated[
        int,
        typer.Option(min=1, help="Routers posting batches closed-loop, spread over the replicas."),
    ] = PlannerOptions.connections,
    duration_seconds: Annotated[
        float, typer.Option(min=0.1, help="Measured seconds of load, each configuration.")
    ] = PlannerOptions.duration_seconds,
    warmup_seconds: Annotated[
        float, typer.Option(min=0, help="Load before the measured window.")
    ] = PlannerOptions.warmup_seconds,
    sample_seconds: Annotated[
        float, typer.Option(min=0.1, help="How often the planner's feed lag is sampled.")
    ] = PlannerOptions.sample_seconds,
    feed_events: Annotated[
        int, typer.Option(min=1, help="Events pre-filled into the feed for one replica to apply.")
    ] = PlannerOptions.feed_events,
    catch_up_seconds: Annotated[
        float, typer.Option(min=0.1, help="How long the planner may take to catch up.")
    ] = PlannerOptions.catch_up_seconds,
    sessions: Annotated[
        int, typer.Option(min=1, help="Live conversations (ended ones are replaced).")
    ] = PlannerOptions.sessions,
    instances: Annotated[
        int, typer.Option(min=1, help="Serving instances, split among the connections.")
    ] = PlannerOptions.instances,
    hbm_blocks: Annotated[
        int, typer.Option(min=1, help="KV blocks an instance's HBM holds (LRU).")
    ] = PlannerOptions.hbm_blocks,
    batch_size: Annotated[
        int, typer.Option(min=1, help="Events per POST /v1/events and per feed entry.")
    ] = PlannerOptions.batch_size,
    fsync: Annotated[
        bool,
        typer.Option("--fsync/--no-fsync", help="fsync the event log per batch (the default)."),
    ] = PlannerOptions.fsync,
    lease_seconds: Annotated[
        float, typer.Option(min=0.1, help="The replicas' KVP_PLANNING_LEASE_SECONDS.")
    ] = PlannerOptions.lease_seconds,
    service_env: Annotated[
        list[str] | None,
        typer.Option(metavar="KVP_X=V", help="A setting for every replica (repeat)."),
    ] = None,
    data_dir: Annotated[
        Path | None, typer.Option(help="Where the temporary data dirs go.")
    ] = PlannerOptions.data_dir,
    seed: Annotated[int, typer.Option(help="Seed of the generated traffic.")] = PlannerOptions.seed,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """What one planning replica follows: the events/s it applies from the fleet feed beside its
    own ingest, and one replica against several on one Redis (Redis at KVP_REDIS_URL)."""
    from bench._util import BenchError
    from bench.planner.driver import run

    options = PlannerOptions(
        rounds=rounds,
        replicas=replicas,
        connections=connections,
        duration_seconds=duration_seconds,
        warmup_seconds=warmup_seconds,
        sample_seconds=sample_seconds,
        feed_events=feed_events,
        catch_up_seconds=catch_up_seconds,
        sessions=sessions,
        instances=instances,
        hbm_blocks=hbm_blocks,
        batch_size=batch_size,
        fsync=fsync,
        lease_seconds=lease_seconds,
        service_env=_service_env(service_env or []),
        data_dir=data_dir,
        seed=seed,
    )
    try:
        result = run(options)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    except BenchError as exc:  # no Redis, or a replica did not start or died: the message says
        typer.echo(f"kvprefetch bench planner: {exc}", err=True)
        raise typer.Exit(1) from None
    print_result(result, as_json)


@bench.command("redis-io", cls=BENCH)
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
    print_result(result, as_json)
