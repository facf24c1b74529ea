"""The embedded in-memory store: one process, rebuilt from the event log on restart.

Kept small on purpose (at most 2 KB per tracked session): the session records and what each
event does to them are the session rules' (app/state/rules.py); this module keeps them indexed,
deduplicates events and forgets what retention drops.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from app.state.base import (
    HoldsQuery,
    InstanceView,
    Location,
    LocationView,
    LogPosition,
    OrderView,
    PresentQuery,
    RequestView,
    SessionContext,
    SessionCursor,
    SessionView,
    SignalView,
    StateStore,
    location_name,
)
from app.state.rules import (
    NONE,
    RequestRecord,
    SessionRecord,
    SignalEntry,
    latest_context_tokens,
    retention_cutoff,
    signal_entry,
    tombstone_floor,
)
from kvprefetch_client.events import (
    MAX_BLOCKS_PER_EVENT,
    RECORD_EVENT_TYPES,
    BlockHash,
    Event,
    InstanceStatus,
    KvBlocksCleared,
    KvBlocksRemoved,
    KvBlocksStored,
    OrderProgress,
    RequestFinished,
    RequestRouted,
    RequestStarted,
    SessionClosed,
    SessionSignal,
    Tier,
    VllmKvEvents,
)

_ORDER_RANK = {"accepted": 0, "completed": 1, "failed": 1}
# An order's record: (rank, status ts, status, bytes, seconds, reason, last activity ts); the
# first three decide which progress event wins, the last when the order is forgotten.
_OrderRecord = tuple[int, float, str, "int | None", "float | None", "str | None", float]
_INSTANCE_TIERS = ("hbm", "host", "disk")


class _Location:
    """Residency of one location, and its tombstones: a removal's ts per block, so that a store
    older than it, arriving late, stays a no-op.

    A tombstone is in force while `ts >= newest - window` (`newest`: the newest event of this
    location); lookups ignore a dead one, and one dead on arrival is not kept. The dead are
    dropped a generation at a time: `removed` takes new tombstones, `removed_old` holds the
    previous generation, and once all of `removed_old` is dead (every one is at most `old_bound`)
    it goes and `removed` takes its place. No dict deletes from its front (that scans a growing
    run of freed slots), so each tombstone costs O(1); one is held between about one and two
    windows of this location's event time.
    """

    __slots__ = (
        "block_tokens",
        "cleared_ts",
        "newest",
        "old_bound",
        "present",
        "removed",
        "removed_old",
        "window",
    )

    def __init__(self, block_tokens: int, window: float) -> None:
        self.present: dict[BlockHash, float] = {}
        self.removed: dict[BlockHash, float] = {}
        self.removed_old: dict[BlockHash, float] = {}
        self.old_bound = -math.inf  # no tombstone of removed_old is newer
        self.newest = -math.inf  # the newest ts of an event at this location
        self.window = window
        self.cleared_ts = NONE
        self.block_tokens = block_tokens

    def advance(self, ts: float) -> None:
        if ts <= self.newest:
            return
        previous, self.newest = self.newest, ts
        cutoff = tombstone_floor(ts, self.window)
        if self.old_bound < cutoff:
            # Every tombstone so far is at most `previous` (a tombstone is never newer than the
            # location's newest event), so both generations may be dead.
            if previous < cutoff:
                self.removed, self.removed_old = {}, {}
            else:
                self.removed, self.removed_old = {}, self.removed
            self.old_bound = previous

    def store(self, block_hashes: Sequence[BlockHash], ts: float) -> None:
        self.advance(ts)
        if ts <= self.cleared_ts:
            return
        present, removed, removed_old = self.present, self.removed, self.removed_old
        cutoff = tombstone_floor(self.newest, self.window)
        for h in block_hashes:
            t = removed.get(h)
            if t is None and removed_old:
                t = removed_old.get(h)
            if t is not None:
                if ts <= t and t >= cutoff:
                    continue
                removed.pop(h, None)
                removed_old.pop(h, None)
            if ts > present.get(h, NONE):
                present[h] = ts

    def remove(self, block_hashes: Sequence[BlockHash], ts: float) -> None:
        self.advance(ts)
        present, removed, removed_old = self.present, self.removed, self.removed_old
        # A tombstone dead on arrival would never be consulted: don't keep it.
        keep = ts >= tombstone_floor(self.newest, self.window)
        for h in block_hashes:
            stored = present.get(h)
            if stored is not None:
                if stored > ts:
                    continue
                del present[h]
            if not keep:
                continue
            t = removed.get(h)
            if t is not None:
                if ts > t:
                    removed[h] = ts
                continue
            t = removed_old.get(h) if removed_old else None
            if t is None or ts > t:
                removed[h] = ts
                if t is not None:
                    del removed_old[h]  # removed_old's tombstones never move past old_bound

    def clear(self, ts: float) -> None:
        self.advance(ts)
        if ts <= self.cleared_ts:
            return
        self.cleared_ts = ts
        self.present = {h: t for h, t in self.present.items() if t > ts}
        # Tombstones older than the clear are implied by it.
        self.removed = {h: t for h, t in self.removed.items() if t > ts}
        self.removed_old = {h: t for h, t in self.removed_old.items() if t > ts}


class _Instance:
    __slots__ = (
        "free_kv_bytes",
        "last_seen_ts",
        "queue_depth",
        "running_requests",
        "status_ts",
        "total_kv_bytes",
    )

    def __init__(self, ts: float) -> None:
        self.last_seen_ts = ts
        self.status_ts = NONE
        self.free_kv_bytes: int | None = None
        self.total_kv_bytes: int | None = None
        self.queue_depth: int | None = None
        self.running_requests: int | None = None


class MemoryStore(StateStore):
    def __init__(
        self,
        *,
        bytes_per_token: int,
        block_tokens: int,
        dedupe_max_ids: int = 2_000_000,
        reorder_window_seconds: float = math.inf,
        session_retention_seconds: float = math.inf,
        max_instances: int | None = None,
        instance_retention_seconds: float = math.inf,
    ) -> None:
        if dedupe_max_ids < 1 or reorder_window_seconds <= 0 or session_retention_seconds <= 0:
            raise ValueError("dedupe_max_ids and both windows must be positive")
        if (max_instances is not None and max_instances < 1) or instance_retention_seconds <= 0:
            raise ValueError("max_instances and instance_retention_seconds must be positive")
        self.bytes_per_token = bytes_per_token
        self.block_tokens = block_tokens
        self.dedupe_max_ids = dedupe_max_ids
        self.reorder_window_seconds = reorder_window_seconds
        self.session_retention_seconds = session_retention_seconds
        self.max_instances = max_instances
        self.instance_retention_seconds = instance_retention_seconds
        # The dedupe ring in two generations of sets: ids go to _seen, which becomes _seen_old
        # when it holds _seen_half; so the last _seen_half ids at least, and at most
        # dedupe_max_ids, are remembered. A replaced _seen_old is freed a few ids per event
        # (_dying) rather than at once: freeing a million strings is a 50 ms pause.
        self._seen_half = (dedupe_max_ids + 1) // 2
        self._seen: set[str] = set()
        self._seen_old: set[str] = set()
        self._dying: set[str] = set()
        # The newest event ts applied, and the sessions' cutoff it makes: a session last active
        # before the cutoff is forgotten.
        self._newest = -math.inf
        self._cutoff = -math.inf
        # The instances' cutoff: an instance last heard of before it is forgotten, locations too.
        self._icutoff = -math.inf
        self._sessions: dict[str, SessionRecord] = {}
        # Sessions by the whole second of their last activity, and those seconds in order: what
        # live_sessions() reads newest first. A session moves only when its activity crosses into
        # another second, so most events cost the index one int() and a comparison.
        self._by_second: dict[int, set[str]] = {}
        self._seconds: list[int] = []
        self._instances: dict[str, _Instance] = {}
        self._locations: dict[tuple[str, str | None], _Location] = {}
        self._orders: dict[str, _OrderRecord] = {}
        # Orders by the whole second of their last activity, and those seconds in order: what
        # expiry reads oldest first (the sessions' index, for orders).
        self._orders_by_second: dict[int, set[str]] = {}
        self._order_seconds: list[int] = []
        # Instance ids in order, for the pages of instances().
        self._instance_ids: list[str] = []
        # Instances by the whole second they were last heard of (the sessions' index, for
        # instances), and location names in order, for the pages of locations().
        self._instances_by_second: dict[int, set[str]] = {}
        self._instance_seconds: list[int] = []
        self._location_names: list[str] = []
        # Blocks held over every location, kept as they change: stats() costs no pass over them.
        self._resident = 0
        self._checkpoints: dict[str, LogPosition] = {}
        # Each handler takes its own event type; the dispatch on `type` is what narrows.
        self._apply_one: dict[str, Callable[[Any], None]] = {
            "request_routed": self._routed,
            "request_started": self._started,
            "request_finished": self._finished,
            "session_closed": self._closed,
            "session_signal": self._signal,
            "kv_blocks_stored": self._stored,
            "kv_blocks_removed": self._removed,
            "kv_blocks_cleared": self._cleared,
            "vllm_kv_events": self._vllm,
            "instance_status": self._status,
            "order_progress": self._order,
            # A record for the log's readers (app/predict/lifecycle.py): no state follows it.
            "model_changed": _no_state,
        }

    # -- ingestion -------------------------------------------------------------------------

    def seen(self, event_ids: Sequence[str]) -> list[bool]:
        seen, old = self._seen, self._seen_old
        return [e in seen or e in old for e in event_ids]

    def seen_and_newest(self, event_ids: Sequence[str]) -> tuple[list[bool], float]:
        return self.seen(event_ids), self._newest

    def apply(self, events: Sequence[Event]) -> list[bool]:
        seen, old, half, apply_one = self._seen, self._seen_old, self._seen_half, self._apply_one
        out: list[bool] = []
        for e in events:
            eid = e.event_id
            if eid in seen or eid in old:
                out.append(False)
                continue
            ts = e.ts
            if ts > self._newest and e.type not in RECORD_EVENT_TYPES:
                self._newest = ts
                self._cutoff = retention_cutoff(ts, self.session_retention_seconds)
                self._icutoff = retention_cutoff(ts, self.instance_retention_seconds)
            apply_one[e.type](e)
            seen.add(eid)
            out.append(True)
            if len(seen) >= half:
                if self._dying:
                    self._dying.clear()  # not drained in time (a tiny ring): free it now
                self._dying, old = old, seen
                self._seen_old, self._seen = old, set()
                seen = self._seen
        dying = self._dying
        if dying:
            # Two per id added: empty before _seen is half full again.
            for _ in range(min(len(dying), 2 * len(events))):
                dying.pop()
            if not dying:
                self._dying = set()  # set.pop never shrinks the table: let the emptied one go
        if self._seconds and self._seconds[0] + 1 <= self._cutoff:
            self._expire_sessions()
        if self._order_seconds and self._order_seconds[0] + 1 <= self._cutoff:
            self._expire_orders()
        if self._instance_seconds and self._instance_seconds[0] + 1 <= self._icutoff:
            self._expire_instances()
        return out

    def _expire_instances(self) -> None:
        """_expire_sessions for instances, their locations with them."""
        seconds, by_second = self._instance_seconds, self._instances_by_second
        n = bisect.bisect_right(seconds, math.floor(self._icutoff) - 1)
        for second in seconds[:n]:
            for instance_id in by_second.pop(second):
                self._drop_instance(instance_id)
        del seconds[:n]

    def _drop_instance(self, instance_id: str) -> None:
        """An instance and its locations gone (its index entry is the caller's)."""
        del self._instances[instance_id]
        ids = self._instance_ids
        del ids[bisect.bisect_left(ids, instance_id)]
        for tier in _INSTANCE_TIERS:
            loc = self._locations.pop((tier, instance_id), None)
            if loc is not None:
                self._resident -= len(loc.present)
                names = self._location_names
                del names[bisect.bisect_left(names, location_name(tier, instance_id))]

    def _forget_instance(self, instance_id: str, last_seen_ts: float) -> None:
        self._drop_instance(instance_id)
        second = int(last_seen_ts)
        members = self._instances_by_second[second]
        members.discard(instance_id)
        if not members:
            del self._instances_by_second[second]
            del self._instance_seconds[bisect.bisect_left(self._instance_seconds, second)]

    def _index_instance(self, instance_id: str, old_ts: float | None, ts: float) -> None:
        """Move an instance to the second it was last heard of."""
        by_second, seconds = self._instances_by_second, self._instance_seconds
        members: set[str] | None
        if old_ts is not None:
            old = int(old_ts)
            members = by_second[old]
            members.discard(instance_id)
            if not members:
                del by_second[old]
                del seconds[bisect.bisect_left(seconds, old)]
        second = int(ts)
        members = by_second.get(second)
        if members is None:
            members = by_second[second] = set()
            bisect.insort(seconds, second)
        members.add(instance_id)

    def _stale_instances(self, cutoff: float | None = None) -> list[str]:
        """The instances forgotten but not dropped yet (after _expire_instances, only the
        cutoff's own second holds any), or those a later `cutoff` would forget."""
        instances, by_second = self._instances, self._instances_by_second
        cutoff = self._icutoff if cutoff is None else max(cutoff, self._icutoff)
        if cutoff == -math.inf:
            return []
        n = bisect.bisect_right(self._instance_seconds, math.floor(cutoff))
        return [
            instance_id
            for second in self._instance_seconds[:n]
            for instance_id in by_second[second]
            if instances[instance_id].last_seen_ts < cutoff
        ]

    def _live_instance_count(self) -> int:
        self._expire_instances()
        return len(self._instances) - len(self._stale_instances())

    def known_instances(
        self, instance_ids: Sequence[str], newest_ts: float | None = None
    ) -> tuple[list[bool], int]:
        cutoff = self._icutoff
        if newest_ts is not None:
            cutoff = max(cutoff, retention_cutoff(newest_ts, self.instance_retention_seconds))
        instances = self._instances
        known = [
            (i := instances.get(x)) is not None and i.last_seen_ts >= cutoff for x in instance_ids
        ]
        return known, len(instances) - len(self._stale_instances(cutoff))

    def _held_at(self, key: tuple[str, str | None]) -> _Location | None:
        """The location, unless its instance is forgotten (a whole second is dropped at once:
        the cutoff's own may still hold it)."""
        loc = self._locations.get(key)
        if loc is None or key[1] is None:
            return loc
        i = self._instances.get(key[1])
        return loc if i is not None and i.last_seen_ts >= self._icutoff else None

    def _instance_live(self, instance_id: str | None) -> bool:
        if instance_id is None:
            return True
        i = self._instances.get(instance_id)
        return i is not None and i.last_seen_ts >= self._icutoff

    def _expire_orders(self) -> None:
        """_expire_sessions for orders: forget those last active in a whole second before the
        cutoff's."""
        seconds, by_second, orders = self._order_seconds, self._orders_by_second, self._orders
        n = bisect.bisect_right(seconds, math.floor(self._cutoff) - 1)
        for second in seconds[:n]:
            for order_id in by_second.pop(second):
                del orders[order_id]
        del seconds[:n]

    def _index_order(self, order_id: str, old_ts: float | None, ts: float) -> None:
        """Move an order to the second of its new last activity."""
        by_second, seconds = self._orders_by_second, self._order_seconds
        members: set[str] | None
        if old_ts is not None:
            old = int(old_ts)
            if old == int(ts):
                return
            members = by_second[old]
            members.discard(order_id)
            if not members:
                del by_second[old]
                del seconds[bisect.bisect_left(seconds, old)]
        second = int(ts)
        members = by_second.get(second)
        if members is None:
            members = by_second[second] = set()
            bisect.insort(seconds, second)
        members.add(order_id)

    def _expire_sessions(self) -> None:
        """Forget every session whose whole second of last activity is before the cutoff; the
        second holding the cutoff is left to the reads' filter."""
        seconds, by_second, sessions = self._seconds, self._by_second, self._sessions
        n = bisect.bisect_right(seconds, math.floor(self._cutoff) - 1)
        for second in seconds[:n]:
            for session_id in by_second.pop(second):
                del sessions[session_id]
        del seconds[:n]

    def _live(self, session_id: str) -> SessionRecord | None:
        """The session unless it is unknown or forgotten (idle since before the cutoff)."""
        s = self._sessions.get(session_id)
        return s if s is not None and s.last_ts >= self._cutoff else None

    def _forget(self, session_id: str) -> None:
        s = self._sessions.pop(session_id)
        second = int(s.last_ts)
        members = self._by_second[second]
        members.discard(session_id)
        if not members:
            del self._by_second[second]
            del self._seconds[bisect.bisect_left(self._seconds, second)]

    def _session(self, session_id: str, ts: float, *, signal: bool = False) -> SessionRecord | None:
        """The session an event at `ts` updates; None when the event is itself older than the
        cutoff (it is about a past the store has forgotten, or is about to). A signal (`signal`)
        leaves the times to SessionRecord.signal; any other event touches them."""
        if ts < self._cutoff:
            return None
        s = self._sessions.get(session_id)
        if s is not None and s.last_ts < self._cutoff:
            self._forget(session_id)  # forgotten: a new event starts it afresh
            s = None
        if s is None:
            s = self._sessions[session_id] = SessionRecord(ts, signal_only=signal)
            self._index(session_id, None, ts)
        elif not signal:
            old = s.last_ts
            s.touch(ts)
            if int(s.last_ts) != int(old):
                self._index(session_id, old, s.last_ts)
        return s

    def _index(self, session_id: str, old_ts: float | None, ts: float) -> None:
        """Move a session to the second of its new last activity (every ts is >= 0: int floors)."""
        by_second = self._by_second
        members: set[str] | None
        if old_ts is not None:
            old = int(old_ts)
            members = by_second[old]
            members.discard(session_id)
            if not members:
                del by_second[old]
                seconds = self._seconds
                del seconds[bisect.bisect_left(seconds, old)]
        second = int(ts)
        members = by_second.get(second)
        if members is None:
            members = by_second[second] = set()
            bisect.insort(self._seconds, second)
        members.add(session_id)

    def _instance(self, instance_id: str, ts: float) -> _Instance | None:
        """The instance an event at `ts` names, heard of now. None: the store holds
        `max_instances` others, so the event is ignored whole (the ingestor refuses it first).
        One not heard of since before the cutoff is forgotten, its locations too, and starts
        afresh."""
        i = self._instances.get(instance_id)
        if i is not None and i.last_seen_ts < self._icutoff:
            self._forget_instance(instance_id, i.last_seen_ts)
            i = None
        if i is None:
            cap = self.max_instances
            if (
                cap is not None
                and len(self._instances) >= cap
                and self._live_instance_count() >= cap
            ):
                return None
            i = self._instances[instance_id] = _Instance(ts)
            bisect.insort(self._instance_ids, instance_id)
            self._index_instance(instance_id, None, ts)
        elif ts > i.last_seen_ts:
            if int(ts) != int(i.last_seen_ts):
                self._index_instance(instance_id, i.last_seen_ts, ts)
            i.last_seen_ts = ts
        return i

    def _request_event(
        self,
        e: RequestRouted | RequestStarted | RequestFinished,
    ) -> tuple[SessionRecord, RequestRecord] | None:
        """What every request event does: touch its session and instance, find its request
        (SessionRecord.request). None: the event is about a forgotten session (see _session),
        and only the instance is touched; or its instance is refused (see _instance).

        The session's touch is inlined for a live session: this runs for most events on the
        ingest path.
        """
        ts = e.ts
        instance = self._instances.get(e.instance_id)
        if instance is None or instance.last_seen_ts < self._icutoff:
            if self._instance(e.instance_id, ts) is None:
                return None
        elif ts > instance.last_seen_ts:
            if int(ts) != int(instance.last_seen_ts):
                self._index_instance(e.instance_id, instance.last_seen_ts, ts)
            instance.last_seen_ts = ts
        s = self._sessions.get(e.session_id)
        if s is None or s.last_ts < self._cutoff or ts < self._cutoff or s.signal_only:
            s = self._session(e.session_id, ts)
            if s is None:
                return None
        elif ts > s.last_ts:
            if int(ts) != int(s.last_ts):
                self._index(e.session_id, s.last_ts, ts)
            s.last_ts = ts
        elif ts < s.first_ts:
            s.first_ts = ts
        return s, s.request(e.request_id, e.instance_id, ts)

    def _routed(self, e: RequestRouted) -> None:
        sr = self._request_event(e)
        if sr is not None:
            sr[0].routed(
                sr[1], e.ts, e.prompt_tokens, e.block_hashes, e.block_tokens or self.block_tokens
            )

    def _started(self, e: RequestStarted) -> None:
        sr = self._request_event(e)
        if sr is not None:
            sr[0].started(sr[1], e.ts)

    def _finished(self, e: RequestFinished) -> None:
        sr = self._request_event(e)
        if sr is not None:
            sr[0].finished(
                sr[1],
                e.ts,
                e.output_tokens,
                e.context_tokens,
                e.block_hashes,
                e.block_tokens or self.block_tokens,
            )

    def _closed(self, e: SessionClosed) -> None:
        s = self._session(e.session_id, e.ts)
        if s is not None:
            s.closed(e.ts)

    def _signal(self, e: SessionSignal) -> None:
        s = self._session(e.session_id, e.ts, signal=True)
        if s is not None:
            old = s.last_ts
            s.signal(signal_entry(e))
            if int(s.last_ts) != int(old):
                self._index(e.session_id, old, s.last_ts)

    def _location(self, tier: str, instance_id: str | None, block_tokens: int | None) -> _Location:
        key = (tier, instance_id)
        loc = self._locations.get(key)
        if loc is None:
            loc = self._locations[key] = _Location(
                block_tokens or self.block_tokens, self.reorder_window_seconds
            )
            bisect.insort(self._location_names, location_name(tier, instance_id))
        elif block_tokens:
            loc.block_tokens = block_tokens
        return loc

    def _stored(self, e: KvBlocksStored) -> None:
        if e.instance_id is not None and self._instance(e.instance_id, e.ts) is None:
            return
        loc = self._location(e.tier, e.instance_id, e.block_tokens)
        held = len(loc.present)
        loc.store(e.block_hashes, e.ts)
        self._resident += len(loc.present) - held
        if e.session_id is not None and e.tier == "hbm" and e.ts >= self._cutoff:
            s = self._sessions.get(e.session_id)
            # Only a session the router started, not forgotten: an engine's blocks start none.
            if s is not None and not s.signal_only and s.last_ts >= self._cutoff:
                s.join_blocks(
                    e.parent_block_hash,
                    e.block_hashes,
                    e.block_tokens or self.block_tokens,
                    e.ts,
                    MAX_BLOCKS_PER_EVENT,
                )

    def _removed(self, e: KvBlocksRemoved) -> None:
        if e.instance_id is not None and self._instance(e.instance_id, e.ts) is None:
            return
        loc = self._location(e.tier, e.instance_id, None)
        held = len(loc.present)
        loc.remove(e.block_hashes, e.ts)
        self._resident += len(loc.present) - held

    def _cleared(self, e: KvBlocksCleared) -> None:
        if e.instance_id is not None and self._instance(e.instance_id, e.ts) is None:
            return
        loc = self._location(e.tier, e.instance_id, None)
        held = len(loc.present)
        loc.clear(e.ts)
        self._resident += len(loc.present) - held

    def _vllm(self, e: VllmKvEvents) -> None:
        for sub in e.expand():
            self._apply_one[sub.type](sub)

    def _status(self, e: InstanceStatus) -> None:
        i = self._instance(e.instance_id, e.ts)
        if i is not None and e.ts >= i.status_ts:
            i.status_ts = e.ts
            i.free_kv_bytes, i.total_kv_bytes = e.free_kv_bytes, e.total_kv_bytes
            i.queue_depth, i.running_requests = e.queue_depth, e.running_requests

    def _order(self, e: OrderProgress) -> None:
        ts, order_id = e.ts, e.order_id
        if ts < self._cutoff:
            return  # about a past the store has forgotten, as for sessions
        orders = self._orders
        old = orders.get(order_id)
        if old is not None and old[6] < self._cutoff:
            self._forget_order(order_id, old[6])  # forgotten: this event starts it afresh
            old = None
        if old is None:
            orders[order_id] = (
                _ORDER_RANK[e.status],
                ts,
                e.status,
                e.bytes,
                e.seconds,
                e.reason,
                ts,
            )
            self._index_order(order_id, None, ts)
            return
        last = ts if ts > old[6] else old[6]
        new: _OrderRecord = (
            _ORDER_RANK[e.status],
            ts,
            e.status,
            e.bytes,
            e.seconds,
            e.reason,
            last,
        )
        if new[:3] > old[:3]:
            orders[order_id] = new
        elif last != old[6]:
            orders[order_id] = old[:6] + (last,)
        if last != old[6]:
            self._index_order(order_id, old[6], last)

    def _forget_order(self, order_id: str, last_ts: float) -> None:
        del self._orders[order_id]
        second = int(last_ts)
        members = self._orders_by_second[second]
        members.discard(order_id)
        if not members:
            del self._orders_by_second[second]
            del self._order_seconds[bisect.bisect_left(self._order_seconds, second)]

    # -- reads -----------------------------------------------------------------------------

    def context(self, session_id: str) -> SessionContext | None:
        s = self._live(session_id)
        if s is None:
            return None
        # s.blocks is replaced, never changed in place: handing it out is safe.
        context_bytes = latest_context_tokens(s.latest()) * self.bytes_per_token
        return SessionContext(
            session_id=session_id,
            instance_id=s.instance_id,
            context_bytes=context_bytes,
            block_hashes=s.blocks,
            block_tokens=s.block_tokens or self.block_tokens,
        )

    def session(self, session_id: str) -> SessionView | None:
        s = self._live(session_id)
        return None if s is None else self._view(session_id, s, resident=True)

    def _view(self, session_id: str, s: SessionRecord, *, resident: bool) -> SessionView:
        latest = s.latest()
        context_tokens = latest_context_tokens(latest)
        where: dict[str, int] = {}
        if resident and s.blocks:
            live = self._instance_live
            for (tier, instance_id), loc in self._locations.items():
                if not live(instance_id):
                    continue
                n = sum(map(loc.present.__contains__, s.blocks))
                if n:
                    where[location_name(tier, instance_id)] = n
        arrivals = list(s.arrivals)
        return SessionView(
            session_id=session_id,
            state=s.state(latest),
            turns=s.turns,
            first_seen_ts=s.first_ts,
            last_activity_ts=s.last_ts,
            closed_ts=s.closed_ts if s.closed_ts >= 0 else None,
            instance_id=s.instance_id,
            context_tokens=context_tokens,
            context_bytes=context_tokens * self.bytes_per_token,
            block_hashes=list(s.blocks),
            block_tokens=s.block_tokens or self.block_tokens,
            recent_arrivals_ts=arrivals,
            inter_turn_gaps_seconds=[b - a for a, b in zip(arrivals, arrivals[1:])],
            last_request=_request_view(latest) if latest is not None else None,
            resident_blocks=where,
            signals=[_signal_view(x) for x in s.signals],
            signals_total=s.signals_total,
        )

    def sessions(
        self, session_ids: Sequence[str], *, resident: bool = True
    ) -> list[SessionView | None]:
        live, view = self._live, self._view
        return [
            None if (s := live(session_id)) is None else view(session_id, s, resident=resident)
            for session_id in session_ids
        ]

    def live_sessions(
        self,
        limit: int,
        *,
        before: SessionCursor | None = None,
        active_since_ts: float | None = None,
    ) -> list[SessionView]:
        if limit <= 0:
            return []
        sessions, seconds = self._sessions, self._seconds
        since = max(active_since_ts if active_since_ts is not None else NONE, self._cutoff)
        # Whole seconds, newest first, from the cursor's down to the first one that may hold
        # activity at `since`; within a second, sessions in (last activity, id) order.
        i = bisect.bisect_right(seconds, int(before[0])) if before is not None else len(seconds)
        floor_since = math.floor(since)
        found: list[str] = []
        while i > 0 and len(found) < limit:
            i -= 1
            if seconds[i] < floor_since:
                break
            members = self._by_second[seconds[i]]
            for key in sorted(((sessions[sid].last_ts, sid) for sid in members), reverse=True):
                if key[0] < since:
                    break
                if before is not None and key >= before:
                    continue
                s = sessions[key[1]]
                if s.closed_ts >= 0 and s.state(s.latest()) == "closed":
                    continue
                found.append(key[1])
                if len(found) == limit:
                    break
        return [self.session(session_id) for session_id in found]  # type: ignore[misc]

    def instances(
        self,
        *,
        after: str | None = None,
        limit: int | None = None,
        ids: Sequence[str] | None = None,
    ) -> list[InstanceView]:
        live = self._instance_live
        if ids is not None:
            chosen = sorted({i for i in ids if live(i)})
        else:
            known = self._instance_ids
            start = bisect.bisect_right(known, after) if after is not None else 0
            chosen = []
            # Forgotten ones not dropped yet are only those of the cutoff's second: few.
            for k in range(start, len(known)):
                if limit is not None and len(chosen) >= limit:
                    break
                if live(known[k]):
                    chosen.append(known[k])
        locations, bytes_per_token = self._locations, self.bytes_per_token
        out = []
        for instance_id in chosen:
            i = self._instances[instance_id]
            blocks: dict[str, int] = {}
            nbytes: dict[str, int] = {}
            for tier in _INSTANCE_TIERS:
                loc = locations.get((tier, instance_id))
                if loc is not None:
                    blocks[tier] = len(loc.present)
                    nbytes[tier] = len(loc.present) * loc.block_tokens * bytes_per_token
            out.append(
                InstanceView(
                    instance_id=instance_id,
                    last_seen_ts=i.last_seen_ts,
                    status_ts=i.status_ts if i.status_ts >= 0 else None,
                    free_kv_bytes=i.free_kv_bytes,
                    total_kv_bytes=i.total_kv_bytes,
                    queue_depth=i.queue_depth,
                    running_requests=i.running_requests,
                    resident_blocks=blocks,
                    resident_bytes=nbytes,
                )
            )
        return out

    def locations(
        self, *, after: str | None = None, limit: int | None = None
    ) -> list[LocationView]:
        names, live, locations = self._location_names, self._instance_live, self._locations
        start = bisect.bisect_right(names, after) if after is not None else 0
        out: list[LocationView] = []
        for k in range(start, len(names)):
            if limit is not None and len(out) >= limit:
                break
            name = names[k]
            tier, _, instance = name.partition("@")
            instance_id = instance if instance else None
            if not live(instance_id):
                continue
            loc = locations[(tier, instance_id)]
            out.append(
                LocationView(
                    location=name,
                    tier=tier,
                    instance_id=instance_id,
                    blocks=len(loc.present),
                    bytes=len(loc.present) * loc.block_tokens * self.bytes_per_token,
                    block_tokens=loc.block_tokens,
                    cleared_ts=loc.cleared_ts if loc.cleared_ts >= 0 else None,
                )
            )
        return out

    def holds(
        self, tier: Tier, instance_id: str | None, block_hashes: Sequence[BlockHash]
    ) -> list[bool]:
        loc = self._held_at((tier, instance_id))
        if loc is None:
            return [False] * len(block_hashes)
        present = loc.present
        return [h in present for h in block_hashes]

    def holds_many(self, queries: Sequence[HoldsQuery]) -> list[list[bool]]:
        held_at = self._held_at
        out = []
        for tier, instance_id, block_hashes in queries:
            loc = held_at((tier, instance_id))
            if loc is None:
                out.append([False] * len(block_hashes))
            else:
                present = loc.present
                out.append([h in present for h in block_hashes])
        return out

    def held_prefixes(
        self,
        where: Sequence[Location],
        block_hashes: Sequence[BlockHash],
        starts: Sequence[int] | None = None,
    ) -> list[int]:
        # A route hint's whole residency cost (~2,000 probes for 129 locations of a 65,536-block
        # context). Packed hashes are searched by bisect in C, backwards (where the held run is
        # misses then hits, what bisect wants): the very probes of the loop below, in its order.
        held_at, n = self._held_at, len(block_hashes)
        backwards = memoryview(block_hashes)[::-1] if isinstance(block_hashes, array) else None
        out = []
        for k, key in enumerate(where):
            lo = starts[k] if starts is not None else 0
            loc = held_at(key)
            if loc is not None and lo < n:
                present = loc.present
                if backwards is not None:
                    held = present.__contains__
                    lo = n - bisect.bisect_left(backwards, True, 0, n - lo, key=held)
                else:
                    hi = n
                    while lo < hi:
                        m = (lo + hi + 1) >> 1
                        if block_hashes[m - 1] in present:
                            lo = m
                        else:
                            hi = m - 1
            out.append(lo)
        return out

    def instance_loads(self, ids: Sequence[str]) -> dict[str, tuple[int | None, int | None]]:
        instances, cutoff = self._instances, self._icutoff
        return {
            i: (r.queue_depth, r.running_requests)
            for i in ids
            if (r := instances.get(i)) is not None and r.last_seen_ts >= cutoff
        }

    def present(
        self, tier: Tier, instance_id: str | None, block_hashes: Iterable[BlockHash]
    ) -> set[BlockHash]:
        loc = self._held_at((tier, instance_id))
        return loc.present.keys() & block_hashes if loc is not None else set()

    def present_many(self, queries: Sequence[PresentQuery]) -> list[set[BlockHash]]:
        return [self.present(tier, instance_id, blocks) for tier, instance_id, blocks in queries]

    def order(self, order_id: str) -> OrderView | None:
        o = self._orders.get(order_id)
        if o is None or o[6] < self._cutoff:
            return None
        _, ts, status, nbytes, seconds, reason, _ = o
        return OrderView(
            order_id=order_id,
            status=status,
            status_ts=ts,
            bytes=nbytes,
            seconds=seconds,
            reason=reason,
        )

    def stats(self) -> dict[str, int]:
        # Only the second holding the cutoff can still hold forgotten sessions (_expire_sessions).
        cutoff = self._cutoff
        forgotten = (
            sum(
                1
                for session_id in self._by_second.get(math.floor(cutoff), ())
                if self._sessions[session_id].last_ts < cutoff
            )
            if cutoff > -math.inf
            else 0
        )
        forgotten_orders = (
            sum(
                1
                for order_id in self._orders_by_second.get(math.floor(cutoff), ())
                if self._orders[order_id][6] < cutoff
            )
            if cutoff > -math.inf
            else 0
        )
        stale = self._stale_instances()
        gone = [loc for i in stale for t in _INSTANCE_TIERS if (loc := self._locations.get((t, i)))]
        return {
            "sessions": len(self._sessions) - forgotten,
            "instances": len(self._instances) - len(stale),
            "locations": len(self._locations) - len(gone),
            "resident_blocks": self._resident - sum(len(loc.present) for loc in gone),
            "orders": len(self._orders) - forgotten_orders,
            "remembered_event_ids": len(self._seen) + len(self._seen_old),
        }

    def checkpoint(self, replica_id: str) -> LogPosition | None:
        return self._checkpoints.get(replica_id)

    def set_checkpoint(self, replica_id: str, position: LogPosition) -> None:
        self._checkpoints[replica_id] = position

    def ping(self) -> None:
        return None

    def clear(self) -> None:
        self._seen, self._seen_old, self._dying = set(), set(), set()
        self._newest = self._cutoff = -math.inf
        self._sessions.clear()
        self._by_second.clear()
        self._seconds.clear()
        self._instances.clear()
        self._locations.clear()
        self._orders.clear()
        self._orders_by_second.clear()
        self._order_seconds.clear()
        self._instance_ids.clear()
        self._instances_by_second.clear()
        self._instance_seconds.clear()
        self._location_names.clear()
        self._resident = 0
        self._icutoff = -math.inf
        self._checkpoints.clear()

    def close(self) -> None:
        return None


def _signal_view(x: SignalEntry) -> SignalView:
    ts, kind, tool, instance_id, expected_in_seconds, expected_prompt_tokens = x
    return SignalView(
        ts=ts,
        kind=kind,
        tool=tool or None,
        instance_id=instance_id or None,
        expected_in_seconds=expected_in_seconds if expected_in_seconds >= 0 else None,
        expected_prompt_tokens=expected_prompt_tokens if expected_prompt_tokens >= 0 else None,
    )


def _request_view(r: RequestRecord) -> RequestView:
    def opt(x: float) -> float | None:
        return x if x >= 0 else None

    def opt_int(x: int) -> int | None:
        return x if x >= 0 else None

    return RequestView(
        request_id=r.request_id,
        instance_id=r.instance_id,
        routed_ts=opt(r.routed_ts),
        started_ts=opt(r.started_ts),
        finished_ts=opt(r.finished_ts),
        prompt_tokens=opt_int(r.prompt_tokens),
        output_tokens=opt_int(r.output_tokens),
        context_tokens=opt_int(r.context_tokens),
    )


def _no_state(event: Event) -> None:
    """A record (RECORD_EVENT_TYPES): its id is seen, nothing else changes."""
