"""`kvprefetch-agent`: the reference transfer agent from the light package alone.

The standard library's argparse, so a transfer agent's host installs pydantic, httpx and orjson
(and the `redis` extra for the stream source), never the service. `kvprefetch agent` on the
service's command line is this same command, given the service's own settings for the stream.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvprefetch_client.agent.consumer import (
    OrderSource,
    PullSource,
    StreamSource,
    default_consumer_name,
    default_stream_prefix,
)
from kvprefetch_client.agent.mooncake import MooncakeError, MooncakeSettings, MooncakeTier
from kvprefetch_client.agent.runner import run_agent
from kvprefetch_client.agent.tier import Tier

SOURCES = ("stream", "pull")
TIERS = ("buffer", "mooncake")


@dataclass(frozen=True, slots=True)
class StreamDefaults:
    """Where the stream source finds the service's orders unless the options say otherwise."""

    redis_url: str
    stream_prefix: str
    claim_idle_seconds: float

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> StreamDefaults:
        """The service's own variables and defaults (KVP_REDIS_URL, KVP_REDIS_PREFIX,
        KVP_ORDER_STREAM_PREFIX, KVP_ORDER_CLAIM_IDLE_SECONDS), read without its settings class."""
        env = os.environ if environ is None else environ
        prefix = env.get("KVP_ORDER_STREAM_PREFIX") or default_stream_prefix(
            env.get("KVP_REDIS_PREFIX", "kvp")
        )
        return cls(
            redis_url=env.get("KVP_REDIS_URL", "redis://127.0.0.1:6379/0"),
            stream_prefix=prefix,
            claim_idle_seconds=float(env.get("KVP_ORDER_CLAIM_IDLE_SECONDS", "30")),
        )


def _at_least(kind: type[int | float], least: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"{text}: at least {least:g}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its errors
    return parse


def parser(prog: str = "kvprefetch-agent") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run the reference transfer agent: carry out orders, pool "
        "directory -> in-memory buffer.",
    )
    p.add_argument(
        "--instance-id",
        required=True,
        help="The instance whose tier this agent fills (orders name it).",
    )
    # Checked by hand rather than with choices=, so the error names the two in plain words.
    p.add_argument(
        "--tier",
        default="buffer",
        help="buffer (--pool-dir files into an in-memory buffer) or mooncake (replicas in a "
        "Mooncake Store segment; the --mooncake-* options) (default: %(default)s).",
    )
    p.add_argument(
        "--pool-dir", type=Path, help="The pool: one file per block hash (--tier buffer)."
    )
    p.add_argument(
        "--capacity-bytes",
        type=_at_least(int, 1),
        help="Bytes the in-memory instance tier holds (--tier buffer).",
    )
    m = p.add_argument_group(
        "mooncake", "--tier mooncake; each defaults to its KVP_MOONCAKE_* variable, then as shown"
    )
    d = MooncakeSettings()
    m.add_argument("--mooncake-master", help=f"The master's RPC host:port ({d.master_address}).")
    m.add_argument("--mooncake-metadata-url", help=f"The metadata server's URL ({d.metadata_url}).")
    m.add_argument(
        "--mooncake-local-host",
        help=f"This client's host or host:port in the cluster ({d.local_host}).",
    )
    m.add_argument(
        "--mooncake-segment-bytes",
        type=_at_least(int, 0),
        help=f"The segment this client mounts, the HBM side by default ({d.segment_bytes}).",
    )
    m.add_argument(
        "--mooncake-buffer-bytes",
        type=_at_least(int, 1),
        help=f"The client's local transfer buffer ({d.buffer_bytes}).",
    )
    m.add_argument(
        "--mooncake-namespace",
        help=f"The model or deployment, in every key kvp/<namespace>/... ({d.namespace}).",
    )
    m.add_argument(
        "--mooncake-target-segment",
        help="The HBM-side segment when it is not this client's own (e.g. the engine's).",
    )
    m.add_argument(
        "--mooncake-attempts",
        type=_at_least(int, 1),
        help=f"Tries while the master is away, before an order fails ({d.attempts}).",
    )
    p.add_argument(
        "--service-url",
        default="http://127.0.0.1:8000",
        help="Where progress and residency events go (default: %(default)s).",
    )
    # Checked by hand rather than with choices=, so the error names the two in plain words.
    p.add_argument(
        "--source",
        default="stream",
        help="stream (the Redis Stream) or pull (GET /v1/orders) (default: %(default)s).",
    )
    p.add_argument("--redis-url", help="The orders stream's Redis (KVP_REDIS_URL).")
    p.add_argument(
        "--stream-prefix",
        help="The service's KVP_ORDER_STREAM_PREFIX (default <KVP_REDIS_PREFIX>:sink); "
        "the streams are <prefix>:orders:<instance_id>.",
    )
    p.add_argument(
        "--claim-idle-seconds",
        type=_at_least(float, 0.01),
        help="Take over stream entries another agent has held this long without a "
        "heartbeat (KVP_ORDER_CLAIM_IDLE_SECONDS).",
    )
    p.add_argument(
        "--consumer-name",
        help="This agent's name in the consumer group (default: instance@host:pid).",
    )
    p.add_argument(
        "--start-margin-seconds",
        type=_at_least(float, 0.0),
        default=0.05,
        help="Start an early order this long before its start_by (default: %(default)s).",
    )
    p.add_argument(
        "--poll-seconds",
        type=_at_least(float, 0.01),
        default=0.5,
        help="Longest wait for new orders (default: %(default)s).",
    )
    p.add_argument("--status-file", type=Path, help="Keep the agent's status here as JSON.")
    p.add_argument(
        "--token",
        default=os.environ.get("KVP_AGENT_TOKEN"),
        help="A bearer token with the agent scope, for the service's reports and pulls "
        "(KVP_AGENT_TOKEN).",
    )
    return p


def mooncake_settings(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> MooncakeSettings:
    """The KVP_MOONCAKE_* variables, overridden by the options given."""
    base = MooncakeSettings.from_environ(environ)
    given = {
        "master_address": args.mooncake_master,
        "metadata_url": args.mooncake_metadata_url,
        "local_host": args.mooncake_local_host,
        "segment_bytes": args.mooncake_segment_bytes,
        "buffer_bytes": args.mooncake_buffer_bytes,
        "namespace": args.mooncake_namespace,
        "target_segment": args.mooncake_target_segment,
        "attempts": args.mooncake_attempts,
    }
    return dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})


def main(
    argv: Sequence[str] | None = None,
    *,
    prog: str = "kvprefetch-agent",
    stream_defaults: Callable[[], StreamDefaults] = StreamDefaults.from_environ,
) -> int:
    """Run the agent until SIGINT or SIGTERM. `stream_defaults` is asked only for the stream
    source (the service's command passes its settings)."""
    p = parser(prog)
    args = p.parse_args(argv)
    if args.source not in SOURCES:
        p.error(f"--source {args.source!r}: stream or pull")
    if args.tier not in TIERS:
        p.error(f"--tier {args.tier!r}: buffer or mooncake")
    if args.tier == "buffer" and (args.pool_dir is None or args.capacity_bytes is None):
        p.error("--tier buffer needs --pool-dir and --capacity-bytes")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per report is noise
    orders: OrderSource
    if args.source == "stream":
        defaults = stream_defaults()
        try:
            orders = StreamSource.from_url(
                args.redis_url or defaults.redis_url,
                prefix=args.stream_prefix or defaults.stream_prefix,
                consumer=args.consumer_name or default_consumer_name(args.instance_id),
                claim_idle_seconds=args.claim_idle_seconds or defaults.claim_idle_seconds,
                instance_id=args.instance_id,
            )
        except ModuleNotFoundError as exc:
            if exc.name != "redis":
                raise
            p.error("--source stream needs the redis extra: pip install 'kvprefetch-client[redis]'")
    else:
        orders = PullSource(args.service_url, args.instance_id, token=args.token)
    tier: Tier | None = None
    if args.tier == "mooncake":
        try:
            tier = MooncakeTier(args.instance_id, mooncake_settings(args))
        except (MooncakeError, ValueError) as exc:
            p.error(str(exc))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    run_agent(
        instance_id=args.instance_id,
        source=orders,
        service_url=args.service_url,
        pool_dir=args.pool_dir,
        capacity_bytes=args.capacity_bytes,
        tier=tier,
        stop=stop,
        status_file=args.status_file,
        start_margin_seconds=args.start_margin_seconds,
        poll_seconds=args.poll_seconds,
        token=args.token,
    )
    return 0
