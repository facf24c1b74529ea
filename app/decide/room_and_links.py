"""Room and links: where a prefetch fits, which link it books, where it reads from and what it
saves. The scheduler (app/decide/scheduler.py) picks the candidates and hands each one's missing
blocks here, tick by tick (`RoomAndLinks`):

- **Making room** (`open_tick`, `fit`, `make_room`): a destination takes a prefetch into its free
  KV bytes (its last instance_status) less what is already on its way there. When that is short
  the prefetch is a swap, made only against contexts less likely back than the candidate (lower
  p_keep than its chance; the stall each saves grows with its bytes, so per byte the chances
  compare), least likely kept first, each counted as room once a tick, none whose last demote
  failed and is backing off: they are demoted, and the demote orders say so. Past those, a
  candidate more likely back than `keep_min_p` may take what the destination's own eviction
  takes next, up to its KV bytes a tick. A destination that never reported its room gets no
  prefetch.
- **Booking links** (`book_prefetch`, `book_link`, `release`): each destination's link from each
  source tier gives prefetch `link_share` of its bandwidth; a link's orders are booked into
  disjoint intervals at that rate, each as late as its needed_by allows, so their sum never
  exceeds it. An order that cannot land by its needed_by is not issued. An order that leaves the
  open ones drops its booking; a withdrawn one gives its interval back (the order book calls
  `release`).
- **Sources** (`sources`, by `split_by_source`): host DRAM first, then the pool; blocks in
  neither are recomputed by the engine when asked for: nothing to move.
- **Stall avoided** (`stall_avoided`, by `stall_seconds`): what a miss of the blocks would cost,
  their load at full link speed or their recompute if that is sooner (`load_or_recompute`).

`split_by_source`, `load_or_recompute` and `stall_seconds` are plain rules, with no store and no
state: the replay's cluster model (sim/cluster.py) splits its loads and prefetches and chooses
between loading and recomputing by them too, so the scheduler plans by the rules the simulated
tier follows.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar

from app.core.cluster import SourceTier
from app.decide.advisor import SessionAdvice
from app.decide.order_book import OrderBook, Spell, spell_of
from app.state.base import StateStore
from kvprefetch_client.events import BlockHash, Tier
from kvprefetch_client.orders import Order, OrderKind

if TYPE_CHECKING:
    from app.decide.scheduler import SchedulerConfig

B = TypeVar("B")
# Which of a batch of blocks a place holds, one answer per block (a store's `holds`).
Holds = Callable[[Sequence[B]], Sequence[bool]]
Link = tuple[str, Tier]  # (destination instance, source tier)


# -- the tier's rules, shared with the replay's cluster model ----------------------------------


def split_by_source(
    blocks: Sequence[B], on_host: Holds[B], in_pool: Holds[B]
) -> list[tuple[SourceTier, list[B]]]:
    """`blocks` grouped by where they load from, in their order: the host tier's first (the
    destination's own DRAM, the faster link), then the pool's; blocks in neither are left out
    (the engine recomputes them), and so are empty groups. `in_pool` is asked only about the
    blocks the host lacks, and not at all when it has them all."""
    held = on_host(blocks)
    host = [b for b, h in zip(blocks, held, strict=True) if h]
    rest = [b for b, h in zip(blocks, held, strict=True) if not h]
    pool = [b for b, h in zip(rest, in_pool(rest), strict=True) if h] if rest else []
    split: list[tuple[SourceTier, list[B]]] = []
    if host:
        split.append(("host", host))
    if pool:
        split.append(("pool", pool))
    return split


def load_or_recompute(
    load_seconds: float, recompute_seconds: float
) -> Literal["load", "recompute"]:
    """What an engine does with reused blocks it lacks: loads them, unless recomputing them is
    sooner (a tie loads)."""
    return "recompute" if recompute_seconds < load_seconds else "load"


def stall_seconds(load_seconds: float, recompute_seconds: float) -> float:
    """The stall of a miss: the time of whichever `load_or_recompute` chooses."""
    if load_or_recompute(load_seconds, recompute_seconds) == "recompute":
        return recompute_seconds
    return load_seconds


# -- the scheduler's room and links ------------------------------------------------------------


class MakeOrder(Protocol):
    """The scheduler's order maker (its ids carry the planning term's generation)."""

    def __call__(
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
    ) -> Order: ...


class RoomAndLinks:
    """The destinations' room and the links' bookings, for the scheduler that owns `book`."""

    def __init__(
        self, store: StateStore, config: SchedulerConfig, book: OrderBook, order: MakeOrder
    ) -> None:
        self.store = store
        self.config = config
        self._cluster = config.cluster  # built once: the config is frozen
        self.book = book
        self._order = order
        # link -> the intervals its prefetch share is booked for.
        self._link_booked: dict[Link, list[tuple[float, float]]] = {}
        # order -> its slot
        self._booking: dict[str, tuple[Link, tuple[float, float]]] = {}
        # This tick's room: free bytes per destination that reported it (None: reported none),
        # what its own eviction may still take, the contexts it may displace (built when
        # needed) and the contexts counted as room already.
        self._free: dict[str, int | None] = {}
        self._lru_room: dict[str, int] = {}
        self._displaceable: dict[str, list[SessionAdvice]] = {}
        self._claimed: set[Spell] = set()

    def clear(self) -> None:
        """A new planning term: no booking of an earlier one stands."""
        self._booking.clear()
        self._link_booked.clear()

    # -- making room --------------------------------------------------------------------------

    def open_tick(self, dests: Collection[str], inflight_by_instance: dict[str, int]) -> set[str]:
        """Reads the room of the destinations this tick may send to; returns those that reported
        none (no prefetch goes there)."""
        views = self.store.instances(ids=list(dests)) if dests else []
        self._free = {i.instance_id: i.free_kv_bytes for i in views}
        # What the destination's own eviction may take for prefetches this tick: its KV bytes.
        self._lru_room = {i.instance_id: i.total_kv_bytes or 0 for i in views}
        free = self._free
        for inst, nbytes in inflight_by_instance.items():
            room = free.get(inst)
            if room is not None:
                free[inst] = max(room - nbytes, 0)
        self._displaceable = {}
        self._claimed = set()
        return {d for d, room in free.items() if room is None}

    def reported(self, dest: str) -> bool:
        """Whether `dest` reported its room (as of this tick's `open_tick`)."""
        return dest in self._free

    def fit(
        self,
        cand: SessionAdvice,
        dest: str,
        source: Tier,
        blocks: list[BlockHash],
        latest: Callable[[], Iterable[SessionAdvice]],
        orders: list[Order],
        now: float,
    ) -> Order | None:
        """A prefetch of `blocks` from `source` to `dest` for `cand`, room made for it (demotes
        added to `orders`) and its link booked; None when there is no room or no link time.
        `latest`: every session's latest advice, read once a tick per destination short of
        room."""
        cfg = self.config
        nbytes = len(blocks) * cfg.bytes_per_block
        room: int = self._free[dest]  # type: ignore[assignment]
        if room < nbytes:
            if dest not in self._displaceable:
                self._displaceable[dest] = self.displaceable(dest, latest())
            freed = self.make_room(
                dest, nbytes - room, cand, self._displaceable[dest], orders, now, self._claimed
            )
            room += freed
            lru_room = self._lru_room
            lru_room[dest] = max(lru_room[dest] - freed, 0)
            if room < nbytes and cand.p_soon > cfg.keep_min_p:
                taken = min(nbytes - room, lru_room[dest])
                lru_room[dest] -= taken
                room += taken
        order = None if room < nbytes else self.book_prefetch(cand, dest, source, blocks, now)
        if order is not None:
            self._free[dest] = room - nbytes
        return order

    def displaceable(self, dest: str, latest: Iterable[SessionAdvice]) -> list[SessionAdvice]:
        """The contexts at `dest` a prefetch may displace, least likely kept first."""
        return sorted(
            (a for a in latest if a.instance_id == dest and a.retention != "keep"),
            key=lambda a: (a.p_keep, a.session_id),
        )

    def make_room(
        self,
        dest: str,
        need_bytes: int,
        cand: SessionAdvice,
        displaceable: list[SessionAdvice],
        orders: list[Order],
        now: float,
        claimed: set[Spell],
    ) -> int:
        """Demote contexts at `dest` less likely back than `cand`; returns the bytes freed. A
        context counted as room once this tick (`claimed`) is not counted again."""
        freed = 0
        book = self.book
        for a in displaceable:
            if freed >= need_bytes or a.p_keep >= cand.p_soon:
                break
            if a.instance_id != dest or a.session_id == cand.session_id:
                continue
            resident = self.resident(a, a.demotable_blocks)
            if not resident:
                continue
            key = spell_of(a)
            if key in claimed:
                continue
            if book.backing_off("demote", a.session_id, dest):
                continue  # its last demote failed: no room from it until it is tried again
            claimed.add(key)
            if book.wants_demote(a.session_id, key):
                # One demoted already goes first: no new order.
                demote = self._order("demote", a, resident, now)
                orders.append(demote)
                book.demote_ordered(demote, a.session_id, key)
            freed += len(resident) * self.config.bytes_per_block
        return freed

    def resident(
        self, a: SessionAdvice, blocks_of: Sequence[BlockHash] | None = None
    ) -> list[BlockHash]:
        """The advice's blocks (or `blocks_of`) in HBM at its instance, once each."""
        blocks = list(dict.fromkeys(a.block_hashes if blocks_of is None else blocks_of))
        return [b for b, h in zip(blocks, self.store.holds("hbm", a.instance_id, blocks)) if h]

    # -- booking links ------------------------------------------------------------------------

    def book_prefetch(
        self, cand: SessionAdvice, dest: str, source: Tier, blocks: list[BlockHash], now: float
    ) -> Order | None:
        """The prefetch, opened in the book, its link time booked; None when the link's share
        cannot land it in time."""
        cfg = self.config
        nbytes = len(blocks) * cfg.bytes_per_block
        rate = self._cluster.link_bytes_per_second(source) * cfg.link_share
        transfer_seconds = nbytes / rate
        needed_in = (
            cand.needed_in_seconds
            if cand.needed_in_seconds is not None
            else cfg.lead_seconds * cfg.needed_within_fraction
        )
        needed_by = now + needed_in
        link = (dest, source)
        start_by = self.book_link(link, transfer_seconds, needed_by - cfg.margin_seconds, now)
        if start_by is None and needed_by - cfg.margin_seconds < now + transfer_seconds:
            # Too close to land in time (a signal with a short lead): at once if the link is
            # free now, landing as soon as it can; late, it still saves what has landed.
            start_by = self.book_link(link, transfer_seconds, now + transfer_seconds, now)
            needed_by = now + transfer_seconds + cfg.margin_seconds
        if start_by is None:
            return None  # the link's share is booked: it would land too late to matter
        # Held as long as it would be kept, and at least through the lead it was fetched for;
        # where holds hold room (the scheduler prices pins), through the lead alone.
        hold_seconds = (
            cfg.lead_seconds if cfg.pins_hold_room else max(cand.keep_seconds, cfg.lead_seconds)
        )
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
            priority=cand.p_soon * self.stall_avoided(source, len(blocks), nbytes),
        )
        self.book.opened(order, cand.session_id, spell_of(cand))
        self._booking[order.order_id] = (link, (start_by, start_by + transfer_seconds))
        return order

    def book_link(self, link: Link, seconds: float, land_by: float, now: float) -> float | None:
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

    def release(self, order_id: str, give_back: bool) -> None:
        """An order left the open ones: its booking goes; a withdrawn one (cancelled, given up)
        gives its link time back."""
        booking = self._booking.pop(order_id, None)
        if booking is not None and give_back:
            link, slot = booking
            slots = self._link_booked.get(link, [])
            if slot in slots:
                slots.remove(slot)

    # -- sources and the stall avoided --------------------------------------------------------

    def sources(
        self, dest: str, blocks: list[BlockHash]
    ) -> list[tuple[SourceTier, list[BlockHash]]]:
        """The blocks `dest` lacks by where they load from (`split_by_source`), by the store."""
        store = self.store
        return split_by_source(
            blocks,
            lambda bs: store.holds("host", dest, bs),
            lambda bs: store.holds("pool", None, bs),
        )

    def stall_avoided(self, source: Tier, blocks: int, nbytes: int) -> float:
        """What a miss of these blocks would cost: their load at full link speed, or their
        recompute if that is sooner (what the engine would do)."""
        cluster = self._cluster
        return stall_seconds(
            cluster.load_seconds(nbytes, source),
            cluster.recompute_seconds(blocks * cluster.block_tokens),
        )
