"""Runs one benchmark server in this process, one uvicorn worker, as `kvprefetch serve` does.

python -m bench._server service --port 8001   # create_app(Settings()): KVP_* from the environment
python -m bench._server ceiling --port 8002   # bench.ceiling_app
"""

from __future__ import annotations

import argparse

import uvicorn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("which", choices=["service", "ceiling"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
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
        serve(
            create_app(settings),
            settings.model_copy(update={"host": args.host, "port": args.port}),
            log_level="warning",
        )
        return
    from bench.ceiling_app import app

    # uvicorn as `kvprefetch serve` runs it (uvloop and httptools when installed), without the edge.
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
