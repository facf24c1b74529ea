"""The fleet's accepted events, shared among replicas for planning (decisions.md, 23).

    <prefix>:feed    a stream; one entry per accepted batch: `replica` (its KVP_REPLICA_ID and
                     process id: each worker of a replica reads its siblings' batches) and
                     `events` (a JSON array of the accepted events); MAXLEN ~ FEED_MAXLEN

Each replica applies what it accepts to the shared store, but the planning side (the scorer's
arrivals, the route tracker, the scheduler's feedback: order progress, a session routed or
closed) learns from the accepted events themselves. With several replicas each adds its
accepted batches here (on the store thread, after the apply) and every replica reads the others'
into its planning-side observers, so whichever plans, and whichever takes over, knows what the
whole fleet saw. The ledger, outcomes and metrics stay per replica: fed only what the replica
accepted itself, so their counters add up across replicas without counting an event twice.
What a replica applied from the feed is counted apart (kvprefetch_fleet_feed_applied_*_total):
on the planner its rate against the others' ingest says whether it keeps up (decisions.md, 30).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import orjson
import redis
import redis.asyncio as aredis

from kvprefetch_client.events import Event, event_adapter

log = logging.getLogger(__name__)

# Entries (batches) kept: a replica further behind than this misses what was trimmed (counted).
FEED_MAXLEN = 100_000
READ_BATCHES = 100
READ_BLOCK_MS = 200


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def feed_key(prefix: str) -> str:
    return f"{prefix}:feed"


def feed_entry(replica: str, events: Sequence[Event]) -> dict[str, str | bytes]:
    """One accepted batch's entry, as `publish` adds it (and `kvprefetch bench planner`)."""
    data = orjson.dumps([e.model_dump(mode="json", exclude_none=True) for e in events])
    return {"replica": replica, "events": data}


class FleetFeed:
    """`publish` (sync, on the store thread) and `read` (async, on the event loop)."""

    def __init__(self, url: str, prefix: str, replica_id: str, *, timeout_seconds: float) -> None:
        self.key = feed_key(prefix)
        self.replica_id = replica_id
        self._sync = redis.Redis.from_url(
            url, socket_timeout=timeout_seconds, socket_connect_timeout=timeout_seconds
        )
        # The read blocks up to READ_BLOCK_MS on the server: its timeout is beyond that.
        self._async = aredis.Redis.from_url(
            url,
            socket_timeout=timeout_seconds + READ_BLOCK_MS / 1000,
            socket_connect_timeout=timeout_seconds,
        )
        self._last = "$"
        self.published = 0
        self.read_events = 0
        self.read_batches = 0  # the other replicas' entries read (and readable)
        self.unpublished = 0

    def publish(self, events: Sequence[Event]) -> None:
        """Add this replica's accepted `events`; an unavailable Redis loses them for the others'
        planning only (logged, counted): they are applied and logged already."""
        if not events:
            return
        fields: Any = feed_entry(self.replica_id, events)
        try:
            self._sync.xadd(
                self.key,
                fields,
                maxlen=FEED_MAXLEN,
                approximate=True,
            )
            self.published += len(events)
        except redis.RedisError as exc:
            self.unpublished += len(events)
            log.warning("%d accepted events not shared with the fleet: %s", len(events), exc)

    async def read(self) -> list[Event]:
        """The other replicas' events added since the last read (waits up to READ_BLOCK_MS);
        the first read starts from the stream's end as it is then."""
        if self._last == "$":
            newest: Any = await self._async.xrevrange(self.key, count=1)
            self._last = _text(newest[0][0]) if newest else "0-0"
        answer: Any = await self._async.xread(
            {self.key: self._last}, count=READ_BATCHES, block=READ_BLOCK_MS
        )
        out: list[Event] = []
        for _, entries in answer or ():
            for entry_id, fields in entries:
                self._last = _text(entry_id)
                if fields.get(b"replica", b"").decode() == self.replica_id:
                    continue
                try:
                    out += [
                        event_adapter.validate_python(e) for e in orjson.loads(fields[b"events"])
                    ]
                    self.read_batches += 1
                except (ValueError, KeyError) as exc:  # bad input: logged, never a crash
                    log.warning("feed entry %s unreadable: %s", self._last, exc)
        self.read_events += len(out)
        return out

    async def close(self) -> None:
        self._sync.close()
        await self._async.aclose()
