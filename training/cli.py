"""Training's commands: `kvprefetch train`, `evaluate`, `log compact` and the `registry` group
(kvprefetch_cli/ adds them to the root command). Each imports training when it runs, after
checking the 'training' extra (app/core/extras.py): `kvprefetch --help` needs none of it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from app.commands import command_line, needs
from app.core.errors import KvpError

TRAINING = needs("training")

# The top-level commands, merged into the root (kvprefetch_cli adds them without a group name).
commands = typer.Typer()
log = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="Work with the durable event log (JSON Lines segments).",
)
registry = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="MLflow's model registry, its aliases the service's slots (serving, shadow); needs the "
    "'mlflow' extra. The store: --mlflow-uri, else $MLFLOW_TRACKING_URI, else "
    "sqlite:///var/mlflow/mlflow.db.",
)


@commands.command(cls=TRAINING)
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


@log.command("compact", cls=TRAINING)
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


@commands.command(cls=TRAINING)
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
        from app.core.errors import MissingExtraError
        from training.tune import require_optuna
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
            events, out, dask, valid_fraction, seed, max_rounds, quiet, as_json, command_line(ctx)
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
    save_model(model, out, extra=extra, command=command_line(ctx))
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
    from app.core.errors import MissingExtraError
    from training.tracking import require_mlflow

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

    from app.core.errors import MissingExtraError
    from training.tracking import require_mlflow

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


@registry.command("register", cls=TRAINING)
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


@registry.command("fetch", cls=TRAINING)
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


@registry.command("promote", cls=TRAINING)
def registry_promote(
    name: Annotated[str, typer.Option(help="The registered model's name.")] = "kvprefetch-arrival",
    mlflow_uri: RegistryUri = None,
) -> None:
    """As the service's promote: the shadow's version takes the serving alias and the shadow
    alias is removed; prints the promoted version as JSON."""
    import json

    from training.tracking import promote

    typer.echo(json.dumps(_registry(promote, name, mlflow_uri)))


@registry.command("list", cls=TRAINING)
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
