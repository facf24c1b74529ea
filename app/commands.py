"""The service's own commands: `kvprefetch serve`, `token`, `agent` and `connect vllm`; and what
every package's commands share (the command as typed, a result printed, an extra checked).

kvprefetch_cli/ adds these to the root command beside sim/cli.py's, training/cli.py's and
bench/cli.py's. Nothing here imports the simulator, training or the benches: these commands run
on the base install.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from app.core.config import Settings
from app.core.errors import KvpError, MissingExtraError
from app.core.extras import require_extra

# The top-level commands, merged into the root (kvprefetch_cli adds them without a group name).
commands = typer.Typer()
connect = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="Feed an engine's own event stream to a running service.",
)


def needs(extra: str) -> type[TyperCommand]:
    """A command class (`@app.command(cls=needs("training"))`) that checks the optional extra
    (app/core/extras.py) when the command runs, after its arguments parse: its --help works without
    the extra, and without it the command prints one line naming the extra and exits 2, before it
    imports any of it."""

    class NeedsExtra(TyperCommand):
        def invoke(self, ctx: Any) -> Any:  # the click Context typer vendors
            try:
                require_extra(extra, ctx.command_path)
            except MissingExtraError as exc:
                typer.echo(str(exc), err=True)
                raise typer.Exit(2) from None
            return super().invoke(ctx)

    return NeedsExtra


def print_result(result: dict[str, Any], as_json: bool) -> None:
    """One JSON object on stdout with --json; otherwise the same, indented for people."""
    import json

    print(json.dumps(result) if as_json else json.dumps(result, indent=2), flush=True)


def command_line(ctx: typer.Context) -> str:
    """The running command as typed (options in declaration order; those left at their defaults
    omitted)."""
    import shlex

    # The subcommands' names (the root's is the program's, "python -m kvprefetch_cli" run so).
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


@commands.command()
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
    from app.core.runtime import import_model_libraries_bare

    import_model_libraries_bare()  # before anything of the service's imports it

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


@commands.command("compile-model", cls=needs("fast"))
def compile_model(
    model_dir: Annotated[
        Path | None,
        typer.Option(help="The model's directory (default: KVP_MODEL_DIR's, the bundled model)."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """Compile a model to machine code (lleaves) into the cache, checked against LightGBM: a
    service started with it then scores compiled at once, not on the Booster for the minute or
    more a first compile takes (an image's build step; `make test`'s first)."""
    from app.core.runtime import import_model_libraries_bare

    import_model_libraries_bare()
    from app.predict.predictors import LearnedPredictor

    try:
        directory = model_dir if model_dir is not None else Settings().model_dir
        model = LearnedPredictor(directory, backend="compiled")
    except KvpError as exc:  # ModelError too
        typer.echo(f"kvprefetch compile-model: {exc}", err=True)
        raise typer.Exit(2) from None
    done = model.compiled
    assert done is not None  # backend="compiled" raises rather than leave it unset
    result = {
        "model_dir": str(directory),
        "trees": model.booster.num_trees(),
        "cache_file": str(done.cache_file),
        "from_cache": done.from_cache,
        "seconds": round(done.load_seconds, 2),
    }
    print_result(result, as_json)


@commands.command()
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


@commands.command(
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


@connect.command("vllm")
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
