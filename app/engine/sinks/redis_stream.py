"""RedisStreamSink (the producer) and RedisStreamConsumer (the agents' side) of one Redis stream.

The format, which agents read directly:

    stream  <prefix>:orders          one entry per message, a single field `msg`: the Order or
                                     Cancel JSON (`Order.to_json()`, `Cancel.to_json()`;
                                     `app.engine.orders.from_json` reads it); trimmed with
                                     XADD MAXLEN ~ <KVP_ORDER_STREAM_MAXLEN>
    group   kvp-agents               created at id 0 with MKSTREAM by whichever side comes first
    <prefix>:order-ids:<order_id>    "1", EX <KVP_ORDER_DEDUPE_SECONDS>: the order was added
    <prefix>:cancel-ids:<order_id>   "1", same TTL: the order was cancelled (consumers check it
                                     before handing an order out, so a cancel read by one agent
                                     stops the order read by another)

The service's `<prefix>` is KVP_ORDER_STREAM_PREFIX, by default `<KVP_REDIS_PREFIX>:sink`: the
state store already owns `<KVP_REDIS_PREFIX>:orders` (a set), so the stream cannot share its prefix.

Once per order id: a Lua script sets the id key with SET NX EX and, only when that set it, adds
the entry, both atomically, so a resubmission from this or any other replica, or after a restart,
within the window adds nothing; and no id is ever marked without its entry being added.

At least once past it: a consumer group gives each entry to one consumer, which acks it when the
order is done (completed or failed; the agent also reports progress as order_progress events). An
entry a consumer holds unacked for `claim_idle_seconds` (it died, or is stuck) is claimed by the
next consumer to poll (XAUTOCLAIM) and handed out again. MAXLEN ~ trims whole stream nodes
(stream-node-max-entries, 100 by default), so the stream holds up to about that many entries over
the bound; entries trimmed before being read are lost, so size the bound for the agents' backlog.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aredis
from pydantic import ValidationError

from app.engine.orders import Cancel, Order, from_json
from app.engine.sinks.base import SinkClosed, SinkError, SinkUnavailable

log = logging.getLogger(__name__)

GROUP = "kvp-agents"
FIELD = "msg"
# Messages per script call: keeps one call from holding Redis for long.
_CHUNK = 500

# KEYS[1] the stream, KEYS[2..] one id key per message; ARGV[1] maxlen, ARGV[2] ttl seconds,
# ARGV[3..] the messages. Returns the 1-based positions of the messages added.
_ADD_ONCE = """
local added = {}
for i = 2, #KEYS do
  if redis.call('SET', KEYS[i], '1', 'NX', 'EX', ARGV[2]) then
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'msg', ARGV[i + 1])
    added[#added + 1] = i - 1
  end
end
return added
"""


def stream_key(prefix: str) -> str:
    return f"{prefix}:orders"


def order_key(prefix: str, order_id: str) -> str:
    return f"{prefix}:order-ids:{order_id}"


def cancel_key(prefix: str, order_id: str) -> str:
    return f"{prefix}:cancel-ids:{order_id}"


def _busygroup(exc: redis.ResponseError) -> bool:
    return str(exc).startswith("BUSYGROUP")


class RedisStreamSink:
    """The producer, on redis.asyncio: it runs on the service's event loop."""

    def __init__(self, client: aredis.Redis, prefix: str, *, maxlen: int = 100_000,
                 dedupe_seconds: int = 3600, owns_client: bool = True) -> None:
        self.client = client
        self.prefix = prefix
        self.key = stream_key(prefix)
        self.maxlen = maxlen
        self.dedupe_seconds = max(1, int(dedupe_seconds))
        self._owns_client = owns_client
        self._add_once = client.register_script(_ADD_ONCE)
        self._group_ready = False
        self._closed = False

    @classmethod
    def from_url(cls, url: str, prefix: str, *, timeout_seconds: float = 2.0, **kw: Any) -> RedisStreamSink:
        client = aredis.Redis.from_url(url, socket_timeout=timeout_seconds,
                                       socket_connect_timeout=timeout_seconds)
        return cls(client, prefix, **kw)

    async def submit(self, orders: Sequence[Order]) -> list[str]:
        return await self._add(orders, order_key)

    async def cancel(self, cancels: Sequence[Cancel]) -> list[str]:
        return await self._add(cancels, cancel_key)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._owns_client:
                await self.client.aclose()

    async def _add(self, messages: Sequence[Order | Cancel], key_of: Any) -> list[str]:
        if self._closed:
            raise SinkClosed("the Redis stream order sink is closed")
        if not messages:
            return []
        # Repeats inside one call: the first one wins, as across calls.
        unique = list({m.order_id: m for m in reversed(messages)}.values())[::-1]
        added: list[str] = []
        try:
            await self._ensure_group()
            for start in range(0, len(unique), _CHUNK):
                chunk = unique[start:start + _CHUNK]
                keys = [self.key, *(key_of(self.prefix, m.order_id) for m in chunk)]
                args = [self.maxlen, self.dedupe_seconds, *(m.to_json() for m in chunk)]
                positions = await self._add_once(keys=keys, args=args)
                added.extend(chunk[int(p) - 1].order_id for p in positions)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise SinkUnavailable(f"Redis at {self._where()} did not answer: {exc}") from exc
        except redis.RedisError as exc:
            raise SinkError(f"Redis at {self._where()} failed adding to {self.key}: {exc}") from exc
        return added

    async def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            await self.client.xgroup_create(self.key, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if not _busygroup(exc):
                raise
        self._group_ready = True

    def _where(self) -> str:
        kw = self.client.connection_pool.connection_kwargs
        return f"{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"


@dataclass(frozen=True, slots=True)
class StreamEntry:
    entry_id: str
    message: Order | Cancel
    # Taken over from a consumer that held it past claim_idle_seconds: it may have started it.
    claimed: bool = False


class RedisStreamConsumer:
    """One agent's side of the stream, on synchronous redis-py.

    `poll()` first claims entries other consumers have held unacked past `claim_idle_seconds`,
    then reads new ones. It hands out Orders and Cancels; an order already cancelled (its
    cancel key exists, whoever read the Cancel) is acked and skipped, and so is an entry that is
    not a valid message (logged). `ack()` an entry when its order is done, or at once for a
    Cancel (drop the order if it is queued here and not started; one moving finishes). Delivery
    is at least once: an entry can come back (claimed after this consumer stalled, or to a
    restarted consumer under the same name after claim_idle_seconds), so run an order id once.
    """

    def __init__(self, client: redis.Redis, prefix: str, consumer: str, *,
                 claim_idle_seconds: float = 30.0, group: str = GROUP) -> None:
        self.client = client
        self.prefix = prefix
        self.key = stream_key(prefix)
        self.consumer = consumer
        self.group = group
        self.claim_idle_ms = max(1, int(claim_idle_seconds * 1000))
        self.stats = {"read": 0, "claimed": 0, "skipped_cancelled": 0, "malformed": 0, "acked": 0}
        self._claim_cursor = "0-0"
        # Entries this consumer handed out and has not acked: a claim of one of them (this
        # consumer was slow, not dead) must not hand it out a second time.
        self._held: set[str] = set()
        self._group_ready = False

    @classmethod
    def from_url(cls, url: str, prefix: str, consumer: str, **kw: Any) -> RedisStreamConsumer:
        return cls(redis.Redis.from_url(url), prefix, consumer, **kw)

    def poll(self, count: int = 100, block_ms: int | None = None) -> list[StreamEntry]:
        """Up to `count` entries; waits up to `block_ms` for new ones when none is there
        (None: does not wait)."""
        self._ensure_group()
        entries = self._claim(count)
        if len(entries) < count:
            block = block_ms if not entries else None
            reply = self.client.xreadgroup(self.group, self.consumer, {self.key: ">"},
                                           count=count - len(entries), block=block)
            for _stream, items in reply or []:
                for entry_id, fields in items:
                    entries.append((_text(entry_id), fields, False))
                    self.stats["read"] += 1
        return self._hand_out(entries)

    def ack(self, entry_id: str) -> bool:
        """Mark an entry done; False when it was already acked (by this or another consumer)."""
        self._held.discard(entry_id)
        done = bool(self.client.xack(self.key, self.group, entry_id))
        self.stats["acked"] += done
        return done

    def is_cancelled(self, order_id: str) -> bool:
        """Whether a Cancel for this order was issued (check again right before starting it)."""
        return bool(self.client.exists(cancel_key(self.prefix, order_id)))

    def pending(self) -> int:
        """Entries of the group delivered and not acked, all consumers together."""
        return int(self.client.xpending(self.key, self.group)["pending"])

    def close(self) -> None:
        self.client.close()

    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            self.client.xgroup_create(self.key, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if not _busygroup(exc):
                raise
        self._group_ready = True

    def _claim(self, count: int) -> list[tuple[str, Any, bool]]:
        # Redis 7 answers [next cursor, entries, ids deleted by trimming]; the cursor walks the
        # pending list across polls, so each poll claims a page and none rescans from the start.
        reply = self.client.xautoclaim(self.key, self.group, self.consumer, self.claim_idle_ms,
                                       start_id=self._claim_cursor, count=count)
        cursor, items = reply[0], reply[1]
        self._claim_cursor = _text(cursor)
        claimed = []
        for entry_id, fields in items:
            entry_id = _text(entry_id)
            if entry_id in self._held or fields is None:
                continue
            claimed.append((entry_id, fields, True))
            self.stats["claimed"] += 1
        return claimed

    def _hand_out(self, raw: list[tuple[str, Any, bool]]) -> list[StreamEntry]:
        entries: list[StreamEntry] = []
        drop: list[str] = []
        for entry_id, fields, claimed in raw:
            data = _field(fields)
            try:
                if data is None:
                    raise ValueError(f"no {FIELD!r} field")
                message = from_json(data)
            except (ValueError, ValidationError) as exc:
                log.warning("stream %s entry %s is not an order or cancel, acked and skipped: %s",
                            self.key, entry_id, exc)
                self.stats["malformed"] += 1
                drop.append(entry_id)
                continue
            entries.append(StreamEntry(entry_id, message, claimed))
        orders = [e for e in entries if isinstance(e.message, Order)]
        if orders:
            with self.client.pipeline(transaction=False) as pipe:
                for e in orders:
                    pipe.exists(cancel_key(self.prefix, e.message.order_id))
                cancelled = {e.entry_id for e, hit in zip(orders, pipe.execute()) if hit}
            if cancelled:
                self.stats["skipped_cancelled"] += len(cancelled)
                drop.extend(cancelled)
                entries = [e for e in entries if e.entry_id not in cancelled]
        if drop:
            self.client.xack(self.key, self.group, *drop)
        self._held.update(e.entry_id for e in entries)
        return entries


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _field(fields: Any) -> bytes | str | None:
    if not fields:
        return None
    return fields.get(FIELD.encode(), fields.get(FIELD)) if isinstance(fields, dict) else None
