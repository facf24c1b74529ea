"""RedisStreamSink, the producer of the orders streams; the agents' side is
`kvprefetch_client.agent.StreamSource` (client/kvprefetch_client/agent/consumer.py).

The format, which agents read directly:

    stream  <prefix>:orders:<instance_id>
                                     one stream per destination instance (the Order's
                                     `instance_id`, as is: Redis keys take any bytes, so no
                                     escaping); one entry per message, a single field `msg`: the
                                     Order or Cancel JSON (`Order.to_json()`, `Cancel.to_json()`;
                                     `kvprefetch_client.orders.from_json` reads it); each stream
                                     trimmed with XADD MAXLEN ~ <KVP_ORDER_STREAM_MAXLEN>
    group   kvp-agents               on every stream, created at id 0 with MKSTREAM by whichever
                                     side comes first (the sink, in the same Lua call as its
                                     first XADD there; or the instance's first agent)
    <prefix>:order-ids:<order_id>    the order's instance_id, EX <KVP_ORDER_DEDUPE_SECONDS>: the
                                     order was added, and to which stream
    <prefix>:cancel-ids:<order_id>   "1", same TTL: the order was cancelled (agents check it
                                     before starting an order, so a cancel read by one agent
                                     stops the order read by another)

The service's `<prefix>` is KVP_ORDER_STREAM_PREFIX, by default `<KVP_REDIS_PREFIX>:sink`: the
state store already owns `<KVP_REDIS_PREFIX>:orders` (a set), so the streams cannot share its
prefix.

One stream per instance, so that an agent (which serves one instance) is only ever handed its own
instance's orders, and XAUTOCLAIM takeover happens among the agents of one instance.

Once per order id: a Lua script sets the id key with SET NX EX and, only when that set it, adds
the entry, both atomically, so a resubmission from this or any other replica, or after a restart,
within the window adds nothing; and no id is ever marked without its entry being added.

With a planning lease (several replicas, decisions.md 23) the engine sets `fence`
(app/deliver/fence.py): the lease's key and this replica's value while it holds it. Both
scripts then add nothing unless the lease still holds that value, in the same call, so a planning
replica that paused past its lease sends nothing when it wakes (SinkFenced, a FENCED error).

A Cancel carries only the order id: the cancel script reads the order's id key, in the same call,
for the instance, and adds the Cancel to that instance's stream. A cancel for an id this sink
never added (or whose id key expired) sets the cancel key only, and is added to no stream: an
agent holding such an order still finds the key before starting it. (The cancel script writes a
stream key it computes, not one passed in KEYS: fine on a single Redis, not on Redis Cluster.)

At least once past it: a consumer group gives each entry to one consumer, which acks it when the
order is done (completed or failed; the agent also reports progress as order_progress events). An
entry a consumer holds unacked for `claim_idle_seconds` (it died, or is stuck) is claimed by the
next consumer of the same instance to poll (XAUTOCLAIM) and handed out again. MAXLEN ~ trims
whole stream nodes (stream-node-max-entries, 100 by default), so each stream holds up to about
that many entries over the bound; entries trimmed before being read are lost, so size the bound
for one instance's backlog.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio as aredis

from app.deliver.base import OrderSink, SinkClosed, SinkError, SinkFenced, SinkUnavailable
from app.deliver.fence import Fence
from kvprefetch_client.orders import Cancel, Order

if TYPE_CHECKING:
    from app.core.config import Settings

GROUP = "kvp-agents"
# Messages per script call: keeps one call from holding Redis for long.
_CHUNK = 500

# A stream not there yet is made with its group (a stream that is there has it, or gets it at id 0
# from its first consumer, which then reads it all). Returns an error reply, which the script
# returns, when the key is not a stream: called before the id key is set, so that marks nothing.
# (TYPE, not XGROUP CREATE and a BUSYGROUP error per call: those would count in Redis's error
# stats.)
_ENSURE_GROUP = """
local ready = {}
local function ensure_group(stream)
  if ready[stream] then return nil end
  local kind = redis.call('TYPE', stream)['ok']
  if kind == 'none' then
    redis.call('XGROUP', 'CREATE', stream, ARGV[3], '0', 'MKSTREAM')
  elseif kind ~= 'stream' then
    return redis.error_reply('WRONGTYPE ' .. stream .. ' holds a ' .. kind .. ', not a stream')
  end
  ready[stream] = true
  return nil
end
"""

# With a planning lease (decisions.md, 23): ARGV[4] the lease's key ('' for none), ARGV[5] its
# value while the submitting replica holds it; anything else adds nothing (fencing).
_FENCE = """
if ARGV[4] ~= '' and redis.call('GET', ARGV[4]) ~= ARGV[5] then
  return redis.error_reply('FENCED the planning lease is not ' .. ARGV[5])
end
"""

# KEYS: per message, its stream then its order id key; ARGV[1] maxlen, ARGV[2] ttl seconds,
# ARGV[3] the group, ARGV[4..5] the fence, then per message its instance id then its JSON.
# Returns the 1-based positions of the messages added.
_SUBMIT = (
    _ENSURE_GROUP
    + _FENCE
    + """
local added = {}
for i = 1, #KEYS / 2 do
  local stream = KEYS[2 * i - 1]
  local failed = ensure_group(stream)
  if failed then return failed end
  if redis.call('SET', KEYS[2 * i], ARGV[4 + 2 * i], 'NX', 'EX', ARGV[2]) then
    redis.call('XADD', stream, 'MAXLEN', '~', ARGV[1], '*', 'msg', ARGV[5 + 2 * i])
    added[#added + 1] = i
  end
end
return added
"""
)

# KEYS: per message, its cancel key then its order id key; ARGV[1] maxlen, ARGV[2] ttl seconds,
# ARGV[3] the group, ARGV[4..5] the fence, ARGV[6] the streams' key up to the instance id, then
# per message its JSON. The stream is the one the order id key names (none when it is gone: the
# cancel key alone). Returns the 1-based positions of the messages whose cancel key it set.
_CANCEL = (
    _ENSURE_GROUP
    + _FENCE
    + """
local added = {}
for i = 1, #KEYS / 2 do
  local instance = redis.call('GET', KEYS[2 * i])
  local stream = nil
  if instance then
    stream = ARGV[6] .. instance
    local failed = ensure_group(stream)
    if failed then return failed end
  end
  if redis.call('SET', KEYS[2 * i - 1], '1', 'NX', 'EX', ARGV[2]) then
    if stream then
      redis.call('XADD', stream, 'MAXLEN', '~', ARGV[1], '*', 'msg', ARGV[6 + i])
    end
    added[#added + 1] = i
  end
end
return added
"""
)


def stream_key(prefix: str, instance_id: str) -> str:
    """The stream of one destination instance's orders and cancels."""
    return f"{prefix}:orders:{instance_id}"


def order_key(prefix: str, order_id: str) -> str:
    return f"{prefix}:order-ids:{order_id}"


def cancel_key(prefix: str, order_id: str) -> str:
    return f"{prefix}:cancel-ids:{order_id}"


class RedisStreamSink(OrderSink):
    """The producer, on redis.asyncio: it runs on the service's event loop."""

    name = "redis"
    fleet_wide = True

    @classmethod
    def from_settings(cls, settings: Settings, *, transport: Any = None) -> RedisStreamSink:
        return cls.from_url(
            settings.redis_url.get_secret_value(),
            settings.stream_prefix,
            timeout_seconds=settings.redis_timeout_seconds,
            maxlen=settings.order_stream_maxlen,
            dedupe_seconds=settings.order_dedupe_seconds,
        )

    def __init__(
        self,
        client: aredis.Redis,
        prefix: str,
        *,
        maxlen: int = 100_000,
        dedupe_seconds: int = 3600,
        owns_client: bool = True,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.maxlen = maxlen
        self.dedupe_seconds = max(1, int(dedupe_seconds))
        self._owns_client = owns_client
        self._submit = client.register_script(_SUBMIT)
        self._cancel = client.register_script(_CANCEL)
        self._closed = False
        # Set by the engine with a planning lease (app/deliver/fence.py).
        self.fence: Fence | None = None

    def _fence_args(self) -> list[str]:
        if self.fence is None:
            return ["", ""]
        # Checked here too, so a lapsed holder does not even call; the script checks Redis.
        return [self.fence.key, self.fence.check()]

    @classmethod
    def from_url(
        cls, url: str, prefix: str, *, timeout_seconds: float = 2.0, **kw: Any
    ) -> RedisStreamSink:
        client = aredis.Redis.from_url(
            url, socket_timeout=timeout_seconds, socket_connect_timeout=timeout_seconds
        )
        return cls(client, prefix, **kw)

    def stream_key(self, instance_id: str) -> str:
        return stream_key(self.prefix, instance_id)

    async def submit(self, orders: Sequence[Order]) -> list[str]:
        def call(chunk: list[Order]) -> tuple[list[Any], list[Any]]:
            keys: list[Any] = []
            args: list[Any] = [self.maxlen, self.dedupe_seconds, GROUP, *self._fence_args()]
            for o in chunk:
                keys += [self.stream_key(o.instance_id), order_key(self.prefix, o.order_id)]
                args += [o.instance_id, o.to_json()]
            return keys, args

        return await self._add(orders, self._submit, call)

    async def cancel(self, cancels: Sequence[Cancel]) -> list[str]:
        def call(chunk: list[Cancel]) -> tuple[list[Any], list[Any]]:
            keys: list[Any] = []
            for c in chunk:
                keys += [cancel_key(self.prefix, c.order_id), order_key(self.prefix, c.order_id)]
            args = [
                self.maxlen,
                self.dedupe_seconds,
                GROUP,
                *self._fence_args(),
                self.stream_key(""),
                *(c.to_json() for c in chunk),
            ]
            return keys, args

        return await self._add(cancels, self._cancel, call)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._owns_client:
                await self.client.aclose()

    async def _add(self, messages: Sequence[Any], script: Any, call: Any) -> list[str]:
        if self._closed:
            raise SinkClosed("the Redis stream order sink is closed")
        if not messages:
            return []
        # Repeats inside one call: the first one wins, as across calls; the order is kept.
        first: dict[str, Any] = {}
        for m in messages:
            first.setdefault(m.order_id, m)
        unique = list(first.values())
        added: list[str] = []
        try:
            for start in range(0, len(unique), _CHUNK):
                chunk = unique[start : start + _CHUNK]
                keys, args = call(chunk)
                positions = await script(keys=keys, args=args)
                added.extend(chunk[int(p) - 1].order_id for p in positions)
        except redis.ResponseError as exc:
            if str(exc).startswith("FENCED"):
                raise SinkFenced(str(exc)) from exc
            raise SinkError(
                f"Redis at {self._where()} failed adding to the streams "
                f"{self.stream_key('*')}: {exc}"
            ) from exc
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise SinkUnavailable(f"Redis at {self._where()} did not answer: {exc}") from exc
        except redis.RedisError as exc:
            raise SinkError(
                f"Redis at {self._where()} failed adding to the streams "
                f"{self.stream_key('*')}: {exc}"
            ) from exc
        return added

    def _where(self) -> str:
        kw = self.client.connection_pool.connection_kwargs
        return f"{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"
