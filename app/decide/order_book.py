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
  moving runs on and lands as any.
- **Pins and demotes**: the idle spell each session's context was pinned (until when) or demoted
  for, so each is ordered once per spell, a pin again only when it is about to lapse. A pin is
  held only once its order completed (confirmed); until then it is on its way, not ordered again.
  One that failed, or that nobody answered for `overdue_seconds`, is decided again once its
  backoff passed (below); a confirmed pin reported failed later was lost by its tier (the LMCache
  sink reports its pins lost when its coordinator restarted): ordered again at the next tick.
  A demote is tracked the same way. When the LRU guard turns an instance's advice off
  (`withdraw`), its pins and demotes are cancelled and forgotten.
- **Delivered memory.** A completed prefetch is remembered as delivered to its place (instance
  and tier) and, meanwhile, its blocks count as there: never ordered there again. A tier may load
  into a cache of its own that nothing reports (LMCache loads into its L1; the engine reports
  blocks only once a request uses them), so without it the next tick would order them again. It
  stands until the engine reports the blocks gone there (kv_blocks_removed, block by block, or
  kv_blocks_cleared; the feedback observer, app/decide/dispatcher.py, tells the book), until the
  advice changes for every session it served (a new spell: the session had a turn, or is advised
  for another instance; or it was routed or closed), or until the order's ttl passes (the hold it
  asked for; the lead when it named none).
- **Honest waste.** Every landed prefetch byte (the blocks' bytes, as ordered) ends used or
  wasted, or still waits: used + wasted + waiting = landed (`SchedulerTotals`). Used: a request
  routed to its instance reuses the block (it is in the prefix of request_routed's block hashes
  that the instance holds, in HBM or landed: a prefix cache stops at the first miss; a router that
  names no blocks: the blocks landed there for its session). Wasted: the block is evicted
  (kv_blocks_removed, kv_blocks_cleared), demoted (a demote order for it), or its hold (the
  order's ttl) passes before a request used it. The replay's `bytes_prefetched_unused` counts
  the same (prefetched blocks evicted before use or never used). A prefetch whose sessions fell
  while it moved is not wasted for that: it lands, and may still be used.
- **Retries with backoff.** A failed order (reported failed, refused by the sink, or given up
  overdue after it started) makes each session it served wait before the next order of its kind
  to that destination: `retry_backoff_seconds`, doubling with each failure in a row, at most
  `retry_backoff_max_seconds`; a completion clears it. Keyed by session and destination (see
  `_failed` for why).
- **Hand-over** (`handover_state`, `take_over`): what a planning replica taking over from this
  one needs so as not to order anything twice (decisions.md, 23).

The book reads the scheduler's latest advice through `advice_of` and gives a withdrawn order's
link time back through `release`: the link bookings are the scheduler's room-and-links part's
(app/decide/room_and_links.py).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar

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
    # Landed prefetch bytes (what the completion reports moved, at most the order's): each ends
    # used (a request routed to their instance named them), or wasted (evicted, demoted, or its
    # ttl passed before a request used it), or is still waiting: used + wasted + waiting == landed.
    bytes_landed: int = 0
    bytes_used: int = 0
    bytes_wasted: int = 0
    bytes_waiting: int = 0

    @property
    def bytes_unused(self) -> int:
        """The landed bytes that ended unused: the wasted ones (the replay's name for them)."""
        return self.bytes_wasted


@dataclass(slots=True)
class _Open:
    order: Order
    started: bool = False
    sessions: set[str] = field(default_factory=set)
    used: bool = False  # a session it served was routed to its destination
    served: set[str] = field(default_factory=set)  # every session it was ordered for
    # The spell each session was served at (None: adopted from a hand-over, not known).
    spells: dict[str, Spell | None] = field(default_factory=dict)


RetentionKind = Literal["pin", "demote"]


@dataclass(slots=True)
class _Retention:
    """A pin or demote ordered for one spell of a session's context."""

    kind: RetentionKind
    spell: Spell
    order_id: str
    instance_id: str
    until: float = 0.0  # a pin's end
    confirmed: bool = False  # its order completed
    ordered_at: float = 0.0


@dataclass(slots=True)
class _Landed:
    """A landed prefetch at its place (see the module doc): its delivery stands while it stands
    for a session; its bytes wait for a request until used or wasted."""

    instance_id: str
    tier: str
    blocks: set[BlockHash]  # landed and not reported gone (nor demoted) since
    waiting: set[BlockHash]  # landed, neither used nor wasted yet
    sessions: dict[str, Spell | None]  # the sessions it stands for, at the spell it served
    until: float  # its ttl's end
    block_bytes: int


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
        # session -> the pin or demote of its context ordered last (one at a time: a pin and a
        # demote of the same context undo each other); order id -> its session.
        self._retention: dict[str, _Retention] = {}
        self._retention_order: dict[str, str] = {}
        # (ordered at, order id) of pins and demotes not confirmed yet, a heap: the silent ones
        # are given up overdue.
        self._unconfirmed: list[tuple[float, str]] = []
        # session -> when its failed or lost pin or demote is due to be decided again.
        self._retention_due: dict[str, float] = {}
        self.pins_lost = 0  # confirmed pins the tier reported lost since
        # order id -> (the order, its hand-over value), so an unchanged order is not re-encoded.
        self._encoded: dict[str, tuple[Order, bool, str]] = {}
        # Landed prefetches: order id -> its record; (instance, tier) -> block -> the records
        # whose block it is there, and those of the records standing; session -> the records
        # standing for it; (until, id), a heap.
        self._landed: dict[str, _Landed] = {}
        self._landed_at: dict[tuple[str, str], dict[BlockHash, set[str]]] = {}
        self._standing_at: dict[tuple[str, str], dict[BlockHash, set[str]]] = {}
        self._standing_for: dict[str, set[str]] = {}
        self._landed_until: list[tuple[float, str]] = []
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
        """Whether a keep advice for this spell needs a pin now: none ordered for it (or the
        last failed, was lost or went unanswered, and its backoff passed), or it is about to
        lapse. A pin ordered and not confirmed yet is on its way: not ordered again."""
        if self.backing_off("pin", session_id, spell[0]):
            return False
        r = self._retention.get(session_id)
        return (
            r is None
            or r.kind != "pin"
            or r.spell != spell
            or r.until - self.config.repin_before_seconds <= now
        )

    def wants_demote(self, session_id: str, spell: Spell) -> bool:
        """Whether a demote advice for this spell needs a demote: none ordered for it (or the
        last failed or went unanswered, and its backoff passed)."""
        if self.backing_off("demote", session_id, spell[0]):
            return False
        r = self._retention.get(session_id)
        return r is None or r.kind != "demote" or r.spell != spell

    def pin_ordered(self, order: Order, session_id: str, spell: Spell, until: float) -> None:
        self._retained(
            session_id, _Retention("pin", spell, order.order_id, order.instance_id, until)
        )

    def demote_ordered(self, order: Order, session_id: str, spell: Spell) -> None:
        """A demote: its blocks go first at their place, so landed ones waiting there count as
        wasted now (whether or not the tier reports them gone)."""
        self._retained(session_id, _Retention("demote", spell, order.order_id, order.instance_id))
        self._gone((order.instance_id, order.tier), order.block_hashes)

    def _retained(self, session_id: str, r: _Retention) -> None:
        self._drop_retention(session_id)
        r.ordered_at = self._now
        self._retention[session_id] = r
        self._retention_order[r.order_id] = session_id
        heapq.heappush(self._unconfirmed, (r.ordered_at, r.order_id))

    def _drop_retention(self, session_id: str) -> None:
        old = self._retention.pop(session_id, None)
        if old is not None:
            self._retention_order.pop(old.order_id, None)

    def _adopt(self, session_id: str, r: _Retention, confirmed: bool, ordered_at: float) -> None:
        """A pin or demote from the hand-over."""
        r.confirmed, r.ordered_at = bool(confirmed), float(ordered_at)
        self._retention[session_id] = r
        if r.order_id:
            self._retention_order[r.order_id] = session_id
            if not r.confirmed:
                heapq.heappush(self._unconfirmed, (r.ordered_at, r.order_id))

    def withdraw(
        self,
        instance_id: str,
        now: float,
        kinds: Collection[RetentionKind] = ("pin", "demote"),
    ) -> list[Cancel]:
        """The instance's advice is off (the LRU guard), or its demotes: a Cancel for each pin
        or demote of `kinds` there, on its way or carried out (a pin that lapsed is the tier's
        own already), and the book forgets them and any retried one due there, so they are
        decided again when the advice is back on."""
        cancels = []
        for session_id, r in list(self._retention.items()):
            if r.instance_id != instance_id or r.kind not in kinds:
                continue
            self._drop_retention(session_id)
            if r.order_id and not (r.kind == "pin" and r.confirmed and r.until <= now):
                cancels.append(Cancel(order_id=r.order_id, reason=f"advice off at {instance_id}"))
        for session_id in list(self._retention_due):
            a = self._advice_of(session_id)
            kind = "pin" if a is not None and a.retention == "keep" else "demote"
            if a is not None and a.instance_id == instance_id and kind in kinds:
                del self._retention_due[session_id]
        return cancels

    def retention_due(self, now: float) -> list[str]:
        """Sessions whose pin or demote failed, was lost or went unanswered, and whose backoff
        has passed: their retention is to be decided again now."""
        due = [s for s, at in self._retention_due.items() if at <= now]
        for s in due:
            del self._retention_due[s]
        return due

    def _retention_progress(self, session_id: str, order_id: str, status: str) -> None:
        r = self._retention.get(session_id)
        if r is None or r.order_id != order_id:
            return  # replaced since: its news no longer matters
        if status == "completed":
            r.confirmed = True
            self._backoff.pop((r.kind, session_id, r.instance_id), None)
            if r.kind == "demote":
                self._retention_order.pop(order_id, None)  # done: nothing more will come
        elif status == "failed":
            self._drop_retention(session_id)
            if r.confirmed:
                # A pin the tier lost (its restart): ordered again at the next tick.
                self.pins_lost += 1
                self._retention_due[session_id] = self._now
            else:
                self._retention_failed(session_id, r)

    def _retention_failed(self, session_id: str, r: _Retention) -> None:
        key = (r.kind, session_id, r.instance_id)
        self._backoff[key] = self._next_try(key)
        self._retention_due[session_id] = self._backoff[key][1]

    def _give_up_unconfirmed(self, now: float) -> None:
        """Pins and demotes nobody answered for `overdue_seconds` count as failed."""
        cutoff = now - self.config.overdue_seconds
        heap = self._unconfirmed
        while heap and heap[0][0] <= cutoff:
            _, order_id = heapq.heappop(heap)
            session_id = self._retention_order.get(order_id)
            if session_id is None:
                continue  # replaced, or done
            r = self._retention.get(session_id)
            if r is None or r.order_id != order_id or r.confirmed:
                continue
            self._drop_retention(session_id)
            self._retention_failed(session_id, r)

    def pins_at(self, instance_id: str, now: float) -> list[str]:
        """The sessions with a pin ordered at the instance and not lapsed."""
        return [
            session_id
            for session_id, r in self._retention.items()
            if r.kind == "pin" and r.instance_id == instance_id and r.until > now
        ]

    def release_pin(self, session_id: str) -> list[Cancel]:
        """The session's pin is released (a Cancel of its order) and forgotten: decided again
        when its session is advised again."""
        r = self._retention.get(session_id)
        if r is None or r.kind != "pin":
            return []
        self._drop_retention(session_id)
        return [Cancel(order_id=r.order_id, reason=f"not worth its room at {r.instance_id}")]

    @property
    def pins_held(self) -> int:
        """Pins confirmed by their tier and not lapsed."""
        return sum(
            1
            for r in list(self._retention.values())
            if r.kind == "pin" and r.confirmed and r.until > self._now
        )

    @property
    def pins_pending(self) -> int:
        """Pins ordered and not confirmed yet."""
        return sum(1 for r in list(self._retention.values()) if r.kind == "pin" and not r.confirmed)

    # -- landed prefetches: delivered memory and waste ----------------------------------------

    def delivered(self, instance_id: str, tier: str = "hbm") -> Mapping[BlockHash, set[str]]:
        """The blocks at this place that a completed prefetch delivered and still stands for."""
        return self._standing_at.get((instance_id, tier), _NOTHING)

    def advised(self, a: SessionAdvice) -> None:
        """The session's latest advice: a delivery made for another spell of it no longer
        stands for it."""
        for rid in list(self._standing_for.get(a.session_id, ())):
            rec = self._landed[rid]
            spell = rec.sessions[a.session_id]
            if (
                a.instance_id != rec.instance_id
                or not a.block_hashes
                or (spell is not None and spell != spell_of(a))
            ):
                self._leave(rid, a.session_id)

    @property
    def holds_landed(self) -> bool:
        """Whether any landed prefetch is tracked at any place: if not, blocks reported gone
        change nothing here."""
        return bool(self._landed_at)

    def blocks_removed(
        self, tier: str, instance_id: str | None, blocks: Iterable[BlockHash]
    ) -> None:
        """The engine reports these blocks gone from the place (kv_blocks_removed)."""
        self._gone((instance_id or "", tier), blocks)

    def blocks_cleared(self, tier: str, instance_id: str | None) -> None:
        """Every block at the place is gone (kv_blocks_cleared: an engine restart)."""
        place = (instance_id or "", tier)
        self._gone(place, list(self._landed_at.get(place, ())))

    def _gone(self, place: tuple[str, str], blocks: Iterable[BlockHash]) -> None:
        """Blocks no longer at the place (evicted, demoted, cleared): the ones still waiting
        for a request were wasted, and no delivery stands for them there."""
        at = self._landed_at.get(place)
        if not at:
            return
        standing = self._standing_at.get(place, {})
        touched: set[str] = set()
        for b in blocks:
            rids = at.pop(b, None)
            if not rids:
                continue
            standing.pop(b, None)
            for rid in rids:
                rec = self._landed[rid]
                rec.blocks.discard(b)
                if b in rec.waiting:
                    rec.waiting.discard(b)
                    self.totals.bytes_wasted += rec.block_bytes
                    self.totals.bytes_waiting -= rec.block_bytes
                touched.add(rid)
        self._tidy(place)
        for rid in touched:
            self._handed.pop(rid, None)
            self._settle(rid)

    def _used(self, place: tuple[str, str], blocks: Iterable[BlockHash]) -> None:
        """A request routed to the place names these blocks: the landed ones waiting are used."""
        at = self._landed_at.get(place)
        if not at:
            return
        touched: set[str] = set()
        for b in blocks:
            for rid in at.get(b, ()):
                rec = self._landed[rid]
                if b in rec.waiting:
                    rec.waiting.discard(b)
                    self.totals.bytes_used += rec.block_bytes
                    self.totals.bytes_waiting -= rec.block_bytes
                    touched.add(rid)
        for rid in touched:
            self._handed.pop(rid, None)
            self._settle(rid)

    def _reusable(self, instance_id: str, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """The prefix of a request's blocks its engine finds at the instance (in HBM, or landed
        there): a prefix cache stops at the first block it misses, so a landed block past it is
        loaded or computed again, not used."""
        blocks = list(dict.fromkeys(block_hashes))
        landed = self._landed_at.get((instance_id, "hbm"), _NOTHING)
        held = self.store.holds("hbm", instance_id, blocks)
        for i, (b, h) in enumerate(zip(blocks, held)):
            if not h and b not in landed:
                return blocks[:i]
        return blocks

    def _land(self, order_id: str, e: _Open, moved_bytes: int | None = None) -> None:
        """A prefetch landed: its bytes count as landed, used already if a session it served
        was routed there while it moved, else waiting; its delivery stands for the sessions still
        advised on at the spell it was ordered for, until its ttl passes. The bytes are those the
        completion reports moved (a block there already, or one the tier did not find, moves
        nothing), spread over its blocks; the order's when it reports none."""
        o = e.order
        blocks = set(o.block_hashes)
        moved = o.size_bytes if moved_bytes is None else min(moved_bytes, o.size_bytes)
        block_bytes = moved // max(len(blocks), 1)
        nbytes = block_bytes * len(blocks)
        t = self.totals
        t.bytes_landed += nbytes
        if e.used or not nbytes:
            t.bytes_used += nbytes
            waiting: set[BlockHash] = set()
        else:
            t.bytes_waiting += nbytes
            waiting = set(blocks)
        sessions: dict[str, Spell | None] = {}
        for s in e.served:
            latest = self._advice_of(s)
            spell = e.spells.get(s)
            if latest is not None and (
                spell is None or (latest.block_hashes and spell_of(latest) == spell)
            ):
                sessions[s] = spell
        if not sessions and not waiting:
            return
        ttl = o.ttl_seconds if o.ttl_seconds is not None else self.config.lead_seconds
        self._remember(
            order_id,
            _Landed(o.instance_id, o.tier, blocks, waiting, sessions, self._now + ttl, block_bytes),
        )

    def _remember(self, rid: str, rec: _Landed) -> None:
        self._landed[rid] = rec
        place = (rec.instance_id, rec.tier)
        at = self._landed_at.setdefault(place, {})
        for b in rec.blocks:
            at.setdefault(b, set()).add(rid)
        if rec.sessions:
            self._stand(rid, rec)
        heapq.heappush(self._landed_until, (rec.until, rid))

    def _stand(self, rid: str, rec: _Landed) -> None:
        standing = self._standing_at.setdefault((rec.instance_id, rec.tier), {})
        for b in rec.blocks:
            standing.setdefault(b, set()).add(rid)
        for s in rec.sessions:
            self._standing_for.setdefault(s, set()).add(rid)

    def _leave(self, rid: str, session_id: str) -> None:
        """The delivery no longer stands for the session; with none left, it no longer stands
        (its bytes may still wait for a request)."""
        rec = self._landed[rid]
        rec.sessions.pop(session_id, None)
        self._handed.pop(rid, None)
        self._unlink(self._standing_for, session_id, rid)
        if not rec.sessions:
            self._unstand(rid, rec)
            self._settle(rid)

    def _unstand(self, rid: str, rec: _Landed) -> None:
        place = (rec.instance_id, rec.tier)
        standing = self._standing_at.get(place, {})
        for b in rec.blocks:
            self._unlink(standing, b, rid)
        if not standing:
            self._standing_at.pop(place, None)
        for s in rec.sessions:
            self._unlink(self._standing_for, s, rid)

    def _settle(self, rid: str) -> None:
        """A record with nothing left there, or neither standing nor waiting, is forgotten."""
        rec = self._landed[rid]
        if not rec.blocks or (not rec.sessions and not rec.waiting):
            self._drop(rid)

    def _drop(self, rid: str) -> None:
        rec = self._landed.pop(rid)
        self._handed.pop(rid, None)
        if rec.waiting:  # its ttl passed first
            nbytes = rec.block_bytes * len(rec.waiting)
            self.totals.bytes_wasted += nbytes
            self.totals.bytes_waiting -= nbytes
        if rec.sessions:
            self._unstand(rid, rec)
        place = (rec.instance_id, rec.tier)
        at = self._landed_at.get(place, {})
        for b in rec.blocks:
            self._unlink(at, b, rid)
        self._tidy(place)

    def _tidy(self, place: tuple[str, str]) -> None:
        for index in (self._landed_at, self._standing_at):
            if not index.get(place, True):
                del index[place]

    @staticmethod
    def _unlink(index: dict[_K, set[str]], key: _K, rid: str) -> None:
        rids = index.get(key)
        if rids is not None:
            rids.discard(rid)
            if not rids:
                del index[key]

    def _expire_landed(self, now: float) -> None:
        """Landed prefetches past their ttl: whatever still waits was wasted (the hold it was
        fetched for is over), and the delivery no longer stands."""
        heap = self._landed_until
        while heap and heap[0][0] <= now:
            until, rid = heapq.heappop(heap)
            rec = self._landed.get(rid)
            if rec is not None and rec.until == until:
                self._drop(rid)

    # -- what comes back ---------------------------------------------------------------------

    def forget(
        self,
        session_id: str,
        *,
        routed_to: str | None = None,
        block_hashes: Sequence[BlockHash] | None = None,
        release_pin: bool = False,
    ) -> list[Cancel]:
        """The session is active again (routed to `routed_to`, its prompt's `block_hashes` when
        the router names them) or closed. The landed blocks its request names at `routed_to` are
        used; without the blocks, those of the prefetches landed there for it. An order moving
        its context to where it was routed is used by that request, not wasted. With
        `release_pin`, a pin of its context not lapsed yet is released: returns its Cancel."""
        r = self._retention.get(session_id)
        cancels = (
            [Cancel(order_id=r.order_id, reason="its session is back or closed")]
            if release_pin and r is not None and r.kind == "pin" and r.until > self._now
            else []
        )
        self._drop_retention(session_id)
        self._retention_due.pop(session_id, None)
        standing = list(self._standing_for.get(session_id, ()))
        if routed_to is not None:
            if block_hashes:
                if (routed_to, "hbm") in self._landed_at:  # else nothing landed there waits
                    self._used((routed_to, "hbm"), self._reusable(routed_to, block_hashes))
            else:
                for rid in standing:
                    rec = self._landed[rid]
                    if rec.instance_id == routed_to:
                        self._used((routed_to, rec.tier), list(rec.waiting))
        for rid in standing:
            if rid in self._landed:
                self._leave(rid, session_id)
        for order_id in self._served_by.pop(session_id, ()):
            e = self._open.get(order_id)
            if e is not None and routed_to == e.order.instance_id:
                e.used = True
        return cancels

    def on_progress(self, order_id: str, status: str, nbytes: int | None = None) -> None:
        """An order_progress event (`nbytes`: the bytes a completion reports moved); unknown ids
        are a no-op (another replica's, or long done)."""
        entry = self._open.get(order_id)
        if entry is None:
            retained = self._retention_order.get(order_id)
            if retained is not None:
                self._retention_progress(retained, order_id, status)
            return
        if status == "accepted":
            entry.started = True
        elif status in ("completed", "failed"):
            del self._open[order_id]
            self._release(order_id, False)
            if status == "completed":
                self._succeeded(entry.order, entry.served)
                self._has_landed(order_id, entry, nbytes)
            else:
                self.totals.failed += 1
                self._failed(entry.order, entry.served)

    # -- each tick ---------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """A planning tick starts at `now`: deliveries past their ttl are forgotten, and so are
        backoffs long past (a failure after a quiet spell starts from the first wait again)."""
        self._now = now
        self._expire_landed(now)
        self._give_up_unconfirmed(now)
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
        for s in sessions:
            key = (order.kind, s, order.instance_id)
            self._backoff[key] = self._next_try(key)

    def _next_try(self, key: tuple[str, str, str]) -> tuple[int, float]:
        cfg = self.config
        failures = self._backoff.get(key, (0, 0.0))[0] + 1
        wait = min(cfg.retry_backoff_max_seconds, cfg.retry_backoff_seconds * 2 ** (failures - 1))
        return failures, self._now + wait

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

    def _has_landed(self, order_id: str, e: _Open, nbytes: int | None = None) -> None:
        self.totals.completed += 1
        if e.order.kind == "prefetch":
            self._land(order_id, e, nbytes)

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
                continue  # moving already: it lands, and is used or wasted as any
            del self._open[order_id]
            self._release(order_id, True)
            self.totals.cancelled += 1
            cancels.append(
                Cancel(order_id=order_id, reason="no session is likely back there in time")
            )
        return cancels

    # -- a planning replica's hand-over (decisions.md, 23) ------------------------------------

    def handover_state(self) -> dict[str, str]:
        """The open orders (`o:<id>`); the pins (`p:<session>`: spell, until, order id,
        confirmed, when ordered) and demotes (`d:<session>`) of each session's context, and the
        sessions whose failed one is due again (`r:<session>`); the delivered memory
        (`l:<order id>`); the retries waiting (`b:<[kind, session, instance]>`). Field -> value,
        for a Redis hash."""
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
        for session_id, r in list(self._retention.items()):
            fields: list[object] = (
                [r.spell, r.until, r.order_id, r.confirmed, r.ordered_at]
                if r.kind == "pin"
                else [r.spell, r.order_id, r.confirmed, r.ordered_at]
            )
            out[f"{r.kind[0]}:{session_id}"] = orjson.dumps(fields).decode()
        for session_id, at in list(self._retention_due.items()):
            out[f"r:{session_id}"] = orjson.dumps(at).decode()
        for (kind, sid, inst), (failures, retry_at) in list(self._backoff.items()):
            out["b:" + orjson.dumps([kind, sid, inst]).decode()] = orjson.dumps(
                [failures, retry_at]
            ).decode()
        for rid, rec in list(self._landed.items()):
            if not rec.sessions:
                continue  # only its accounting is left: this replica's own
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
        """The hand-over state the last planning replica wrote, in place of what this book held:
        its open orders count as open here, its pins and demotes as done, its deliveries as
        delivered. Returns the orders adopted."""
        self._open.clear()
        self._served_by.clear()
        self._retention.clear()
        self._retention_order.clear()
        self._unconfirmed.clear()
        self._retention_due.clear()
        self._encoded.clear()
        self._handed.clear()
        # The deliveries standing are the state's from now; the landed bytes' accounting is this
        # replica's own and goes on (the bytes another planner landed are counted there).
        for rid, rec in list(self._landed.items()):
            if rec.sessions:
                self._unstand(rid, rec)
                rec.sessions = {}
            self._settle(rid)
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
                    v = orjson.loads(value)
                    # An older planner wrote [spell, until]: taken as confirmed, its id unknown.
                    order_id, confirmed, at = v[2:] if len(v) == 5 else ("", True, 0.0)
                    self._adopt(
                        key,
                        _Retention("pin", tuple(v[0]), order_id, v[0][0], float(v[1])),
                        confirmed,
                        at,
                    )
                elif kind == "d":
                    v = orjson.loads(value)
                    # An older planner wrote the spell alone.
                    spell, order_id, confirmed, at = (
                        v if len(v) == 4 and isinstance(v[0], list) else (v, "", True, 0.0)
                    )
                    self._adopt(
                        key, _Retention("demote", tuple(spell), order_id, spell[0]), confirmed, at
                    )
                elif kind == "r":
                    self._retention_due[key] = float(orjson.loads(value))
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
                    mine = self._landed.get(key)
                    if mine is not None:  # landed here in an earlier term: it stands again
                        mine.sessions, mine.until = spells, float(d["u"])
                        self._stand(key, mine)
                        heapq.heappush(self._landed_until, (mine.until, key))
                    elif blocks and spells:
                        self._remember(
                            key,
                            _Landed(d["i"], d["t"], blocks, set(), spells, float(d["u"]), 0),
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
