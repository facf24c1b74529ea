"""The embedded in-memory store: one process, rebuilt from the event log on restart.

Kept small on purpose (at most 2 KB per tracked session): slotted records, floats rather than
optional objects, block hashes packed in an array.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

from kvprefetch_client.events import (
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
    Tier,
    VllmKvEvents,
)
from app.state.base import (
    RECENT_ARRIVALS,
    RECENT_REQUESTS,
    InstanceView,
    LocationView,
    LogPosition,
    OrderView,
    HoldsQuery,
    Location,
    RequestView,
    SessionContext,
    SessionCursor,
    SessionView,
    location_name,
)

_NONE = -1.0  # "no timestamp": every real ts is >= 0
_ORDER_RANK = {"accepted": 0, "completed": 1, "failed": 1}
# An order's record: (rank, status ts, status, bytes, seconds, reason, last activity ts); the
# first three decide which progress event wins, the last when the order is forgotten.
_OrderRecord = tuple[int, float, str, "int | None", "float | None", "str | None", float]
_INSTANCE_TIERS = ("hbm", "host", "disk")


class _Request:
    __slots__ = ("request_id", "instance_id", "instance_ts", "routed_ts", "started_ts",
                 "finished_ts", "prompt_tokens", "output_tokens", "context_tokens")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.instance_id: str | None = None
        self.instance_ts = _NONE
        self.routed_ts = _NONE
        self.started_ts = _NONE
        self.finished_ts = _NONE
        self.prompt_tokens = -1
        self.output_tokens = -1
        self.context_tokens = -1

    def rank(self) -> float:
        """Which request is the latest: routed time, else the earliest other time seen."""
        if self.routed_ts >= 0:
            return self.routed_ts
        known = [t for t in (self.started_ts, self.finished_ts) if t >= 0]
        return min(known) if known else _NONE

    def view(self) -> RequestView:
        def opt(x: float) -> float | None:
            return x if x >= 0 else None

        def opt_int(x: int) -> int | None:
            return x if x >= 0 else None

        return RequestView(
            request_id=self.request_id, instance_id=self.instance_id,
            routed_ts=opt(self.routed_ts), started_ts=opt(self.started_ts),
            finished_ts=opt(self.finished_ts), prompt_tokens=opt_int(self.prompt_tokens),
            output_tokens=opt_int(self.output_tokens), context_tokens=opt_int(self.context_tokens))


class _Session:
    __slots__ = ("turns", "first_ts", "last_ts", "closed_ts", "instance_id", "instance_ts",
                 "blocks", "blocks_ts", "block_tokens", "arrivals", "requests")

    def __init__(self, ts: float) -> None:
        self.turns = 0
        self.first_ts = ts
        self.last_ts = ts
        self.closed_ts = _NONE
        self.instance_id: str | None = None
        self.instance_ts = _NONE
        self.blocks: array[int] | tuple[BlockHash, ...] = ()
        self.blocks_ts = _NONE
        self.block_tokens = 0
        self.arrivals: list[float] = []
        self.requests: list[_Request] = []

    def touch(self, ts: float) -> None:
        if ts < self.first_ts:
            self.first_ts = ts
        if ts > self.last_ts:
            self.last_ts = ts

    def trim_requests(self) -> None:
        if len(self.requests) > RECENT_REQUESTS:
            self.requests.sort(key=_Request.rank)
            del self.requests[: len(self.requests) - RECENT_REQUESTS]

    def set_blocks(self, block_hashes: list[BlockHash] | None, block_tokens: int, ts: float) -> None:
        if block_hashes is not None and ts >= self.blocks_ts:
            self.blocks, self.blocks_ts, self.block_tokens = _pack(block_hashes), ts, block_tokens

    def latest(self) -> _Request | None:
        return max(self.requests, key=_Request.rank) if self.requests else None


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

    __slots__ = ("present", "removed", "removed_old", "old_bound", "newest", "window", "cleared_ts",
                 "block_tokens")

    def __init__(self, block_tokens: int, window: float) -> None:
        self.present: dict[BlockHash, float] = {}
        self.removed: dict[BlockHash, float] = {}
        self.removed_old: dict[BlockHash, float] = {}
        self.old_bound = -math.inf  # no tombstone of removed_old is newer
        self.newest = -math.inf  # the newest ts of an event at this location
        self.window = window
        self.cleared_ts = _NONE
        self.block_tokens = block_tokens

    def advance(self, ts: float) -> None:
        if ts <= self.newest:
            return
        previous, self.newest = self.newest, ts
        cutoff = ts - self.window
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
        cutoff = self.newest - self.window
        for h in block_hashes:
            t = removed.get(h)
            if t is None and removed_old:
                t = removed_old.get(h)
            if t is not None:
                if ts <= t and t >= cutoff:
                    continue
                removed.pop(h, None)
                removed_old.pop(h, None)
            if ts > present.get(h, _NONE):
                present[h] = ts

    def remove(self, block_hashes: Sequence[BlockHash], ts: float) -> None:
        self.advance(ts)
        present, removed, removed_old = self.present, self.removed, self.removed_old
        # A tombstone dead on arrival would never be consulted: don't keep it.
        keep = ts >= self.newest - self.window
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
    __slots__ = ("last_seen_ts", "status_ts", "free_kv_bytes", "total_kv_bytes", "queue_depth",
                 "running_requests")

    def __init__(self, ts: float) -> None:
        self.last_seen_ts = ts
        self.status_ts = _NONE
        self.free_kv_bytes: int | None = None
        self.total_kv_bytes: int | None = None
        self.queue_depth: int | None = None
        self.running_requests: int | None = None


class MemoryStore:
    def __init__(self, *, bytes_per_token: int, block_tokens: int, dedupe_max_ids: int = 2_000_000,
                 reorder_window_seconds: float = math.inf, session_retention_seconds: float = math.inf) -> None:
        if dedupe_max_ids < 1 or reorder_window_seconds <= 0 or session_retention_seconds <= 0:
            raise ValueError("dedupe_max_ids and both windows must be positive")
        self.bytes_per_token = bytes_per_token
        self.block_tokens = block_tokens
        self.dedupe_max_ids = dedupe_max_ids
        self.reorder_window_seconds = reorder_window_seconds
        self.session_retention_seconds = session_retention_seconds
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
        self._sessions: dict[str, _Session] = {}
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
        self._checkpoints: dict[str, LogPosition] = {}
        self._apply_one = {
            "request_routed": self._routed,
            "request_started": self._started,
            "request_finished": self._finished,
            "session_closed": self._closed,
            "kv_blocks_stored": self._stored,
            "kv_blocks_removed": self._removed,
            "kv_blocks_cleared": self._cleared,
            "vllm_kv_events": self._vllm,
            "instance_status": self._status,
            "order_progress": self._order,
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
            if ts > self._newest:
                self._newest, self._cutoff = ts, ts - self.session_retention_seconds
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
        return out

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

    def _live(self, session_id: str) -> _Session | None:
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

    def _session(self, session_id: str, ts: float) -> _Session | None:
        """The session an event at `ts` updates; None when the event is itself older than the
        cutoff (it is about a past the store has forgotten, or is about to)."""
        if ts < self._cutoff:
            return None
        s = self._sessions.get(session_id)
        if s is not None and s.last_ts < self._cutoff:
            self._forget(session_id)  # forgotten: a new event starts it afresh
            s = None
        if s is None:
            s = self._sessions[session_id] = _Session(ts)
            self._index(session_id, None, ts)
        else:
            if ts > s.last_ts and int(ts) != int(s.last_ts):
                self._index(session_id, s.last_ts, ts)
            s.touch(ts)
        return s

    def _index(self, session_id: str, old_ts: float | None, ts: float) -> None:
        """Move a session to the second of its new last activity (every ts is >= 0: int floors)."""
        by_second = self._by_second
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

    def _new_instance(self, instance_id: str, ts: float) -> _Instance:
        i = self._instances[instance_id] = _Instance(ts)
        bisect.insort(self._instance_ids, instance_id)
        return i

    def _instance(self, instance_id: str, ts: float) -> _Instance:
        i = self._instances.get(instance_id)
        if i is None:
            i = self._new_instance(instance_id, ts)
        elif ts > i.last_seen_ts:
            i.last_seen_ts = ts
        return i

    def _request_event(self, e: RequestRouted | RequestStarted | RequestFinished) -> tuple[_Session, _Request] | None:
        """What every request event does: touch its session and instance, find its request.
        None: the event is about a forgotten session (see _session); only the instance is touched.

        Inlined rather than split into helpers: this runs for most events on the ingest path.
        """
        ts = e.ts
        s = self._sessions.get(e.session_id)
        if s is None or s.last_ts < self._cutoff or ts < self._cutoff:
            instance = self._instances.get(e.instance_id)
            if instance is None:
                self._new_instance(e.instance_id, ts)
            elif ts > instance.last_seen_ts:
                instance.last_seen_ts = ts
            s = self._session(e.session_id, ts)
            if s is None:
                return None
            s.instance_id, s.instance_ts = e.instance_id, ts
            r = _Request(e.request_id)
            r.instance_id, r.instance_ts = e.instance_id, ts
            s.requests.append(r)
            return s, r
        if ts > s.last_ts:
            if int(ts) != int(s.last_ts):
                self._index(e.session_id, s.last_ts, ts)
            s.last_ts = ts
        elif ts < s.first_ts:
            s.first_ts = ts
        instance = self._instances.get(e.instance_id)
        if instance is None:
            self._new_instance(e.instance_id, ts)
        elif ts > instance.last_seen_ts:
            instance.last_seen_ts = ts
        if ts >= s.instance_ts:
            s.instance_id, s.instance_ts = e.instance_id, ts
        for r in s.requests:
            if r.request_id == e.request_id:
                break
        else:
            r = _Request(e.request_id)
            s.requests.append(r)
        if ts >= r.instance_ts:
            r.instance_id, r.instance_ts = e.instance_id, ts
        return s, r

    def _routed(self, e: RequestRouted) -> None:
        sr = self._request_event(e)
        if sr is None:
            return
        s, r = sr
        ts = e.ts
        s.turns += 1
        arrivals = s.arrivals
        if not arrivals or ts >= arrivals[-1]:
            arrivals.append(ts)
        else:
            bisect.insort(arrivals, ts)
        if len(arrivals) > RECENT_ARRIVALS:
            del arrivals[0]
        if e.block_hashes is not None:
            s.set_blocks(e.block_hashes, e.block_tokens or self.block_tokens, ts)
        if ts >= r.routed_ts:
            r.routed_ts, r.prompt_tokens = ts, e.prompt_tokens
        if len(s.requests) > RECENT_REQUESTS:
            s.trim_requests()

    def _started(self, e: RequestStarted) -> None:
        sr = self._request_event(e)
        if sr is None:
            return
        s, r = sr
        if e.ts > r.started_ts:
            r.started_ts = e.ts
        if len(s.requests) > RECENT_REQUESTS:
            s.trim_requests()

    def _finished(self, e: RequestFinished) -> None:
        sr = self._request_event(e)
        if sr is None:
            return
        s, r = sr
        ts = e.ts
        if e.block_hashes is not None:
            s.set_blocks(e.block_hashes, e.block_tokens or self.block_tokens, ts)
        if ts >= r.finished_ts:
            r.finished_ts, r.output_tokens = ts, e.output_tokens
            r.context_tokens = e.context_tokens if e.context_tokens is not None else -1
        if len(s.requests) > RECENT_REQUESTS:
            s.trim_requests()

    def _closed(self, e: SessionClosed) -> None:
        s = self._session(e.session_id, e.ts)
        if s is not None and e.ts > s.closed_ts:
            s.closed_ts = e.ts

    def _location(self, tier: str, instance_id: str | None, block_tokens: int | None) -> _Location:
        key = (tier, instance_id)
        loc = self._locations.get(key)
        if loc is None:
            loc = self._locations[key] = _Location(block_tokens or self.block_tokens, self.reorder_window_seconds)
        elif block_tokens:
            loc.block_tokens = block_tokens
        return loc

    def _stored(self, e: KvBlocksStored) -> None:
        if e.instance_id is not None:
            self._instance(e.instance_id, e.ts)
        self._location(e.tier, e.instance_id, e.block_tokens).store(e.block_hashes, e.ts)

    def _removed(self, e: KvBlocksRemoved) -> None:
        if e.instance_id is not None:
            self._instance(e.instance_id, e.ts)
        self._location(e.tier, e.instance_id, None).remove(e.block_hashes, e.ts)

    def _cleared(self, e: KvBlocksCleared) -> None:
        if e.instance_id is not None:
            self._instance(e.instance_id, e.ts)
        self._location(e.tier, e.instance_id, None).clear(e.ts)

    def _vllm(self, e: VllmKvEvents) -> None:
        for sub in e.expand():
            self._apply_one[sub.type](sub)

    def _status(self, e: InstanceStatus) -> None:
        i = self._instance(e.instance_id, e.ts)
        if e.ts >= i.status_ts:
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
            orders[order_id] = (_ORDER_RANK[e.status], ts, e.status, e.bytes, e.seconds, e.reason, ts)
            self._index_order(order_id, None, ts)
            return
        last = ts if ts > old[6] else old[6]
        new: _OrderRecord = (_ORDER_RANK[e.status], ts, e.status, e.bytes, e.seconds, e.reason, last)
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
        return SessionContext(session_id=session_id, instance_id=s.instance_id,
                              context_bytes=_context_tokens(s.latest()) * self.bytes_per_token,
                              block_hashes=s.blocks, block_tokens=s.block_tokens or self.block_tokens)

    def session(self, session_id: str) -> SessionView | None:
        s = self._live(session_id)
        if s is None:
            return None
        latest = s.latest()
        context_tokens = _context_tokens(latest)
        resident: dict[str, int] = {}
        if s.blocks:
            for (tier, instance_id), loc in self._locations.items():
                n = sum(map(loc.present.__contains__, s.blocks))
                if n:
                    resident[location_name(tier, instance_id)] = n
        arrivals = list(s.arrivals)
        return SessionView(
            session_id=session_id,
            state=_state(s, latest),
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
            last_request=latest.view() if latest is not None else None,
            resident_blocks=resident,
        )

    def live_sessions(self, limit: int, *, before: SessionCursor | None = None,
                      active_since_ts: float | None = None) -> list[SessionView]:
        if limit <= 0:
            return []
        sessions, seconds = self._sessions, self._seconds
        since = max(active_since_ts if active_since_ts is not None else _NONE, self._cutoff)
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
                if s.closed_ts >= 0 and _state(s, s.latest()) == "closed":
                    continue
                found.append(key[1])
                if len(found) == limit:
                    break
        return [self.session(session_id) for session_id in found]  # type: ignore[misc]

    def instances(self, *, after: str | None = None, limit: int | None = None,
                  ids: Sequence[str] | None = None) -> list[InstanceView]:
        if ids is not None:
            chosen = sorted({i for i in ids if i in self._instances})
        else:
            known = self._instance_ids
            start = bisect.bisect_right(known, after) if after is not None else 0
            chosen = known[start: start + limit] if limit is not None else known[start:]
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
            out.append(InstanceView(
                instance_id=instance_id, last_seen_ts=i.last_seen_ts,
                status_ts=i.status_ts if i.status_ts >= 0 else None,
                free_kv_bytes=i.free_kv_bytes, total_kv_bytes=i.total_kv_bytes,
                queue_depth=i.queue_depth, running_requests=i.running_requests,
                resident_blocks=blocks, resident_bytes=nbytes))
        return out

    def locations(self) -> list[LocationView]:
        out = []
        for (tier, instance_id), loc in sorted(self._locations.items(), key=lambda kv: location_name(*kv[0])):
            out.append(LocationView(
                location=location_name(tier, instance_id), tier=tier, instance_id=instance_id,  # type: ignore[arg-type]
                blocks=len(loc.present),
                bytes=len(loc.present) * loc.block_tokens * self.bytes_per_token,
                block_tokens=loc.block_tokens,
                cleared_ts=loc.cleared_ts if loc.cleared_ts >= 0 else None))
        return out

    def holds(self, tier: Tier, instance_id: str | None, block_hashes: Sequence[BlockHash]) -> list[bool]:
        loc = self._locations.get((tier, instance_id))
        if loc is None:
            return [False] * len(block_hashes)
        present = loc.present
        return [h in present for h in block_hashes]

    def holds_many(self, queries: Sequence[HoldsQuery]) -> list[list[bool]]:
        locations = self._locations
        out = []
        for tier, instance_id, block_hashes in queries:
            loc = locations.get((tier, instance_id))
            if loc is None:
                out.append([False] * len(block_hashes))
            else:
                present = loc.present
                out.append([h in present for h in block_hashes])
        return out

    def held_prefixes(self, where: Sequence[Location], block_hashes: Sequence[BlockHash],
                      starts: Sequence[int] | None = None) -> list[int]:
        # A route hint's whole residency cost (~2,000 probes for 129 locations of a 65,536-block
        # context). Packed hashes are searched by bisect in C, backwards (where the held run is
        # misses then hits, what bisect wants): the very probes of the loop below, in its order.
        locations, n = self._locations, len(block_hashes)
        backwards = memoryview(block_hashes)[::-1] if isinstance(block_hashes, array) else None
        out = []
        for k, key in enumerate(where):
            lo = starts[k] if starts is not None else 0
            loc = locations.get(key)
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
        instances = self._instances
        return {i: (r.queue_depth, r.running_requests)
                for i in ids if (r := instances.get(i)) is not None}

    def present(self, tier: Tier, instance_id: str | None, block_hashes: Iterable[BlockHash]) -> set[BlockHash]:
        loc = self._locations.get((tier, instance_id))
        return loc.present.keys() & block_hashes if loc is not None else set()

    def order(self, order_id: str) -> OrderView | None:
        o = self._orders.get(order_id)
        if o is None or o[6] < self._cutoff:
            return None
        _, ts, status, nbytes, seconds, reason, _ = o
        return OrderView(order_id=order_id, status=status, status_ts=ts,  # type: ignore[arg-type]
                         bytes=nbytes, seconds=seconds, reason=reason)

    def stats(self) -> dict[str, int]:
        # Only the second holding the cutoff can still hold forgotten sessions (_expire_sessions).
        cutoff = self._cutoff
        forgotten = sum(1 for session_id in self._by_second.get(math.floor(cutoff), ())
                        if self._sessions[session_id].last_ts < cutoff) if cutoff > -math.inf else 0
        forgotten_orders = sum(1 for order_id in self._orders_by_second.get(math.floor(cutoff), ())
                               if self._orders[order_id][6] < cutoff) if cutoff > -math.inf else 0
        return {
            "sessions": len(self._sessions) - forgotten,
            "instances": len(self._instances),
            "locations": len(self._locations),
            "resident_blocks": sum(len(loc.present) for loc in self._locations.values()),
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
        self._checkpoints.clear()

    def close(self) -> None:
        return None


def _context_tokens(latest: _Request | None) -> int:
    if latest is None:
        return 0
    if latest.finished_ts >= 0 and latest.context_tokens >= 0:
        return latest.context_tokens
    if latest.finished_ts >= 0 and latest.prompt_tokens >= 0:
        return latest.prompt_tokens + latest.output_tokens
    return max(latest.prompt_tokens, 0)


def _state(s: _Session, latest: _Request | None) -> Any:
    latest_routed = latest.routed_ts if latest is not None else _NONE
    if s.closed_ts >= 0 and s.closed_ts >= latest_routed:
        return "closed"
    if latest is None or latest.finished_ts >= 0:
        return "idle"
    if latest.started_ts >= 0:
        return "running"
    return "queued"


def _pack(block_hashes: list[BlockHash]) -> array[int] | tuple[BlockHash, ...]:
    """Block hashes in 8 bytes each when they are 64-bit ints (a tuple of ints costs ~36)."""
    for code in ("q", "Q"):
        try:
            return array(code, block_hashes)  # type: ignore[arg-type]
        except (OverflowError, TypeError):
            continue
    return tuple(block_hashes)
