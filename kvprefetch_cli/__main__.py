"""`python -m kvprefetch_cli`: the `kvprefetch` command run from a checkout (tests, the benches)."""

from kvprefetch_cli import main

main()
