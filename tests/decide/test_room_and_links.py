"""The room-and-links part (app/decide/room_and_links.py): the tier's plain rules, the sources by
the store, the links' bookings, and the room a prefetch makes."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import pytest

from app.decide.room_and_links import load_or_recompute, split_by_source, stall_seconds
from app.decide.scheduler import Scheduler, SchedulerConfig
from app.state import MemoryStore
from kvprefetch_client.events import InstanceStatus, KvBlocksStored, Tier
from tests.decide.test_scheduler import BLOCK_BYTES, advice, config

_ids = itertools.count()


def held(
    blocks: Sequence[int], asked: list[list[int]] | None = None
) -> Callable[[Sequence[int]], list[bool]]:
    """A Holds over a fixed set, noting each batch it is asked about."""

    def holds(batch: Sequence[int]) -> list[bool]:
        if asked is not None:
            asked.append(list(batch))
        return [b in blocks for b in batch]

    return holds


# -- the plain rules ---------------------------------------------------------------------------


def test_the_host_goes_first_then_the_pool_and_blocks_in_neither_are_left_out() -> None:
    blocks = [5, 1, 4, 2, 3, 9]
    assert split_by_source(blocks, held([4, 1, 7]), held([1, 2, 3, 5])) == [
        ("host", [1, 4]),  # in their order, whether or not the pool holds them too
        ("pool", [5, 2, 3]),
    ]


def test_empty_groups_are_left_out() -> None:
    assert split_by_source([1, 2], held([]), held([1, 2])) == [("pool", [1, 2])]
    assert split_by_source([1, 2], held([1, 2]), held([])) == [("host", [1, 2])]
    assert split_by_source([1, 2], held([]), held([])) == []
    assert split_by_source([], held([]), held([])) == []


def test_the_pool_is_asked_only_about_what_the_host_lacks() -> None:
    asked: list[list[int]] = []
    split_by_source([1, 2, 3], held([2]), held([1, 3], asked))
    assert asked == [[1, 3]]
    asked.clear()
    split_by_source([1, 2], held([1, 2]), held([], asked))
    assert asked == []  # the host has them all: no pool lookup


@pytest.mark.parametrize(
    ("load", "recompute", "choice"),
    [(0.4, 4.0, "load"), (0.4, 0.04, "recompute"), (0.4, 0.4, "load"), (0.0, 0.0, "load")],
)
def test_an_engine_loads_unless_recomputing_is_sooner(
    load: float, recompute: float, choice: str
) -> None:
    assert load_or_recompute(load, recompute) == choice
    assert stall_seconds(load, recompute) == min(load, recompute)


# -- the scheduler's room and links ------------------------------------------------------------


def store(
    free_bytes: dict[str, int],
    *,
    host: dict[str, Sequence[int]] | None = None,
    hbm: dict[str, Sequence[int]] | None = None,
    pool: Sequence[int] = (),
) -> MemoryStore:
    s = MemoryStore(bytes_per_token=BLOCK_BYTES // 512, block_tokens=512)
    events: list = [
        InstanceStatus(
            event_id=f"e{next(_ids)}",
            ts=0.0,
            instance_id=i,
            free_kv_bytes=b,
            total_kv_bytes=100 * BLOCK_BYTES,
        )
        for i, b in free_bytes.items()
    ]
    places: list[tuple[Tier, str | None, Sequence[int]]] = [
        *(("host", i, bs) for i, bs in (host or {}).items()),
        *(("hbm", i, bs) for i, bs in (hbm or {}).items()),
        ("pool", None, pool),
    ]
    events += [
        KvBlocksStored(
            event_id=f"e{next(_ids)}", ts=0.0, tier=t, instance_id=i, block_hashes=list(bs)
        )
        for t, i, bs in places
        if bs
    ]
    s.apply(events)
    return s


def test_sources_read_the_destinations_own_host_tier_then_the_pool() -> None:
    s = store({"gpu-0": 0}, host={"gpu-0": [1, 2], "gpu-1": [3]}, pool=range(10))
    room = Scheduler(s, config()).room
    assert room.sources("gpu-0", [3, 2, 1, 42]) == [("host", [2, 1]), ("pool", [3])]


def test_the_stall_avoided_is_the_load_over_its_link_or_the_recompute_if_sooner() -> None:
    cfg = SchedulerConfig(
        bytes_per_block=BLOCK_BYTES,
        pool_link_bytes_per_second=1e6,
        host_link_bytes_per_second=4e6,
        prefill_tokens_per_second=512 / 2.0,  # a block recomputes in 2 s
    )
    room = Scheduler(store({}), cfg).room
    assert room.stall_avoided("pool", 1, BLOCK_BYTES) == pytest.approx(1.0)
    assert room.stall_avoided("host", 1, BLOCK_BYTES) == pytest.approx(0.25)
    assert room.stall_avoided("pool", 1, 4 * BLOCK_BYTES) == pytest.approx(2.0)  # recomputed


def test_a_link_is_booked_as_late_as_each_deadline_allows_and_never_twice_at_once() -> None:
    room = Scheduler(store({}), config()).room
    link = ("gpu-0", "pool")
    assert room.book_link(link, 2.0, 10.0, 0.0) == pytest.approx(8.0)
    assert room.book_link(link, 2.0, 10.0, 0.0) == pytest.approx(6.0)  # just before it
    assert room.book_link(link, 5.0, 10.0, 0.0) == pytest.approx(1.0)
    assert room.book_link(link, 2.0, 10.0, 0.0) is None  # 1 s left before its deadline
    assert room.book_link(("gpu-0", "host"), 2.0, 10.0, 0.0) == pytest.approx(8.0)  # its own


@pytest.mark.parametrize("give_back", [True, False])
def test_a_withdrawn_order_gives_its_link_time_back_and_a_finished_one_does_not(
    give_back: bool,
) -> None:
    sched = Scheduler(store({}), config())
    room = sched.room
    blocks = list(range(20))
    order = room.book_prefetch(advice("a", blocks), "gpu-0", "pool", blocks, 0.0)
    assert order is not None and sched.book.is_open(order.order_id)
    land_by = order.needed_by_ts - sched.config.margin_seconds
    transfer_seconds = land_by - order.start_by_ts
    room.release(order.order_id, give_back)
    again = room.book_link(("gpu-0", "pool"), transfer_seconds, land_by, 0.0)
    # Given back, its slot is free again; kept, the next one goes just before it.
    expected = order.start_by_ts - (0.0 if give_back else transfer_seconds)
    assert again == pytest.approx(expected)


def test_room_is_made_by_demoting_only_contexts_less_likely_back_least_likely_first() -> None:
    s = store({"gpu-0": 0}, hbm={"gpu-0": range(30)}, pool=range(100))
    sched = Scheduler(s, config())
    room = sched.room
    unlikely = advice("u", range(10), p_soon=0.05, p_keep=0.05)
    middling = advice("m", range(10, 20), p_soon=0.3, p_keep=0.3)
    likely = advice("l", range(20, 30), p_soon=0.95, p_keep=0.95)
    cand = advice("c", range(50, 55), p_soon=0.6)
    displaceable = room.displaceable("gpu-0", [likely, middling, unlikely, cand])
    assert [a.session_id for a in displaceable] == ["u", "m", "c", "l"]
    orders: list = []
    freed = room.make_room("gpu-0", 15 * BLOCK_BYTES, cand, displaceable, orders, 0.0, set())
    # u then m (both less likely back than c); c is not its own room; l is likelier back.
    assert freed == 20 * BLOCK_BYTES
    assert [(o.kind, o.session_ids) for o in orders] == [("demote", ["u"]), ("demote", ["m"])]
    # Counted as room once a tick: the same contexts free nothing more.
    claimed = {("gpu-0", "u", 10, 9)}
    again: list = []
    assert room.make_room("gpu-0", BLOCK_BYTES, cand, displaceable[:1], again, 0.0, claimed) == 0
    assert again == []


def test_a_prefetch_fits_into_free_room_then_lru_room_only_for_a_likely_candidate() -> None:
    s = store({"gpu-0": 4 * BLOCK_BYTES}, pool=range(100))
    room = Scheduler(s, config(keep_min_p=0.5)).room
    assert room.open_tick({"gpu-0", "gpu-9"}, {"gpu-0": BLOCK_BYTES}) == set()
    assert room.reported("gpu-0") and not room.reported("gpu-9")
    orders: list = []
    fits = room.fit(advice("a", [1, 2, 3]), "gpu-0", "pool", [1, 2, 3], list, orders, 0.0)
    assert fits is not None and fits.size_bytes == 3 * BLOCK_BYTES  # 4 free less 1 on its way
    # Full now: a candidate below keep_min_p gets nothing from the destination's LRU ...
    unlikely = advice("b", [4], p_soon=0.4)
    assert room.fit(unlikely, "gpu-0", "pool", [4], list, orders, 0.0) is None
    # ... one above it does.
    assert room.fit(advice("c", [5]), "gpu-0", "pool", [5], list, orders, 0.0) is not None
    assert orders == []  # no demotes: nothing advised there to displace
