"""Why a /healthz answer was slow while Redis was stopped: the service's own stalls, collections
and run-queue waits (sitecustomize.py, in the service) beside the hung-Redis test's poller
(tests/e2e/test_redis_hang.py). `python -m bench.stallwatch DIR` prints the report; bench/README.md
has the commands."""
