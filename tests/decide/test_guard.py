"""The LRU guard: a shadow LRU per instance, the verdict on the advice, and what it allows."""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import pytest

from app.decide.advisor import SessionAdvice
from app.decide.guard import GuardConfig, LruGuard, _Shadow
from app.observe.outcomes import RequestOutcome
from kvprefetch_client.events import Event, event_adapter
from kvprefetch_client.orders import Order

BLOCK = 100


def ev(**fields: Any) -> Event:
    return event_adapter.validate_python(fields)


def status(instance_id: str, total_blocks: int) -> Event:
    return ev(
        type="instance_status",
        event_id=f"st-{instance_id}-{total_blocks}",
        ts=0.0,
        instance_id=instance_id,
        free_kv_bytes=0,
        total_kv_bytes=total_blocks * BLOCK,
    )


def routed(n: int, blocks: list[int], instance_id: str = "gpu-0") -> Event:
    return ev(
        type="request_routed",
        event_id=f"r{n}",
        ts=float(n),
        session_id=f"s{n}",
        request_id=f"q{n}",
        instance_id=instance_id,
        prompt_tokens=10,
        block_hashes=blocks,
    )


def outcome(n: int, reused: int, resident: int, instance_id: str = "gpu-0") -> RequestOutcome:
    return RequestOutcome(
        request_id=f"q{n}",
        instance_id=instance_id,
        outcome="hit" if resident == reused else "miss" if not resident else "partial",
        reused_blocks=reused,
        resident_blocks=resident,
        resident_bytes=resident * BLOCK,
        missing_bytes=(reused - resident) * BLOCK,
        stall_seconds=0.0,
        stall_avoided_seconds=0.0,
    )


def advice(session_id: str, instance_id: str) -> SessionAdvice:
    return SessionAdvice(session_id, instance_id, (1,), "keep", 300.0, 0.9, 0.8, 0.95, True)


def guard(**kw: Any) -> LruGuard:
    return LruGuard(GuardConfig(bytes_per_block=BLOCK, **{"min_arrivals": 10, **kw}))


def test_the_shadow_is_an_lru_of_the_requests_blocks_as_big_as_the_instance() -> None:
    g = guard()
    g.observe([status("gpu-0", 3), routed(1, [1, 2]), routed(2, [3, 4])])  # 1 falls out
    held: list[tuple[int, int]] = []
    original = g._judge
    g._judge = lambda i, a, lru, now: held.append((a, lru))  # type: ignore[method-assign]
    g.observe([routed(3, [1, 2, 3, 9])])
    g.record([outcome(3, reused=3, resident=3)], now=3.0)
    assert held == [(300, 2 * BLOCK)]  # LRU held 2 and 3 of the reused 1, 2, 3
    g._judge = original  # type: ignore[method-assign]


def test_an_instance_that_never_said_its_size_is_not_judged() -> None:
    g = guard()
    g.observe([routed(1, [1, 2])])
    g.record([outcome(1, 2, 0)], now=1.0)
    assert g.verdicts == {} and g.allowed("gpu-0", 1.0)


def feed(g: LruGuard, start: int, n: int, advice_blocks: int, instance_id: str = "gpu-0") -> int:
    """n arrivals of a 4-block context that the shadow LRU always holds; the advice had
    `advice_blocks` of it (a callable of the arrival number, or a number)."""
    for k in range(start, start + n):
        g.observe([routed(k, [1, 2, 3, 4, 100 + k], instance_id)])
        a = advice_blocks(k) if callable(advice_blocks) else advice_blocks
        g.record([outcome(k, 4, a, instance_id)], now=float(k))
    return start + n


def test_advice_that_clearly_loses_is_turned_off_then_tried_again_with_a_growing_wait() -> None:
    g = guard(retry_seconds=100.0)
    g.observe([status("gpu-0", 10), status("gpu-1", 10), routed(0, [1, 2, 3, 4])])
    k = feed(g, 1, 9, advice_blocks=1)
    assert g.verdicts["gpu-0"].state == "advice"  # too few arrivals for a verdict
    k = feed(g, k, 1, advice_blocks=1)
    v = g.verdicts["gpu-0"]
    assert (v.state, v.fallbacks, v.retry_seconds) == ("lru", 1, 100.0)
    assert not g.allowed("gpu-0", 50.0) and g.allowed("gpu-1", 50.0)
    kept = [advice("a", "gpu-0"), advice("b", "gpu-1")]
    a, b = g.filter(kept, 50.0)
    assert (a.retention, a.prefetch, a.keep_seconds) == ("lru", False, 0.0)
    assert b == kept[1]
    assert g.allowed("gpu-0", 10.0 + 100.0) and v.state == "trial"  # the wait is over
    k = feed(g, 200, 10, advice_blocks=0)  # loses again: off for twice as long
    assert (v.state, v.fallbacks, v.retry_seconds) == ("lru", 2, 200.0)
    assert g.fallbacks_total == 2 and g.states() == {"advice": 1, "lru": 1, "trial": 0}
    assert g.allowed("gpu-0", v.since_ts + 200.0)
    feed(g, 400, 10, advice_blocks=4)  # holds its own: advice again
    assert (v.state, v.retry_seconds) == ("advice", 0.0)


def test_a_small_loss_or_one_bad_arrival_is_not_a_verdict() -> None:
    g = guard(min_arrivals=10)
    g.observe([status("gpu-0", 10), status("gpu-1", 10), routed(0, [1, 2, 3, 4])])
    # A quarter of a percent of LRU's bytes lost, steadily: within the tolerance.
    feed(g, 1, 400, advice_blocks=lambda k: 3 if k % 100 == 0 else 4)
    assert g.verdicts["gpu-0"].state == "advice"
    # One arrival of ten lost whole: a tenth of the bytes, but one sample is no verdict.
    g.observe([routed(999, [1, 2, 3, 4], "gpu-1")])
    feed(g, 1000, 10, advice_blocks=lambda k: 0 if k == 1005 else 4, instance_id="gpu-1")
    assert g.verdicts["gpu-1"].state == "advice"
    # The totals count both sides whatever the verdict.
    assert g.lru_bytes_total == 410 * 4 * BLOCK
    assert g.served_bytes_total == g.lru_bytes_total - (4 + 4) * BLOCK


@pytest.mark.parametrize("seed", range(5))
def test_the_shadow_moves_blocks_as_an_lru_moving_one_at_a_time(seed: int) -> None:
    """Blocks named twice in a request, capacity changes, evictions: the shadow holds what an
    LRU moving a block at a time holds, in the same order."""
    rng = random.Random(seed)
    shadow = _Shadow(capacity_blocks=20)
    reference: OrderedDict[int, None] = OrderedDict()
    for _ in range(2_000):
        if rng.random() < 0.02:
            shadow.capacity_blocks = rng.randint(0, 40)
        hashes = [rng.randrange(80) for _ in range(rng.randint(0, 12))]
        assert shadow.held(hashes) == [b in reference for b in hashes]
        shadow.use(hashes)
        for b in hashes:
            reference[b] = None
            reference.move_to_end(b)
        while len(reference) > shadow.capacity_blocks:
            reference.popitem(last=False)
        assert list(shadow.blocks) == list(reference)


# -- demotes priced on their own -----------------------------------------------------------------


def order(kind: str, blocks: list[int], instance_id: str = "gpu-0") -> Order:
    return Order(
        order_id=f"{kind}-{blocks[0]}",
        kind=kind,  # type: ignore[arg-type]
        instance_id=instance_id,
        source_tier="pool" if kind == "prefetch" else None,
        block_hashes=blocks,
        size_bytes=len(blocks) * BLOCK,
        created_ts=0.0,
        start_by_ts=0.0,
        needed_by_ts=0.0,
        ttl_seconds=60.0 if kind == "pin" else None,
    )


def arrive(g: LruGuard, n: int, blocks: list[int], missing: set[int]) -> None:
    """Request n reuses `blocks`; the real HBM missed `missing` of them."""
    g.observe([routed(n, blocks)])
    reused, resident = len(blocks), len(blocks) - len(missing)
    g.record(
        [replace(outcome(n, reused, resident), missing_blocks=frozenset(missing))], now=float(n)
    )


def demoted_and_missed(g: LruGuard, n: int) -> None:
    """A context LRU holds (just used), demoted, and missed when its session came back: two
    blocks the demote cost."""
    blocks = [10 * n + 1, 10 * n + 2]
    g.observe([routed(n, blocks)])
    g.record([], now=float(n))
    g.planned([order("demote", blocks)])
    arrive(g, 1000 + n, blocks, missing=set(blocks))


def kept_by_the_room(g: LruGuard, n: int) -> None:
    """A context LRU would have evicted (never seen by the shadow), found: two blocks kept."""
    arrive(g, 5000 + n, [10 * n + 5, 10 * n + 6], missing=set())


def priced(**kw: Any) -> LruGuard:
    # The advice as a whole never loses here (tolerance 1): only the demotes are judged.
    g = guard(min_arrivals=10, tolerance=1.0, retry_seconds=100.0, **kw)
    g.observe([status("gpu-0", 1000), status("gpu-1", 1000)])
    return g


def test_demotes_that_cost_more_than_their_room_kept_are_turned_off_then_tried_again() -> None:
    g = priced()
    for n in range(9):
        demoted_and_missed(g, n)
    assert g.demotes["gpu-0"].state == "advice"  # too few arrivals for a verdict
    demoted_and_missed(g, 9)
    v = g.demotes["gpu-0"]
    assert (v.state, v.suspensions, v.retry_seconds) == ("lru", 1, 100.0)
    assert g.demote_suspensions_total == 1 and g.demote_cost_blocks_total == 20
    assert g.verdicts["gpu-0"].state == "advice"  # the rest of the advice still acts
    now = v.since_ts + 50.0
    assert g.allowed("gpu-0", now) and not g.demotes_allowed("gpu-0", now)
    drop = replace(advice("d", "gpu-0"), retention="demote", keep_seconds=0.0)
    keep, there, elsewhere = g.filter(
        [advice("k", "gpu-0"), drop, replace(drop, instance_id="gpu-1")], now
    )
    assert keep == advice("k", "gpu-0")  # a pin still pins
    assert (there.retention, there.prefetch) == ("lru", True)  # no demote; its prefetch stands
    assert elsewhere.retention == "demote"  # another instance's demotes are its own
    assert g.mode("gpu-0", now) == (True, False)
    assert g.demotes_allowed("gpu-0", v.since_ts + 100.0) and v.state == "trial"


def test_demotes_whose_room_kept_more_than_they_cost_stay_on() -> None:
    g = priced()
    for n in range(30):
        if n % 3 == 0:
            demoted_and_missed(g, n)
        else:
            kept_by_the_room(g, n)
    assert g.demotes["gpu-0"].state == "advice"
    assert (g.demote_cost_blocks_total, g.demote_gain_blocks_total) == (20, 40)


def test_what_a_pin_or_prefetch_put_there_is_not_room_a_demote_made() -> None:
    g = priced()
    for n in range(30):
        if n % 3 == 0:
            demoted_and_missed(g, n)
        else:
            kind = "pin" if n % 2 else "prefetch"
            g.planned([order(kind, [10 * n + 5, 10 * n + 6])])
            kept_by_the_room(g, n)
    assert g.demote_gain_blocks_total == 0
    assert g.demotes["gpu-0"].state == "lru"


def test_an_instance_with_no_demote_is_not_priced_and_pricing_can_be_off() -> None:
    g = priced()
    for n in range(20):
        kept_by_the_room(g, n)
    assert g.demotes == {} and g.demote_gain_blocks_total == 0
    off = priced(demote_pricing=False)
    for n in range(20):
        demoted_and_missed(off, n)
    assert off.demotes == {} and off.demotes_allowed("gpu-0", 100.0)
