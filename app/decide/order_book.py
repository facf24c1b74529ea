"""The order book: every order the scheduler issued, tracked to its outcome.

The scheduler (app/decide/scheduler.py) decides what to order; this book keeps what became of
it, so that nothing is ordered twice and every byte is accounted for:

- **Open orders**: prefetches issued and not yet ended, with the sessions each serves. A block in
  an open order to a destination is never ordered there again.
- **Progress** (`on_progress`, from order_progress events): `accepted` marks an order started;
  `completed` lands it; `failed` ends it. An open order an agent accepted whose blocks all show
  at the destination has landed too (`retire_landed`); one nobody accepted whose blocks got there
  by other means is withdrawn. One with no word of its end `overdue_seconds` past its needed_by is
  given up (`give_up_overdue`): failed if it had started, else cancelled. One not yet started
  whose sessions are no longer likely back there is cancelled (`cancel_fallen`); one already
  moving runs on, and if it has no session left its bytes count as wasted.
- **Pins and demotes**: the idle spell each session's context was pinned (until when) or demoted
  for, so each is ordered once per spell, a pin again only when it is about to lapse.
- **Delivered memory.** A completed prefetch is remembered as delivered to its place (instance
  and tier) and, meanwhile, its blocks count as there: never ordered there again. A tier may load
  into a cache of its own that nothing reports (LMCache loads into its L1; the engine reports
  blocks only once a request uses them), so without it the next tick would order them again. It
  stands until the engine reports the blocks gone there (kv_blocks_removed, block by block, or
  kv_blocks_cleared; the feedback observer, app/decide/plan_loop.py, tells the book), until the
  advice changes for every session it served (a new spell: the session had a turn, or is advised
  for another instance; or it was routed or closed), or until the order's ttl passes (the hold it
  asked for; the lead when it named none).
- **Landed prefetches** wait for a session they served to come back: used by as much of them as
  is still there when one comes back to their instance; unused when every session they served
  came back elsewhere, closed, or stopped being advised on.
- **Retries with backoff.** A failed order (reported failed, refused by the sink, or given up
  overdue after it started) makes each session it served wait before the next order of its kind
  to that destination: `retry_backoff_seconds`, doubling with each failure in a row, at most
  `retry_backoff_max_seconds`; a completion clears it. Keyed by session and destination (see
  `_failed` for why).
- **Hand-over** (`handover_state`, `take_over`): what a planner taking over from this one needs so
  as not to order anything twice (decisions.md, 23).

The book reads the scheduler's latest advice through `advice_of` and gives a withdrawn order's
link time back through `release`: the link bookings are the scheduler's.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import orjson

from app.decide.advisor import SessionAdvice
from app.state.base import StateStore
from kvprefetch_client.events import BlockHash
from kvprefetch_client.orders import Cancel, Order, from_json

if TYPE_CHECKING:
    from app.decide.scheduler import SchedulerConfig

log = logging.getLogger(__name__)

_K = TypeVar("_K")
_NOTHING: Mapping[BlockHash, set[str]] = {}

# One idle spell of one session's context on one instance: (instance, session, blocks, last block).
# A new turn grows the context, so its retention is a new question.
Spell = tuple[str, str, int, BlockHash]


def spell_of(a: SessionAdvice) -> Spell:
    return (a.instance_id or "", a.session_id, len(a.block_hashes), a.block_hashes[-1])


@dataclass(slots=True)
class SchedulerTotals:
    orders: dict[str, int] = field(default_factory=lambda: {"prefetch": 0, "pin": 0, "demote": 0})
    bytes_ordered: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    bytes_wasted: int = 0
    # Landed prefetches: used when a session they served came back to their instance; unused when
    # every session they served came back elsewhere, closed, or stopped being advised on.
    bytes_used: int = 0
    bytes_unused: int = 0


@dataclass(slots=True)
class _Open:
    order: Order
    started: bool = False
    sessions: set[str] = field(default_factory=set)
    used: bool = False  # a session it served was routed to its destination
    wasted: bool = False
    served: set[str] = field(default_factory=set)  # every session it was ordered for
    # The spell each session was served at (None: adopted from a hand-over, not known).
    spells: dict[str, Spell | None] = field(default_factory=dict)


@dataclass(slots=True)
class _Landed:
    instance_id: str
    size_bytes: int
    sessions: set[str]
    block_hashes: list[BlockHash]


@dataclass(slots=True)
class _Delivered:
    """A completed prefetch, remembered at its place while it stands (see the module doc)."""

    instance_id: str
    tier: str
    blocks: set[BlockHash]  # landed and not reported gone since
    sessions: dict[str, Spell | None]  # the sessions it stands for, at the spell it served
    until: float  # its ttl's end


class OrderBook:
    def __init__(
        self,
        store: StateStore,
        config: SchedulerConfig,
        *,
        advice_of: Callable[[str], SessionAdvice | None],
        release: Callable[[str, bool], None],
    ) -> None:
        self.store = store
        self.config = config
        # The scheduler's latest advice for a session (None once it has none).
        self._advice_of = advice_of
        # An order left the open ones: its link booking goes; its slot is given back when the
        # flag says it never moved (cancelled, given up).
        self._release = release
        self.totals = SchedulerTotals()
        self._open: dict[str, _Open] = {}
        # session -> ids of the open orders that served it (may name orders since closed): an
        # arrival, on the ingest path, finds its orders without scanning every open one.
        self._served_by: dict[str, set[str]] = {}
        self.pinned: dict[str, tuple[Spell, float]] = {}  # session -> its pinned spell, until
        self.demoted: dict[str, Spell] = {}
        self._landed: dict[str, _Landed] = {}  # landed prefetches waiting for a session's return
        self._landed_by_session: dict[str, set[str]] = {}
        # order id -> (the order, its hand-over value), so an unchanged order is not re-encoded.
        self._encoded: dict[str, tuple[Order, bool, str]] = {}
        # Delivered memory: order id -> its record; (instance, tier) -> block -> the records
        # that hold it there; session -> the records standing for it; (until, id), a heap.
        self._delivered: dict[str, _Delivered] = {}
        self._delivered_at: dict[tuple[str, str], dict[BlockHash, set[str]]] = {}
        self._delivered_for: dict[str, set[str]] = {}
        self._delivered_until: list[tuple[float, str]] = []
        self._handed: dict[str, str] = {}  # order id -> its record's hand-over value
        # (kind, session, destination) -> (failures in a row, when it may be ordered again).
        self._backoff: dict[tuple[str, str, str], tuple[int, float]] = {}
        self._now = 0.0  # the last tick's time: when a completion reported between ticks landed

    # -- orders in ---------------------------------------------------------------------------

    def opened(self, order: Order, session_id: str, spell: Spell) -> None:
        """A prefetch issued for `session_id`'s context at `spell`."""
        self._open[order.order_id] = _Open(
            order, sessions={session_id}, served={session_id}, spells={session_id: spell}
        )
        self._served_by.setdefault(session_id, set()).add(order.order_id)

    def serves_too(self, grown: Order, session_id: str, spell: Spell) -> None:
        """An open prefetch, `grown` to serve `session_id` (at `spell`) too."""
        e = self._open[grown.order_id]
        e.order = grown
        e.sessions.add(session_id)
        e.served.add(session_id)
        e.spells[session_id] = spell
        self._served_by.setdefault(session_id, set()).add(grown.order_id)

    def issued(self, orders: Iterable[Order]) -> None:
        """Orders handed out by a plan: counted."""
        for o in orders:
            self.totals.orders[o.kind] += 1
            if o.kind == "prefetch":
                self.totals.bytes_ordered += o.size_bytes

    # -- pins and demotes --------------------------------------------------------------------

    def wants_pin(self, session_id: str, spell: Spell, now: float) -> bool:
        """Whether a keep advice for this spell needs a pin now: none held for it, or about to
        lapse."""
        pinned = self.pinned.get(session_id)
        return (
            pinned is None
            or pinned[0] != spell
            or pinned[1] - self.config.repin_before_seconds <= now
        )

    def pin_ordered(self, order: Order, session_id: str, spell: Spell, until: float) -> None:
        self.pinned[session_id] = (spell, until)
        self.demoted.pop(session_id, None)

    def demote_ordered(self, order: Order, session_id: str, spell: Spell) -> None:
        self.demoted[session_id] = spell
        self.pinned.pop(session_id, None)

    # -- delivered memory --------------------------------------------------------------------

    def delivered(self, instance_id: str, tier: str = "hbm") -> Mapping[BlockHash, set[str]]:
        """The blocks at this place that a completed prefetch delivered and still stands for."""
        return self._delivered_at.get((instance_id, tier), _NOTHING)

    def advised(self, a: SessionAdvice) -> None:
        """The session's latest advice: a delivery made for another spell of it no longer
        stands for it."""
        for rid in list(self._delivered_for.get(a.session_id, ())):
            rec = self._delivered[rid]
            spell = rec.sessions[a.session_id]
            if (
                a.instance_id != rec.instance_id
                or not a.block_hashes
                or (spell is not None and spell != spell_of(a))
            ):
                self._leave(rid, a.session_id)

    def blocks_removed(
        self, tier: str, instance_id: str | None, blocks: Iterable[BlockHash]
    ) -> None:
        """The engine reports these blocks gone from the place (kv_blocks_removed)."""
        at = self._delivered_at.get((instance_id or "", tier))
        if not at:
            return
        for b in blocks:
            for rid in at.pop(b, ()):
                rec = self._delivered[rid]
                rec.blocks.discard(b)
                self._handed.pop(rid, None)
                if not rec.blocks:
                    self._drop(rid)
        if not at:
            self._delivered_at.pop((instance_id or "", tier), None)

    def blocks_cleared(self, tier: str, instance_id: str | None) -> None:
        """Every block at the place is gone (kv_blocks_cleared: an engine restart)."""
        at = self._delivered_at.get((instance_id or "", tier))
        for rid in {rid for rids in (at or {}).values() for rid in rids}:
            self._drop(rid)

    def _deliver(self, order_id: str, e: _Open) -> None:
        """A prefetch landed: remembered for the sessions still advised on at the spell it was
        ordered for, until its ttl passes."""
        sessions: dict[str, Spell | None] = {}
        for s in e.served:
            latest = self._advice_of(s)
            spell = e.spells.get(s)
            if latest is not None and (
                spell is None or (latest.block_hashes and spell_of(latest) == spell)
            ):
                sessions[s] = spell
        if not sessions:
            return
        o = e.order
        ttl = o.ttl_seconds if o.ttl_seconds is not None else self.config.lead_seconds
        self._remember(
            order_id,
            _Delivered(o.instance_id, o.tier, set(o.block_hashes), sessions, self._now + ttl),
        )

    def _remember(self, rid: str, rec: _Delivered) -> None:
        self._delivered[rid] = rec
        at = self._delivered_at.setdefault((rec.instance_id, rec.tier), {})
        for b in rec.blocks:
            at.setdefault(b, set()).add(rid)
        for s in rec.sessions:
            self._delivered_for.setdefault(s, set()).add(rid)
        heapq.heappush(self._delivered_until, (rec.until, rid))

    def _leave(self, rid: str, session_id: str) -> None:
        """The delivery no longer stands for the session; with none left, it is forgotten."""
        rec = self._delivered[rid]
        rec.sessions.pop(session_id, None)
        self._handed.pop(rid, None)
        self._unlink(self._delivered_for, session_id, rid)
        if not rec.sessions:
            self._drop(rid)

    def _drop(self, rid: str) -> None:
        rec = self._delivered.pop(rid)
        self._handed.pop(rid, None)
        place = (rec.instance_id, rec.tier)
        at = self._delivered_at.get(place, {})
        for b in rec.blocks:
            self._unlink(at, b, rid)
        if not at:
            self._delivered_at.pop(place, None)
        for s in rec.sessions:
            self._unlink(self._delivered_for, s, rid)

    @staticmethod
    def _unlink(index: dict[_K, set[str]], key: _K, rid: str) -> None:
        rids = index.get(key)
        if rids is not None:
            rids.discard(rid)
            if not rids:
                del index[key]

    def _expire_delivered(self, now: float) -> None:
        heap = self._delivered_until
        while heap and heap[0][0] <= now:
            until, rid = heapq.heappop(heap)
            rec = self._delivered.get(rid)
            if rec is not None and rec.until == until:
                self._drop(rid)

    # -- what comes back ---------------------------------------------------------------------

    def forget(self, session_id: str, *, routed_to: str | None = None) -> None:
        """The session is active again (routed to `routed_to`) or closed. An order moving its
        context to where it was routed is used by that request, not wasted."""
        self.pinned.pop(session_id, None)
        self.demoted.pop(session_id, None)
        for rid in list(self._delivered_for.get(session_id, ())):
            self._leave(rid, session_id)
        for order_id in self._served_by.pop(session_id, ()):
            e = self._open.get(order_id)
            if e is not None and routed_to == e.order.instance_id:
                e.used = True
        for order_id in self._landed_by_session.pop(session_id, ()):
            landed = self._landed.get(order_id)
            if landed is None:
                continue
            landed.sessions.discard(session_id)
            if routed_to == landed.instance_id:
                # Used as far as it is still there: blocks evicted before the session came back
                # were moved for nothing.
                held = self.store.holds("hbm", landed.instance_id, landed.block_hashes)
                used = landed.size_bytes * sum(held) // max(len(held), 1)
                self.totals.bytes_used += used
                self.totals.bytes_unused += landed.size_bytes - used
                del self._landed[order_id]
            elif not landed.sessions:
                self.totals.bytes_unused += landed.size_bytes
                del self._landed[order_id]

    def on_progress(self, order_id: str, status: str) -> None:
        """An order_progress event; unknown ids are a no-op (another replica's, or long done)."""
        entry = self._open.get(order_id)
        if entry is None:
            return
        if status == "accepted":
            entry.started = True
        elif status in ("completed", "failed"):
            del self._open[order_id]
            self._release(order_id, False)
            if status == "completed":
                self._succeeded(entry.order, entry.served)
                self._has_landed(order_id, entry)
            else:
                self.totals.failed += 1
                self._failed(entry.order, entry.served)

    # -- each tick ---------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """A planning tick starts at `now`: deliveries past their ttl are forgotten, and so are
        backoffs long past (a failure after a quiet spell starts from the first wait again)."""
        self._now = now
        self._expire_delivered(now)
        if self._backoff:
            quiet = now - self.config.retry_backoff_max_seconds
            for key, (_, retry_at) in list(self._backoff.items()):
                if retry_at < quiet:
                    del self._backoff[key]

    # -- retries -----------------------------------------------------------------------------

    def backing_off(self, kind: str, session_id: str, instance_id: str) -> bool:
        """Whether the session's last `kind` order to the instance failed and its wait has not
        passed yet."""
        entry = self._backoff.get((kind, session_id, instance_id))
        return entry is not None and entry[1] > self._now

    def _failed(self, order: Order, sessions: Iterable[str]) -> None:
        """An order failed: each session it served waits before the next order of its kind
        there, the wait doubling with each failure in a row. Per session and destination, not
        per block set: a context's missing blocks are grouped anew each tick (shared with other
        candidates, split by source), so a block-set key would slip; and one context failing
        (its tokens unknown, not found) says nothing of another's at the same destination."""
        cfg = self.config
        for s in sessions:
            key = (order.kind, s, order.instance_id)
            failures = self._backoff.get(key, (0, 0.0))[0] + 1
            wait = min(
                cfg.retry_backoff_max_seconds, cfg.retry_backoff_seconds * 2 ** (failures - 1)
            )
            self._backoff[key] = (failures, self._now + wait)

    def _succeeded(self, order: Order, sessions: Iterable[str]) -> None:
        for s in sessions:
            self._backoff.pop((order.kind, s, order.instance_id), None)

    def retire_landed(self) -> list[Cancel]:
        """Open prefetches whose blocks all show at the destination: landed, if an agent took
        them; if none did, the blocks came by other means (a request loaded them): the order is
        withdrawn, neither completed nor used."""
        cancels = []
        for order_id, e in list(self._open.items()):
            o = e.order
            if o.kind == "prefetch" and all(
                self.store.holds(o.tier, o.instance_id, o.block_hashes)
            ):
                del self._open[order_id]
                if e.started:
                    self._release(order_id, False)
                    self._has_landed(order_id, e)
                else:
                    self._release(order_id, True)
                    self.totals.cancelled += 1
                    cancels.append(Cancel(order_id=order_id, reason="its blocks are there already"))
        return cancels

    def _has_landed(self, order_id: str, e: _Open) -> None:
        """A prefetch completed: used already if a session it served came back there while it
        moved; otherwise it waits for one of the sessions still advised on."""
        self.totals.completed += 1
        if e.order.kind != "prefetch":
            return
        self._deliver(order_id, e)
        if e.used:
            self.totals.bytes_used += e.order.size_bytes
            return
        waiting = {s for s in e.served if self._advice_of(s) is not None}
        if not waiting:
            self.totals.bytes_unused += e.order.size_bytes
            return
        self._landed[order_id] = _Landed(
            e.order.instance_id, e.order.size_bytes, waiting, e.order.block_hashes
        )
        for s in waiting:
            self._landed_by_session.setdefault(s, set()).add(order_id)

    def give_up_overdue(self, now: float) -> list[Cancel]:
        cutoff = now - self.config.overdue_seconds
        cancels = []
        for order_id, e in list(self._open.items()):
            if e.order.needed_by_ts > cutoff:
                continue
            del self._open[order_id]
            self._release(order_id, True)
            if e.started:
                self.totals.failed += 1
                self._failed(e.order, e.served)
            else:
                self.totals.cancelled += 1
                cancels.append(Cancel(order_id=order_id, reason="not done in time"))
        return cancels

    def cancel_fallen(self) -> list[Cancel]:
        cancels = []
        for order_id, e in list(self._open.items()):
            if e.order.kind != "prefetch":
                continue
            still = set()
            for s in e.sessions:
                latest = self._advice_of(s)
                if (
                    latest is not None
                    and latest.instance_id == e.order.instance_id
                    and latest.p_back_soon >= self.config.cancel_below_p
                ):
                    still.add(s)
            e.sessions = still
            if still:
                continue
            if e.started:
                if not e.used and not e.wasted:
                    e.wasted = True  # moving already: it lands unused
                    self.totals.bytes_wasted += e.order.size_bytes
                continue
            del self._open[order_id]
            self._release(order_id, True)
            self.totals.cancelled += 1
            cancels.append(
                Cancel(order_id=order_id, reason="no session is likely back there in time")
            )
        return cancels

    # -- a planning replica's hand-over (decisions.md, 23) ------------------------------------

    def handover_state(self) -> dict[str, str]:
        """The open orders (`o:<id>`), the pinned (`p:<session>`) and demoted (`d:<session>`)
        spells, the delivered memory (`l:<order id>`), the retries waiting (`b:<[kind, session,
        instance]>`). Field -> value, for a Redis hash."""
        out: dict[str, str] = {}
        encoded: dict[str, tuple[Order, bool, str]] = {}
        for order_id, e in list(self._open.items()):
            cached = self._encoded.get(order_id)
            if cached is None or cached[0] is not e.order or cached[1] != e.started:
                value = ("1" if e.started else "0") + e.order.to_json().decode()
                cached = (e.order, e.started, value)
            encoded[order_id] = cached
            out[f"o:{order_id}"] = cached[2]
        self._encoded = encoded
        for session_id, (spell, until) in list(self.pinned.items()):
            out[f"p:{session_id}"] = orjson.dumps([spell, until]).decode()
        for session_id, spell in list(self.demoted.items()):
            out[f"d:{session_id}"] = orjson.dumps(spell).decode()
        for (kind, sid, inst), (failures, retry_at) in list(self._backoff.items()):
            out["b:" + orjson.dumps([kind, sid, inst]).decode()] = orjson.dumps(
                [failures, retry_at]
            ).decode()
        for rid, rec in list(self._delivered.items()):
            handed = self._handed.get(rid)
            if handed is None:
                handed = self._handed[rid] = orjson.dumps(
                    {
                        "i": rec.instance_id,
                        "t": rec.tier,
                        "b": list(rec.blocks),
                        "s": rec.sessions,
                        "u": rec.until,
                    }
                ).decode()
            out[f"l:{rid}"] = handed
        return out

    def take_over(self, state: dict[str, str]) -> int:
        """The hand-over state the last planner wrote, in place of what this book held: its open
        orders count as open here, its pins and demotes as done, its deliveries as delivered.
        Returns the orders adopted."""
        self._open.clear()
        self._served_by.clear()
        self.pinned.clear()
        self.demoted.clear()
        self._encoded.clear()
        self._delivered.clear()
        self._delivered_at.clear()
        self._delivered_for.clear()
        self._delivered_until.clear()
        self._handed.clear()
        self._backoff.clear()
        for field_, value in state.items():
            kind, _, key = field_.partition(":")
            try:
                if kind == "o":
                    order = from_json(value[1:])
                    if not isinstance(order, Order):
                        continue
                    sessions = set(order.session_ids)
                    self._open[key] = _Open(
                        order, started=value[0] == "1", sessions=sessions, served=set(sessions)
                    )
                    for sid in sessions:
                        self._served_by.setdefault(sid, set()).add(key)
                elif kind == "p":
                    spell, until = orjson.loads(value)
                    self.pinned[key] = (tuple(spell), float(until))
                elif kind == "d":
                    self.demoted[key] = tuple(orjson.loads(value))
                elif kind == "b":
                    what, sid, inst = orjson.loads(key)
                    failures, retry_at = orjson.loads(value)
                    self._backoff[(str(what), str(sid), str(inst))] = (
                        int(failures),
                        float(retry_at),
                    )
                elif kind == "l":
                    d = orjson.loads(value)
                    spells: dict[str, Spell | None] = {
                        sid: None if spell is None else tuple(spell)
                        for sid, spell in d["s"].items()
                    }
                    blocks = set(d["b"])
                    if blocks and spells:
                        self._remember(
                            key, _Delivered(d["i"], d["t"], blocks, spells, float(d["u"]))
                        )
            except (
                ValueError,
                TypeError,
                KeyError,
                AttributeError,
            ) as exc:  # one bad entry must not stop the take-over
                log.warning("hand-over entry %r unreadable: %s", field_, exc)
        return len(self._open)

    # -- views -------------------------------------------------------------------------------

    def open_order(self, order_id: str) -> Order | None:
        e = self._open.get(order_id)
        return None if e is None else e.order

    def open_orders(self) -> list[Order]:
        # Copied at once (one C call): with the Redis store the planning side changes _open on
        # the store thread while a route on the loop reads (app/state/storethread.py).
        return [e.order for e in list(self._open.values())]

    def is_open(self, order_id: str) -> bool:
        return order_id in self._open

    def inflight_bytes(self, instance_id: str) -> int:
        return sum(
            e.order.size_bytes
            for e in self._open.values()
            if e.order.kind == "prefetch" and e.order.instance_id == instance_id
        )

    def inflight_by_instance(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self._open.values():
            if e.order.kind == "prefetch":
                out[e.order.instance_id] = out.get(e.order.instance_id, 0) + e.order.size_bytes
        return out

    def inflight_blocks(self) -> dict[str, set[BlockHash]]:
        out: dict[str, set[BlockHash]] = {}
        for e in self._open.values():
            if e.order.kind == "prefetch":
                out.setdefault(e.order.instance_id, set()).update(e.order.block_hashes)
        return out
