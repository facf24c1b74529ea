"""Runs one benchmark server in this process, one uvicorn worker, as `kvprefetch serve` does.

python -m bench._server service --fd N   # create_app(Settings()): KVP_* from the environment
python -m bench._server ceiling --fd N   # bench.ceiling_app

N is a listening socket the caller bound and handed down (bench._util.ServerProcess).
"""

from __future__ import annotations

import argparse
import socket

import uvicorn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("which", choices=["service", "ceiling"])
    parser.add_argument("--fd", type=int, required=True)
    args = parser.parse_args()
    listener = socket.socket(fileno=args.fd)
    from app.core.runtime import tune_gc

    tune_gc()  # as `kvprefetch serve` does, for both servers, so the ratio stays fair
    if args.which == "service":
        import logging

        from app.api.main import create_app
        from app.core.config import Settings

        logging.basicConfig(
            level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        from app.api.edge import serve

        settings = Settings()
        # The same server as `kvprefetch serve`, its edge limits included.
        serve(create_app(settings), settings, log_level="warning", listener=listener)
        return
    from bench.ceiling_app import app

    # uvicorn as `kvprefetch serve` runs it (uvloop and httptools when installed), without the edge.
    serve_bare(app, listener)


def serve_bare(app: object, listener: socket.socket) -> None:
    """uvicorn alone on `listener`: the bare ceiling the service is measured against."""
    config = uvicorn.Config(app, log_level="warning", access_log=False)  # type: ignore[arg-type]
    uvicorn.Server(config).run(sockets=[listener])


if __name__ == "__main__":
    main()
