"""`python -m kvprefetch_client.agent`: the same as `kvprefetch-agent`."""

from kvprefetch_client.agent.cli import main

raise SystemExit(main(prog="python -m kvprefetch_client.agent"))
