"""From advice to orders: what to move, from where, to which instance, when; within the links and
the destinations' room, never twice, and withdrawn when the prediction falls.

One `plan(advice, now)` per tick turns the planner's per-session advice (app/decide/advisor.py)
into a `Plan` of orders (client/kvprefetch_client/orders.py) and cancels:

- **Prefetch** for sessions likely back on their instance within the lead time, held on landing
  (the order's ttl) for as long as the context would be kept, at least the lead. Value = P(back
  there in time) x the stall it avoids (the missing bytes' time to last byte over the link, or
  their recompute time if that is shorter); cost = the bytes not already at the destination or
  on their way. Best value per byte first. needed_by = now + the advice's `needed_in_seconds`:
  when the model's arrival curve says 10% of the returns it expects within the lead have come,
  so landing later would miss them (a signal that says "within seconds" gives a needed_by of
  about now); without it, `needed_within_fraction` of the lead (the curve taken as flat).
  start_by = needed_by - the transfer's time at the link's prefetch share - a margin; when that
  has passed (a short lead), at once if the link's share is free now, its needed_by then when it
  can land.
- **Dedup.** A block at the destination, in an open order to it, or delivered there by a
  prefetch that still stands (the order book's delivered memory), is never ordered again; a
  block several candidates share goes in the first (most valuable) order, which then serves
  every one of them: its value is their sum.
- **Room and links** are the room-and-links part's (app/decide/room_and_links.py,
  `Scheduler.room`), handed each candidate's missing blocks: their sources (host DRAM first,
  then the pool; blocks in neither are recomputed, nothing to move), the stall each order avoids
  (its load or recompute, whichever is sooner: the rules the replay's cluster follows too), each
  link's prefetch share (`link_share`) booked in disjoint intervals (an order that cannot land by
  its needed_by is not issued), and the destination's room: its free KV bytes less what is on its
  way, nearly free, so the candidate's chance need only clear `prefetch_min_p`; when short, a
  swap made only against contexts less likely back than the candidate (demoted to make room, and
  the demote orders say so), and past those, for a candidate more likely back than `keep_min_p`,
  what the destination's own eviction (LRU) takes next: content no advice keeps, since every
  advised context there has a chance below `keep_min_p` or it would be kept (the tier evicts for
  it, by its own order, which leaves pinned contexts for last: no order names what goes). A
  destination that never reported its room gets no prefetch.
- **Pins and demotes** follow the planner's keep and demote advice, once per idle spell, and a
  pin again only when the last one is about to lapse. Where the LRU guard turns an instance's
  advice off (`withdraw`, app/decide/guard.py), they are cancelled: a pin's cancel releases it,
  a demote's puts its blocks back in LRU order.

What became of each order is the order book's (app/decide/order_book.py, `Scheduler.book`): the
open orders and their progress (order_progress events, `on_progress`), retiring landed ones,
giving up overdue ones, cancelling those whose sessions fell (an open prefetch not yet started
whose sessions are no longer candidates: closed, back already, routed elsewhere, or their chance
fell below `cancel_below_p`), the pins' and demotes' spells, the landed prefetches' use, the
totals, and the hand-over to the next planning term; it keeps completed prefetches as delivered,
holds pins only once confirmed, retries what failed with backoff, and counts every landed byte
used or wasted. The scheduler plans (the candidates, what each misses, who shares an order) and
asks the book what is open, delivered, pinned, demoted or backing off.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.core.cluster import (
    BLOCK_TOKENS,
    HOST_LINK_BYTES_PER_SECOND,
    LINK_SHARE,
    POOL_LINK_BYTES_PER_SECOND,
    PREFILL_TOKENS_PER_SECOND,
    ClusterSpec,
)
from app.decide.advisor import SessionAdvice, Thresholds
from app.decide.order_book import OrderBook, RetentionKind, SchedulerTotals, spell_of
from app.decide.room_and_links import RoomAndLinks
from app.predict.tool_durations import ToolDurations
from app.state.base import StateStore
from kvprefetch_client.events import BlockHash, Tier
from kvprefetch_client.orders import Cancel, Order, OrderKind, order_id_for

# A planning term's order ids start at its lease token times this (decisions.md, 23): ids of
# different terms never meet, so the sinks' fleet-wide dedupe never drops a new term's order.
TERM_GENERATIONS = 10**9

# The thresholds' defaults (the settings' too: KVP_LEAD_SECONDS and the rest).
_THRESHOLDS = Thresholds()


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    bytes_per_block: int
    lead_seconds: float = _THRESHOLDS.lead_seconds
    needed_within_fraction: float = 0.1
    prefetch_min_p: float = _THRESHOLDS.prefetch_min_p
    # A candidate more likely back than this may take what the destination's LRU evicts next.
    keep_min_p: float = _THRESHOLDS.keep_min_p
    # Hysteresis: an open order survives a small dip in its chance.
    cancel_below_p: float = _THRESHOLDS.cancel_below_p
    # The share of each link prefetch may use, so demand loads are never starved.
    link_share: float = LINK_SHARE
    pool_link_bytes_per_second: float = POOL_LINK_BYTES_PER_SECOND
    host_link_bytes_per_second: float = HOST_LINK_BYTES_PER_SECOND
    prefill_tokens_per_second: float = PREFILL_TOKENS_PER_SECOND
    block_tokens: int = BLOCK_TOKENS
    margin_seconds: float = 0.25
    # Re-pin when the current pin lapses within this long.
    repin_before_seconds: float = 5.0
    # An open prefetch not done this long past its needed_by is given up (see the module doc):
    # long enough for a dead agent's order to be taken over and finished (a stream entry is
    # claimed after 30 s by default), short enough that its room is not held for good.
    overdue_seconds: float = 60.0
    # A failed order's session waits this long before it is ordered to that destination again,
    # doubling with each failure in a row up to the cap (app/decide/order_book.py): a failing
    # destination is tried again, not every tick.
    retry_backoff_seconds: float = 1.0
    retry_backoff_max_seconds: float = 30.0
    # The tier's pins hold room (KVP_PINS_HOLD_ROOM): a pin is held only while worth the calls
    # waiting for room on its instance (`_worth_holding`).
    pins_hold_room: bool = False

    @classmethod
    def from_cluster(
        cls, cluster: ClusterSpec, thresholds: Thresholds | None = None, **kw: Any
    ) -> SchedulerConfig:
        """The cluster's numbers and the planner's thresholds (the ones the advisor reads)."""
        t = thresholds or Thresholds()
        return cls(
            bytes_per_block=cluster.bytes_per_block,
            block_tokens=cluster.block_tokens,
            link_share=cluster.link_share,
            pool_link_bytes_per_second=cluster.pool_link_bytes_per_second,
            host_link_bytes_per_second=cluster.host_link_bytes_per_second,
            prefill_tokens_per_second=cluster.prefill_tokens_per_second,
            lead_seconds=t.lead_seconds,
            prefetch_min_p=t.prefetch_min_p,
            keep_min_p=t.keep_min_p,
            cancel_below_p=t.cancel_below_p,
            **kw,
        )

    @property
    def cluster(self) -> ClusterSpec:
        """The cluster these numbers describe: its formulas are the scheduler's."""
        return ClusterSpec(
            bytes_per_token=self.bytes_per_block // self.block_tokens,
            block_tokens=self.block_tokens,
            pool_link_bytes_per_second=self.pool_link_bytes_per_second,
            host_link_bytes_per_second=self.host_link_bytes_per_second,
            prefill_tokens_per_second=self.prefill_tokens_per_second,
            link_share=self.link_share,
        )

    def link_bytes_per_second(self, source: Tier) -> float:
        return self.cluster.link_bytes_per_second(source)


@dataclass(frozen=True, slots=True)
class Plan:
    orders: list[Order]
    cancels: list[Cancel]


class Scheduler:
    """Advice in (`advise`, as sessions are scored: one at a finish, or a page per tick), sessions
    out (`forget`, when one is active again or closed), orders out (`plan`, each tick). The latest
    advice per session is kept, so a tick costs the candidates and the open orders, not every
    session tracked; advice not refreshed within `advice_ttl_seconds` is dropped. What became of
    each order is the order book's (`book`, app/decide/order_book.py)."""

    def __init__(
        self,
        store: StateStore,
        config: SchedulerConfig,
        *,
        advice_ttl_seconds: float = 120.0,
        tools: ToolDurations | None = None,
    ) -> None:
        self.store = store
        # The tools' run times: a pin of a context whose tool call will outlast its reload saves
        # nothing a prefetch back would not (`_worth_holding`).
        self.tools = tools
        self.config = config
        self.advice_ttl_seconds = advice_ttl_seconds
        self.book = OrderBook(store, config, advice_of=self._advice_of, release=self._release)
        self.room = RoomAndLinks(store, config, self.book, self._order)
        self._latest: dict[str, tuple[SessionAdvice, float]] = {}  # oldest update first
        self._candidates: dict[str, SessionAdvice] = {}
        # Advised since the last plan: retention to decide.
        self._fresh: dict[str, SessionAdvice] = {}
        self._generation = 0
        # What a tick cut short by a store failure decided: handed out by the next plan().
        self._carried: tuple[list[Cancel], list[Order]] = ([], [])

    @property
    def totals(self) -> SchedulerTotals:
        return self.book.totals

    # -- input ------------------------------------------------------------------------------

    def advise(self, advice: Sequence[SessionAdvice], now: float) -> None:
        for a in advice:
            self._latest.pop(a.session_id, None)
            self._latest[a.session_id] = (a, now)
            self._fresh[a.session_id] = a
            self.book.advised(a)
            if (
                a.prefetch
                and a.instance_id is not None
                and a.p_back_soon >= self.config.prefetch_min_p
            ):
                self._candidates[a.session_id] = a
            else:
                self._candidates.pop(a.session_id, None)

    def forget(
        self,
        session_id: str,
        *,
        routed_to: str | None = None,
        block_hashes: Sequence[BlockHash] | None = None,
        release_pin: bool = True,
    ) -> None:
        """The session is active again (routed to `routed_to`, with its prompt's `block_hashes`
        when the router names them) or closed: its advice is void. What landed there for it, and
        an order moving its context there, are used by that request, not wasted. Where pins hold
        room (`pins_hold_room`), its pin, which held the context for this return, is released
        with the next plan (`release_pin`): the engine holds what a running request uses, and a
        pin left to its TTL where the return did not land keeps room from every call there
        (issue 28). A soft pin keeps no call waiting, and a later return there may use it: it
        runs its TTL (releasing those too lost up to 0.048 byte hit under least-loaded routing
        on the shared traces: decisions 28)."""
        self._latest.pop(session_id, None)
        self._candidates.pop(session_id, None)
        self._fresh.pop(session_id, None)
        self._carried[0].extend(
            self.book.forget(
                session_id,
                routed_to=routed_to,
                block_hashes=block_hashes,
                release_pin=release_pin and self.config.pins_hold_room,
            )
        )

    def withdraw(
        self,
        instance_id: str,
        now: float,
        kinds: Collection[RetentionKind] = ("pin", "demote"),
    ) -> list[Cancel]:
        """The LRU guard turned the instance's advice off (or its demotes, `kinds` demote): its
        pins and demotes of `kinds` are cancelled with the next plan (OrderBook.withdraw), and
        the advice there not yet acted on is dropped (it would act before the advice the guard
        now allows replaces it). Returns the cancels."""
        cancels = self.book.withdraw(instance_id, now, kinds)
        self._carried[0].extend(cancels)
        everything = "pin" in kinds
        for held in (self._fresh, self._candidates):
            for session_id in [
                s
                for s, a in held.items()
                if a.instance_id == instance_id and (everything or a.retention == "demote")
            ]:
                del held[session_id]
        return cancels

    def on_progress(self, order_id: str, status: str, nbytes: int | None = None) -> None:
        """An order_progress event (`nbytes`: the bytes a completion reports moved); unknown ids
        are a no-op (another replica's, or long done)."""
        self.book.on_progress(order_id, status, nbytes)

    def blocks_removed(
        self, tier: str, instance_id: str | None, block_hashes: Iterable[BlockHash]
    ) -> None:
        """The engine reports blocks gone (kv_blocks_removed): a delivery of them there no longer
        stands."""
        self.book.blocks_removed(tier, instance_id, block_hashes)

    def blocks_cleared(self, tier: str, instance_id: str | None) -> None:
        """Every block at the place is gone (kv_blocks_cleared)."""
        self.book.blocks_cleared(tier, instance_id)

    @property
    def holds_landed(self) -> bool:
        """Whether a report of blocks gone can change anything (OrderBook.holds_landed)."""
        return self.book.holds_landed

    def _advice_of(self, session_id: str) -> SessionAdvice | None:
        latest = self._latest.get(session_id)
        return None if latest is None else latest[0]

    def _latest_advice(self) -> Iterable[SessionAdvice]:
        return (a for a, _ in self._latest.values())

    def _release(self, order_id: str, give_back: bool) -> None:
        # The book is built before the room it releases bookings in.
        self.room.release(order_id, give_back)

    # -- a planning replica's hand-over (decisions.md, 23) ------------------------------------

    def handover_state(self) -> dict[str, str]:
        """What a planning replica taking over from this one needs not to order anything twice:
        the order book's (OrderBook.handover_state). Field -> value, for a Redis hash."""
        return self.book.handover_state()

    def take_over(self, token: int, state: dict[str, str]) -> int:
        """Start planning term `token` from the hand-over state the last planning replica wrote:
        its open orders count as open here (so their blocks are not ordered again; a completion or
        the blocks landing closes them as any), its pins and demotes as done. Returns the orders
        adopted. What this replica planned in an earlier term of its own is dropped first."""
        self._generation = token * TERM_GENERATIONS
        self._carried = ([], [])
        self.room.clear()
        return self.book.take_over(state)

    # -- views ------------------------------------------------------------------------------

    def open_order(self, order_id: str) -> Order | None:
        """One open order by id (a dict read: safe from the loop while the store thread plans)."""
        return self.book.open_order(order_id)

    def open_orders(self) -> list[Order]:
        return self.book.open_orders()

    def latest_advice(self) -> list[tuple[SessionAdvice, float]]:
        """Each tracked session's latest advice and when it was made (the dashboard's "back
        next"), oldest update first."""
        return list(self._latest.values())

    def inflight_bytes(self, instance_id: str) -> int:
        return self.book.inflight_bytes(instance_id)

    @property
    def tracked_sessions(self) -> int:
        return len(self._latest)

    @property
    def candidates(self) -> int:
        """Sessions whose latest advice asks for a prefetch."""
        return len(self._candidates)

    # -- planning ---------------------------------------------------------------------------

    def plan(self, now: float) -> Plan:
        cancels, orders = self._carried
        self._carried = ([], [])
        moving: dict[str, Order] = {}  # this tick's prefetches by id, grown as sessions share them
        try:
            return self._plan(now, cancels, orders, moving)
        except Exception:
            # A store failure cut the tick short. What it decided stands (the scheduler counts
            # those orders open, those sessions pinned, those orders cancelled), so it goes out
            # with the next tick that completes; dropped here, it would never go out at all.
            self._carried = (cancels, orders + list(moving.values()))
            raise

    def _plan(
        self, now: float, cancels: list[Cancel], orders: list[Order], moving: dict[str, Order]
    ) -> Plan:
        """plan(), adding to `cancels`, `orders` (pins, demotes) and `moving` as it goes."""
        self._generation += 1
        book = self.book
        book.tick(now)
        cancels += book.retire_landed()
        self._expire(now)
        cancels += book.give_up_overdue(now)
        cancels += book.cancel_fallen()
        # Retention to decide: the sessions advised since, and those whose pin or demote failed
        # or was lost, once their backoff passed.
        for session_id in book.retention_due(now):
            a = self._advice_of(session_id)
            if a is not None:
                self._fresh.setdefault(session_id, a)
        waiting = self._waiting_calls() if self.config.pins_hold_room else {}
        for instance_id in waiting:
            # Pins held there are priced again as the queue grew: released if not worth it.
            cancels += self._release_pins(instance_id, waiting[instance_id], now)
        self._pins_and_demotes(list(self._fresh.values()), now, orders, waiting)
        self._fresh.clear()

        # Only the instances this plan may send to: a tick costs its candidates, not the fleet.
        dests = {c.instance_id for c in self._candidates.values() if c.instance_id is not None}
        room = self.room
        # A destination whose room or link ran out for one candidate has none for the less likely
        # ones after it (they may displace less): skipping them keeps a tick's cost to the
        # candidates that can still be served.
        exhausted = room.open_tick(dests, book.inflight_by_instance())
        inflight_blocks = book.inflight_blocks()
        ordered_now: dict[tuple[str, BlockHash], str] = {}
        for cand in sorted(self._candidates.values(), key=lambda a: (-a.p_soon, a.session_id)):
            dest: str = cand.instance_id  # type: ignore[assignment]
            if dest in exhausted or not room.reported(dest):
                continue  # out of room, or it never reported its room
            if book.backing_off("prefetch", cand.session_id, dest):
                continue  # its last order there failed: tried again once its backoff passed
            missing = self._missing(cand, dest, inflight_blocks.get(dest, ()))
            # Blocks an order of this tick moves there already: that order serves this one too.
            for order_id in dict.fromkeys(
                ordered_now[(dest, b)] for b in missing if (dest, b) in ordered_now
            ):
                moving[order_id] = self._serve_too(moving[order_id], cand)
            missing = [b for b in missing if (dest, b) not in ordered_now]
            for source, part in room.sources(dest, missing):
                order = room.fit(cand, dest, source, part, self._latest_advice, orders, now)
                if order is None:
                    exhausted.add(dest)  # no room made, or its link is booked up
                    break
                moving[order.order_id] = order
                for b in part:
                    ordered_now[(dest, b)] = order.order_id
        # A prefetch carried over from a tick cut short may be gone since (cancelled, or landed by
        # other means): it was never handed out, so neither it nor its cancel goes out now.
        gone = {o.order_id for o in orders if o.kind == "prefetch" and not book.is_open(o.order_id)}
        if gone:
            orders[:] = [o for o in orders if o.order_id not in gone]
            cancels[:] = [c for c in cancels if c.order_id not in gone]
        orders += moving.values()
        book.issued(orders)
        return Plan(orders=orders, cancels=cancels)

    # -- parts of a tick ---------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        cutoff = now - self.advice_ttl_seconds
        stale = []
        for session_id, (_, ts) in self._latest.items():
            if ts >= cutoff:
                break  # oldest first: the rest are fresher
            stale.append(session_id)
        for session_id in stale:
            self.forget(session_id, release_pin=False)  # its pin's TTL stands

    def _waiting_calls(self) -> dict[str, tuple[int, int]]:
        """Per instance with calls queued: (how many, its KV bytes), from its instance_status."""
        return {
            v.instance_id: (v.queue_depth, v.total_kv_bytes)
            for v in self.store.instances()
            if v.queue_depth and v.total_kv_bytes
        }

    def _worth_holding(
        self, a: SessionAdvice, nblocks: int, waiting: tuple[int, int] | None, now: float
    ) -> bool:
        """Whether a pin of `nblocks` of `a`'s context is worth the room it holds: the stall it
        saves when the session is back (its chance times the reload it avoids) against the time
        it keeps the calls waiting on its instance from that room (each of them, for the pin's
        share of the instance's KV bytes, over its TTL). Nothing waiting: worth it. With its tool
        call in flight the stall saved is that of the returns before a reload would land: holding
        against reloading, priced (issue 28)."""
        if waiting is None:
            return True
        queued, total_bytes = waiting
        nbytes = nblocks * self.config.bytes_per_block
        reload_seconds = self.room.stall_avoided("pool", nblocks, nbytes)
        saved = a.p_keep * reload_seconds * self._back_before(a.session_id, reload_seconds, now)
        held = queued * (nbytes / total_bytes) * a.keep_seconds
        return saved >= held

    def _back_before(self, session_id: str, reload_seconds: float, now: float) -> float:
        """The share of the session's returns that come before a reload started now would land:
        1 unless its tool call is in flight, when a return after the reload stalls on nothing
        (the context is demoted and prefetched back before the predicted return)."""
        if self.tools is None:
            return 1.0
        outlook = self.tools.outlooks((reload_seconds,), now, (session_id,)).get(session_id)
        return 1.0 if outlook is None else outlook[0]

    def _release_pins(self, instance_id: str, waiting: tuple[int, int], now: float) -> list[Cancel]:
        """The pins held on a crowded instance that are not worth their room any more."""
        out = []
        for session_id in self.book.pins_at(instance_id, now):
            a = self._advice_of(session_id)
            if a is None or not self._worth_holding(a, len(set(a.block_hashes)), waiting, now):
                out += self.book.release_pin(session_id)
        return out

    def _pins_and_demotes(
        self,
        advice: Sequence[SessionAdvice],
        now: float,
        out: list[Order],
        waiting: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        """Adds to `out` as it goes, so a store failure half way keeps what was decided."""
        for a in advice:
            if a.instance_id is None or not a.block_hashes:
                continue
            spell = spell_of(a)
            book = self.book
            if a.retention == "keep":
                if book.wants_pin(a.session_id, spell, now):
                    resident = self.room.resident(a)
                    crowd = waiting.get(a.instance_id) if waiting else None
                    if resident and self._worth_holding(a, len(resident), crowd, now):
                        pin = self._order("pin", a, resident, now, ttl_seconds=a.keep_seconds)
                        out.append(pin)
                        book.pin_ordered(pin, a.session_id, spell, now + a.keep_seconds)
            elif a.retention == "demote" and book.wants_demote(a.session_id, spell):
                resident = self.room.resident(a, a.demotable_blocks)
                if resident:
                    demote = self._order("demote", a, resident, now)
                    out.append(demote)
                    book.demote_ordered(demote, a.session_id, spell)

    def _missing(
        self, cand: SessionAdvice, dest: str, inflight: Collection[BlockHash]
    ) -> list[BlockHash]:
        """The candidate's blocks neither at `dest`, nor on their way there, nor delivered there
        by a prefetch that still stands (the engine may not report what a tier loaded)."""
        blocks = list(dict.fromkeys(cand.block_hashes))
        here = self.store.holds("hbm", dest, blocks)
        delivered = self.book.delivered(dest)
        return [
            b for b, h in zip(blocks, here) if not h and b not in inflight and b not in delivered
        ]

    def _serve_too(self, order: Order, cand: SessionAdvice) -> Order:
        """`cand` needs blocks `order` already moves this tick: the order serves it too, and is
        worth its chance of the same stall more."""
        stall = self.room.stall_avoided(
            order.source_tier or "pool", len(order.block_hashes), order.size_bytes
        )
        grown = order.model_copy(
            update={
                "session_ids": [*order.session_ids, cand.session_id],
                "priority": order.priority + cand.p_soon * stall,
            }
        )
        self.book.serves_too(grown, cand.session_id, spell_of(cand))
        return grown

    def _order(
        self,
        kind: OrderKind,
        a: SessionAdvice,
        blocks: list[BlockHash],
        now: float,
        *,
        source: Tier | None = None,
        nbytes: int | None = None,
        start_by: float | None = None,
        needed_by: float | None = None,
        priority: float = 0.0,
        ttl_seconds: float | None = None,
    ) -> Order:
        dest: str = a.instance_id  # type: ignore[assignment]
        return Order(
            order_id=order_id_for(kind, dest, "hbm", blocks, self._generation),
            kind=kind,
            instance_id=dest,
            tier="hbm",
            source_tier=source,
            block_hashes=blocks,
            size_bytes=nbytes if nbytes is not None else len(blocks) * self.config.bytes_per_block,
            created_ts=now,
            start_by_ts=now if start_by is None else start_by,
            needed_by_ts=now if needed_by is None else needed_by,
            ttl_seconds=ttl_seconds,
            priority=priority,
            session_ids=[a.session_id],
        )
