"""The `kvprefetch` command."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from app.core.config import Settings

cli = typer.Typer(no_args_is_help=True, help="Predictive KV-cache prefetching for LLM serving fleets.")
bench_cli = typer.Typer(no_args_is_help=True, help="Benchmarks, each printing one JSON object with --json.")
cli.add_typer(bench_cli, name="bench")


@cli.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (KVP_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (KVP_PORT).")] = None,
    store: Annotated[str | None, typer.Option(help="memory or redis (KVP_STORE).")] = None,
    workers: Annotated[int, typer.Option(help="uvicorn worker processes (memory store: 1).")] = 1,
) -> None:
    """Run the service."""
    import uvicorn

    from app.api.main import create_app

    overrides = {k: v for k, v in {"host": host, "port": port, "store": store}.items() if v is not None}
    settings = Settings(**overrides)
    if workers != 1 and settings.store == "memory":
        raise typer.BadParameter("the memory store lives in one process: use --store redis for several workers")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info",
                access_log=False)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
