"""A reference transfer agent: carries out kvprefetch's orders with real bytes between two tiers.

It reads orders from its instance's Redis Stream
`<KVP_ORDER_STREAM_PREFIX>:orders:<instance_id>` (by default
`<KVP_REDIS_PREFIX>:sink:orders:<instance_id>`) or from the service's pull endpoint, moves blocks
from a pool directory (one file per block) into a bounded in-memory buffer standing for its
instance's HBM, honours start times, pins and demotes, and reports progress and residency to the
service. That pair is one `Tier` (tier.py); `MooncakeTier` (mooncake.py) fills a Mooncake Store
segment instead (`--tier mooncake`). `kvprefetch agent` runs it; docs/agents/reference-agent.md
says what it promises.

    source = StreamSource.from_url("redis://127.0.0.1:6379/0", prefix="kvp:sink",
                                   instance_id="gpu-0", consumer=default_consumer_name("gpu-0"))
    run_agent(instance_id="gpu-0", source=source, service_url="http://127.0.0.1:8000",
              pool_dir=Path("pool"), capacity_bytes=8 << 30, stop=threading.Event())
"""

from kvprefetch_client.agent.buffer import BufferFull, HbmBuffer, PoolDir, block_file_name
from kvprefetch_client.agent.consumer import (
    GROUP,
    Delivery,
    OrderSource,
    PullSource,
    StreamSource,
    cancel_key,
    default_consumer_name,
    default_stream_prefix,
    stream_key,
)
from kvprefetch_client.agent.mooncake import MooncakeSettings, MooncakeTier, store_key
from kvprefetch_client.agent.runner import (
    Agent,
    AgentStats,
    Outcome,
    Reporter,
    progress_event_id,
    run_agent,
)
from kvprefetch_client.agent.tier import BufferTier, Done, Tier

__all__ = [
    "GROUP",
    "Agent",
    "AgentStats",
    "BufferFull",
    "BufferTier",
    "Delivery",
    "Done",
    "HbmBuffer",
    "MooncakeSettings",
    "MooncakeTier",
    "OrderSource",
    "Outcome",
    "PoolDir",
    "PullSource",
    "Reporter",
    "StreamSource",
    "Tier",
    "block_file_name",
    "cancel_key",
    "default_consumer_name",
    "default_stream_prefix",
    "progress_event_id",
    "run_agent",
    "store_key",
    "stream_key",
]
