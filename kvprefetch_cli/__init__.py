"""The `kvprefetch` command: the root that each package's commands are added to, and nothing else.

app/commands.py holds the service's commands (serve, token, agent, connect), sim/cli.py the
simulator's (replay, agent-trace, targets, events-from-trace, trace), training/cli.py training's
(train, evaluate, log, registry), bench/cli.py the benches'. Each imports its package's code only
when it runs, and checks the extra it needs then: on the base install `kvprefetch serve` and
`kvprefetch --help` work, and `kvprefetch train` names the extra to install. This package sits
above all of them; nothing imports it (tests/test_layout.py).
"""

from __future__ import annotations

import typer

from app import commands as app_commands
from bench import cli as bench_cli
from sim import cli as sim_cli
from training import cli as training_cli

__all__ = ["cli", "main"]

cli = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="Predictive KV-cache prefetching for LLM serving fleets.",
)
# Added without a name, a package's top-level commands join the root's own.
for commands in (app_commands.commands, sim_cli.commands, training_cli.commands):
    cli.add_typer(commands)
cli.add_typer(bench_cli.bench, name="bench")
cli.add_typer(app_commands.connect, name="connect")
cli.add_typer(training_cli.log, name="log")
cli.add_typer(sim_cli.trace, name="trace")
cli.add_typer(training_cli.registry, name="registry")


def main() -> None:
    import sys

    from app.core.result_stdout import result_alone_on_stdout, wants_json

    if wants_json(sys.argv[1:]):
        # One JSON object on stdout: library and worker output below Python goes to stderr.
        with result_alone_on_stdout():
            cli()
    else:
        cli()
