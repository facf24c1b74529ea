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
- **Dedup.** A block at the destination, or in an open order to it, is never ordered again; a
  block several candidates share goes in the first (most valuable) order, which then serves
  every one of them: its value is their sum.
- **Links.** Each destination's link from each source tier gives prefetch `link_share` of its
  bandwidth; a link's orders are booked into disjoint intervals at that rate (each as late as
  its needed_by allows), so their sum never exceeds it. An order that cannot land by its
  needed_by is not issued.
- **Room, priced.** A destination takes a prefetch into its free KV bytes (its last
  instance_status) less what is already on its way: nearly free, so the candidate's chance need
  only clear `prefetch_min_p`. When that is short the prefetch is a swap, made only against
  contexts of sessions predicted less likely back than the candidate (lower p_keep than its
  chance; the stall each saves grows with its bytes, so per byte the chances compare): they are
  demoted to make room, and the demote orders say so. Content no advice covers is never pushed
  out for a prefetch. A destination that never reported its room gets no prefetch.
- **Pins and demotes** follow the planner's keep and demote advice, once per idle spell, and a
  pin again only when the last one is about to lapse.
- **Cancellation.** Each tick, an open prefetch not yet started whose sessions are no longer
  candidates (closed, back already, routed elsewhere, or their chance fell below
  `cancel_below_p`) is cancelled; one already accepted by an agent runs on, and if it has no
  session left its bytes count as wasted.

Progress comes back as order_progress events (`on_progress`); an open order an agent accepted
whose blocks all show at the destination is done too (the agent also reports the blocks as
stored); one nobody accepted whose blocks got there by other means (a request loaded them) is
withdrawn. A landed prefetch is used by as much of it as is still there when a session it
served comes back to its instance; the rest was evicted first, moved for nothing. One with no
word of its end `overdue_seconds` past its needed_by (its agent died while moving it, or nobody
took it) is given up: counted failed, or cancelled if it never started, so its blocks can be
ordered again and its bytes stop holding the destination's room.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import orjson

from app.core.cluster import (
    BLOCK_TOKENS,
    HOST_LINK_BYTES_PER_SECOND,
    LINK_SHARE,
    POOL_LINK_BYTES_PER_SECOND,
    PREFILL_TOKENS_PER_SECOND,
    ClusterSpec,
)
from app.decide.advisor import SessionAdvice, Thresholds
from app.state.base import StateStore
from kvprefetch_client.events import BlockHash, Tier
from kvprefetch_client.orders import Cancel, Order, OrderKind, from_json, order_id_for

log = logging.getLogger(__name__)

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

    @classmethod
    def from_cluster(
        cls, cluster: ClusterSpec, thresholds: Thresholds | None = None, **kw: float
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


# One idle spell of one session's context on one instance: (instance, session, blocks, last block).
# A new turn grows the context, so its retention is a new question.
_Spell = tuple[str, str, int, BlockHash]


def _spell(a: SessionAdvice) -> _Spell:
    return (a.instance_id or "", a.session_id, len(a.block_hashes), a.block_hashes[-1])


@dataclass(frozen=True, slots=True)
class Plan:
    orders: list[Order]
    cancels: list[Cancel]


@dataclass(slots=True)
class _Open:
    order: Order
    started: bool = False
    sessions: set[str] = field(default_factory=set)
    used: bool = False  # a session it served was routed to its destination
    wasted: bool = False
    served: set[str] = field(default_factory=set)  # every session it was ordered for


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
class _Landed:
    instance_id: str
    size_bytes: int
    sessions: set[str]
    block_hashes: list[BlockHash]


class Scheduler:
    """Advice in (`advise`, as sessions are scored: one at a finish, or a page per tick), sessions
    out (`forget`, when one is active again or closed), orders out (`plan`, each tick). The latest
    advice per session is kept, so a tick costs the candidates and the open orders, not every
    session tracked; advice not refreshed within `advice_ttl_seconds` is dropped."""

    def __init__(
        self, store: StateStore, config: SchedulerConfig, *, advice_ttl_seconds: float = 120.0
    ) -> None:
        self.store = store
        self.config = config
        self._cluster = config.cluster  # built once: the config is frozen
        self.advice_ttl_seconds = advice_ttl_seconds
        self.totals = SchedulerTotals()
        self._open: dict[str, _Open] = {}
        # (instance, source tier) -> the intervals its prefetch share is booked for.
        self._link_booked: dict[tuple[str, Tier], list[tuple[float, float]]] = {}
        self._booking: dict[
            str, tuple[tuple[str, Tier], tuple[float, float]]
        ] = {}  # order -> its slot
        self._latest: dict[str, tuple[SessionAdvice, float]] = {}  # oldest update first
        self._candidates: dict[str, SessionAdvice] = {}
        self._fresh: dict[
            str, SessionAdvice
        ] = {}  # advised since the last plan: retention to decide
        self._pinned: dict[str, tuple[_Spell, float]] = {}  # session -> its pinned spell, until
        self._demoted: dict[str, _Spell] = {}
        self._landed: dict[str, _Landed] = {}  # landed prefetches waiting for a session's return
        # session -> ids of the open orders that served it (may name orders since closed): an
        # arrival, on the ingest path, finds its orders without scanning every open one.
        self._served_by: dict[str, set[str]] = {}
        self._landed_by_session: dict[str, set[str]] = {}
        self._generation = 0
        # What a tick cut short by a store failure decided: handed out by the next plan().
        self._carried: tuple[list[Cancel], list[Order]] = ([], [])
        # order id -> (the order, its hand-over value), so an unchanged order is not re-encoded.
        self._encoded: dict[str, tuple[Order, bool, str]] = {}

    # -- input ------------------------------------------------------------------------------

    def advise(self, advice: Sequence[SessionAdvice], now: float) -> None:
        for a in advice:
            self._latest.pop(a.session_id, None)
            self._latest[a.session_id] = (a, now)
            self._fresh[a.session_id] = a
            if a.prefetch and a.instance_id is not None and a.p_soon >= self.config.prefetch_min_p:
                self._candidates[a.session_id] = a
            else:
                self._candidates.pop(a.session_id, None)

    def forget(self, session_id: str, *, routed_to: str | None = None) -> None:
        """The session is active again (routed to `routed_to`) or closed: its advice is void. An
        order moving its context to where it was routed is used by that request, not wasted."""
        self._latest.pop(session_id, None)
        self._candidates.pop(session_id, None)
        self._fresh.pop(session_id, None)
        self._pinned.pop(session_id, None)
        self._demoted.pop(session_id, None)
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
            self._booking.pop(order_id, None)
            if status == "completed":
                self._has_landed(order_id, entry)
            else:
                self.totals.failed += 1

    # -- a planning replica's hand-over (decisions.md, 23) ------------------------------------

    def handover_state(self) -> dict[str, str]:
        """What a planner taking over from this one needs so as not to order anything twice:
        the open orders (`o:<id>`), the pinned (`p:<session>`) and demoted (`d:<session>`)
        spells. Field -> value, for a Redis hash."""
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
        for session_id, (spell, until) in list(self._pinned.items()):
            out[f"p:{session_id}"] = orjson.dumps([spell, until]).decode()
        for session_id, spell in list(self._demoted.items()):
            out[f"d:{session_id}"] = orjson.dumps(spell).decode()
        return out

    def take_over(self, token: int, state: dict[str, str]) -> int:
        """Start planning term `token` from the hand-over state the last planner wrote: its open
        orders count as open here (so their blocks are not ordered again; a completion or the
        blocks landing closes them as any), its pins and demotes as done. Returns the orders
        adopted. What this replica planned in an earlier term of its own is dropped first."""
        self._generation = token * TERM_GENERATIONS
        self._carried = ([], [])
        self._open.clear()
        self._booking.clear()
        self._link_booked.clear()
        self._served_by.clear()
        self._pinned.clear()
        self._demoted.clear()
        self._encoded.clear()
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
                    self._pinned[key] = (tuple(spell), float(until))
                elif kind == "d":
                    self._demoted[key] = tuple(orjson.loads(value))
            except (ValueError, TypeError) as exc:  # one bad entry must not stop the take-over
                log.warning("hand-over entry %r unreadable: %s", field_, exc)
        return len(self._open)

    # -- views ------------------------------------------------------------------------------

    def open_order(self, order_id: str) -> Order | None:
        """One open order by id (a dict read: safe from the loop while the store thread plans)."""
        e = self._open.get(order_id)
        return None if e is None else e.order

    def open_orders(self) -> list[Order]:
        # Copied at once (one C call): with the Redis store the planning side changes _open on
        # the store thread while a route on the loop reads (app/state/storethread.py).
        return [e.order for e in list(self._open.values())]

    def latest_advice(self) -> list[tuple[SessionAdvice, float]]:
        """Each tracked session's latest advice and when it was made (the dashboard's "back
        next"), oldest update first."""
        return list(self._latest.values())

    def inflight_bytes(self, instance_id: str) -> int:
        return sum(
            e.order.size_bytes
            for e in self._open.values()
            if e.order.kind == "prefetch" and e.order.instance_id == instance_id
        )

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
        cfg = self.config
        self._generation += 1
        cancels += self._retire_landed()
        self._expire(now)
        cancels += self._give_up_overdue(now)
        cancels += self._cancel_fallen()
        self._pins_and_demotes(list(self._fresh.values()), now, orders)
        self._fresh.clear()

        # Only the instances this plan may send to: a tick costs its candidates, not the fleet.
        dests = {c.instance_id for c in self._candidates.values() if c.instance_id is not None}
        free = (
            {i.instance_id: i.free_kv_bytes for i in self.store.instances(ids=list(dests))}
            if dests
            else {}
        )
        for inst, nbytes in self._inflight_by_instance().items():
            if free.get(inst) is not None:
                free[inst] = max(free[inst] - nbytes, 0)  # type: ignore[operator]
        inflight_blocks = self._inflight_blocks()
        ordered_now: dict[tuple[str, BlockHash], str] = {}
        claimed: set[_Spell] = set()
        displaceable: dict[
            str, list[SessionAdvice]
        ] = {}  # per destination, built when first needed
        # A destination whose room or link ran out for one candidate has none for the less likely
        # ones after it (they may displace less): skipping them keeps a tick's cost to the
        # candidates that can still be served.
        exhausted: set[str] = {d for d, room in free.items() if room is None}
        for cand in sorted(self._candidates.values(), key=lambda a: (-a.p_soon, a.session_id)):
            dest: str = cand.instance_id  # type: ignore[assignment]
            if dest in exhausted or dest not in free:
                continue  # out of room, or it never reported its room
            blocks = list(dict.fromkeys(cand.block_hashes))
            here = self.store.holds("hbm", dest, blocks)
            missing = [
                b for b, h in zip(blocks, here) if not h and b not in inflight_blocks.get(dest, ())
            ]
            for order_id in dict.fromkeys(
                ordered_now[(dest, b)] for b in missing if (dest, b) in ordered_now
            ):
                moving[order_id] = self._serve_too(moving[order_id], cand)
            missing = [b for b in missing if (dest, b) not in ordered_now]
            for source, part in self._sources(dest, missing):
                nbytes = len(part) * cfg.bytes_per_block
                room: int = free[dest]  # type: ignore[assignment]
                if room < nbytes:
                    if dest not in displaceable:
                        displaceable[dest] = sorted(
                            (
                                a
                                for a, _ in self._latest.values()
                                if a.instance_id == dest and a.retention != "keep"
                            ),
                            key=lambda a: (a.p_keep, a.session_id),
                        )
                    room += self._make_room(
                        dest, nbytes - room, cand, displaceable[dest], orders, now, claimed
                    )
                    if room < nbytes:
                        exhausted.add(dest)
                        break
                order = self._book(cand, dest, source, part, nbytes, now)
                if order is None:
                    exhausted.add(dest)
                    break
                free[dest] = room - nbytes
                moving[order.order_id] = order
                for b in part:
                    ordered_now[(dest, b)] = order.order_id
        # A prefetch carried over from a tick cut short may be gone since (cancelled, or landed by
        # other means): it was never handed out, so neither it nor its cancel goes out now.
        gone = {o.order_id for o in orders if o.kind == "prefetch" and o.order_id not in self._open}
        if gone:
            orders[:] = [o for o in orders if o.order_id not in gone]
            cancels[:] = [c for c in cancels if c.order_id not in gone]
        orders += moving.values()
        for o in orders:
            self.totals.orders[o.kind] += 1
            if o.kind == "prefetch":
                self.totals.bytes_ordered += o.size_bytes
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
            self.forget(session_id)

    def _retire_landed(self) -> list[Cancel]:
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
                    self._booking.pop(order_id, None)
                    self._has_landed(order_id, e)
                else:
                    self._release(order_id)
                    self.totals.cancelled += 1
                    cancels.append(Cancel(order_id=order_id, reason="its blocks are there already"))
        return cancels

    def _has_landed(self, order_id: str, e: _Open) -> None:
        """A prefetch completed: used already if a session it served came back there while it
        moved; otherwise it waits for one of the sessions still advised on."""
        self.totals.completed += 1
        if e.order.kind != "prefetch":
            return
        if e.used:
            self.totals.bytes_used += e.order.size_bytes
            return
        waiting = {s for s in e.served if s in self._latest}
        if not waiting:
            self.totals.bytes_unused += e.order.size_bytes
            return
        self._landed[order_id] = _Landed(
            e.order.instance_id, e.order.size_bytes, waiting, e.order.block_hashes
        )
        for s in waiting:
            self._landed_by_session.setdefault(s, set()).add(order_id)

    def _give_up_overdue(self, now: float) -> list[Cancel]:
        cutoff = now - self.config.overdue_seconds
        cancels = []
        for order_id, e in list(self._open.items()):
            if e.order.needed_by_ts > cutoff:
                continue
            del self._open[order_id]
            self._release(order_id)
            if e.started:
                self.totals.failed += 1
            else:
                self.totals.cancelled += 1
                cancels.append(Cancel(order_id=order_id, reason="not done in time"))
        return cancels

    def _cancel_fallen(self) -> list[Cancel]:
        cancels = []
        for order_id, e in list(self._open.items()):
            if e.order.kind != "prefetch":
                continue
            still = set()
            for s in e.sessions:
                latest = self._latest.get(s)
                if (
                    latest is not None
                    and latest[0].instance_id == e.order.instance_id
                    and latest[0].p_soon >= self.config.cancel_below_p
                ):
                    still.add(s)
            e.sessions = still
            if still:
                continue
            if e.started:
                if not e.used and not e.wasted:
                    e.wasted = True
                    self.totals.bytes_wasted += (
                        e.order.size_bytes
                    )  # moving already: it lands unused
                continue
            del self._open[order_id]
            self._release(order_id)
            self.totals.cancelled += 1
            cancels.append(
                Cancel(order_id=order_id, reason="no session is likely back there in time")
            )
        return cancels

    def _pins_and_demotes(
        self, advice: Sequence[SessionAdvice], now: float, out: list[Order]
    ) -> None:
        """Adds to `out` as it goes, so a store failure half way keeps what was decided."""
        for a in advice:
            if a.instance_id is None or not a.block_hashes:
                continue
            spell = _spell(a)
            pinned = self._pinned.get(a.session_id)
            if a.retention == "keep":
                if (
                    pinned is None
                    or pinned[0] != spell
                    or pinned[1] - self.config.repin_before_seconds <= now
                ):
                    resident = self._resident(a)
                    if resident:
                        out.append(self._order("pin", a, resident, now, ttl_seconds=a.keep_seconds))
                        self._pinned[a.session_id] = (spell, now + a.keep_seconds)
                        self._demoted.pop(a.session_id, None)
            elif a.retention == "demote" and self._demoted.get(a.session_id) != spell:
                resident = self._resident(a, a.demotable_blocks)
                if resident:
                    out.append(self._order("demote", a, resident, now))
                    self._demoted[a.session_id] = spell
                    self._pinned.pop(a.session_id, None)

    def _make_room(
        self,
        dest: str,
        need_bytes: int,
        cand: SessionAdvice,
        displaceable: list[SessionAdvice],
        orders: list[Order],
        now: float,
        claimed: set[_Spell],
    ) -> int:
        """Demote contexts at `dest` less likely back than `cand`; returns the bytes freed. A
        context counted as room once this tick (`claimed`) is not counted again."""
        freed = 0
        for a in displaceable:
            if freed >= need_bytes or a.p_keep >= cand.p_soon:
                break
            if a.instance_id != dest or a.session_id == cand.session_id:
                continue
            resident = self._resident(a, a.demotable_blocks)
            if not resident:
                continue
            key = _spell(a)
            if key in claimed:
                continue
            claimed.add(key)
            if (
                self._demoted.get(a.session_id) != key
            ):  # one demoted already goes first: no new order
                orders.append(self._order("demote", a, resident, now))
                self._demoted[a.session_id] = key
                self._pinned.pop(a.session_id, None)
            freed += len(resident) * self.config.bytes_per_block
        return freed

    def _book(
        self,
        cand: SessionAdvice,
        dest: str,
        source: Tier,
        blocks: list[BlockHash],
        nbytes: int,
        now: float,
    ) -> Order | None:
        cfg = self.config
        rate = self._cluster.link_bytes_per_second(source) * cfg.link_share
        transfer_seconds = nbytes / rate
        needed_in = (
            cand.needed_in_seconds
            if cand.needed_in_seconds is not None
            else cfg.lead_seconds * cfg.needed_within_fraction
        )
        needed_by = now + needed_in
        link = (dest, source)
        start_by = self._book_link(link, transfer_seconds, needed_by - cfg.margin_seconds, now)
        if start_by is None and needed_by - cfg.margin_seconds < now + transfer_seconds:
            # Too close to land in time (a signal with a short lead): at once if the link is
            # free now, landing as soon as it can; late, it still saves what has landed.
            start_by = self._book_link(link, transfer_seconds, now + transfer_seconds, now)
            needed_by = now + transfer_seconds + cfg.margin_seconds
        if start_by is None:
            return None  # the link's share is booked: it would land too late to matter
        # Held as long as it would be kept, and at least through the lead it was fetched for.
        hold_seconds = max(cand.keep_seconds, cfg.lead_seconds)
        order = self._order(
            "prefetch",
            cand,
            blocks,
            now,
            source=source,
            nbytes=nbytes,
            start_by=start_by,
            needed_by=needed_by,
            ttl_seconds=hold_seconds,
            priority=cand.p_soon * self._stall_avoided(source, len(blocks), nbytes),
        )
        self._open[order.order_id] = _Open(
            order, sessions={cand.session_id}, served={cand.session_id}
        )
        self._served_by.setdefault(cand.session_id, set()).add(order.order_id)
        self._booking[order.order_id] = (link, (start_by, start_by + transfer_seconds))
        return order

    def _book_link(
        self, link: tuple[str, Tier], seconds: float, land_by: float, now: float
    ) -> float | None:
        """The latest start in [now, land_by - seconds] when the link's share is free for `seconds`,
        booked; None when there is none. Latest, so what is booked later with an earlier deadline
        still finds room before it."""
        booked = [(s, e) for s, e in self._link_booked.get(link, ()) if e > now]
        for start in sorted({land_by - seconds, *(s - seconds for s, _ in booked)}, reverse=True):
            if start < now - 1e-9:
                break
            if start + seconds <= land_by + 1e-9 and all(
                start >= e - 1e-9 or start + seconds <= s + 1e-9 for s, e in booked
            ):
                booked.append((start, start + seconds))
                self._link_booked[link] = booked
                return start
        return None

    def _release(self, order_id: str) -> None:
        """A cancelled order gives its link time back."""
        booking = self._booking.pop(order_id, None)
        if booking is not None:
            link, slot = booking
            slots = self._link_booked.get(link, [])
            if slot in slots:
                slots.remove(slot)

    def _serve_too(self, order: Order, cand: SessionAdvice) -> Order:
        """`cand` needs blocks `order` already moves this tick: the order serves it too, and is
        worth its chance of the same stall more."""
        stall = self._stall_avoided(
            order.source_tier or "pool", len(order.block_hashes), order.size_bytes
        )
        grown = order.model_copy(
            update={
                "session_ids": [*order.session_ids, cand.session_id],
                "priority": order.priority + cand.p_soon * stall,
            }
        )
        e = self._open[order.order_id]
        e.order = grown
        e.sessions.add(cand.session_id)
        e.served.add(cand.session_id)
        self._served_by.setdefault(cand.session_id, set()).add(order.order_id)
        return grown

    def _stall_avoided(self, source: Tier, blocks: int, nbytes: int) -> float:
        """What a miss of these blocks would cost: their load at full link speed, or their
        recompute if that is sooner (what the engine would do)."""
        cluster = self._cluster
        return min(
            cluster.load_seconds(nbytes, source),
            cluster.recompute_seconds(blocks * cluster.block_tokens),
        )

    def _sources(
        self, dest: str, blocks: list[BlockHash]
    ) -> Iterable[tuple[Tier, list[BlockHash]]]:
        on_host = self.store.holds("host", dest, blocks)
        host = [b for b, h in zip(blocks, on_host) if h]
        rest = [b for b, h in zip(blocks, on_host) if not h]
        in_pool = self.store.holds("pool", None, rest) if rest else []
        pool = [b for b, h in zip(rest, in_pool) if h]
        # Blocks in neither are recomputed by the engine when asked for: nothing to move.
        if host:
            yield "host", host
        if pool:
            yield "pool", pool

    def _resident(
        self, a: SessionAdvice, blocks_of: Sequence[BlockHash] | None = None
    ) -> list[BlockHash]:
        blocks = list(dict.fromkeys(a.block_hashes if blocks_of is None else blocks_of))
        return [b for b, h in zip(blocks, self.store.holds("hbm", a.instance_id, blocks)) if h]

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

    def _inflight_by_instance(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self._open.values():
            if e.order.kind == "prefetch":
                out[e.order.instance_id] = out.get(e.order.instance_id, 0) + e.order.size_bytes
        return out

    def _inflight_blocks(self) -> dict[str, set[BlockHash]]:
        out: dict[str, set[BlockHash]] = {}
        for e in self._open.values():
            if e.order.kind == "prefetch":
                out.setdefault(e.order.instance_id, set()).update(e.order.block_hashes)
        return out
