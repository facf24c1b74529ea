"""The cluster model: load-or-recompute arithmetic through the whole model, and its invariants
(capacity never exceeded, pinned blocks never evicted) checked after every event of real traces."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from typing import Any
from unittest import mock

import pytest

import sim.replay
from sim.blockcache import BlockCache
from sim.cluster import Cluster, Instance, SimRequest
from sim.policies import Policy
from sim.replay import replay
from sim.scenario import Scenario, load_scenario
from sim.traces import TraceRequest, load_trace
from tests.conftest import TRACES

TRACE_FILES = ("mooncake_conversation_first60.jsonl", "mooncake_synthetic.jsonl")
# Policies the invariants are checked under (learned needs a model issue 4 adds).
CHECKED_POLICIES = ("none", "lookahead", "belady", "oracle", "heuristic")
PREFIX = 2500  # requests of each trace for the fast runs
# The planner-driven policy costs more per request: a shorter prefix keeps the suite fast.
PREFIX_FOR = {"heuristic": 1000}
EXACT = 1e-9

# -- hand-made clusters -----------------------------------------------------------------------

BLOCK_TOKENS = 100
BYTES_PER_TOKEN = 1000
BLOCK_BYTES = BLOCK_TOKENS * BYTES_PER_TOKEN  # 1e5
POOL = 1e6  # bytes per second: one block loads in 0.1 s
DECODE = 0.01


def scenario(
    *,
    prefill: float,
    instances: int = 2,
    hbm_blocks: int = 64,
    host_blocks: int = 0,
    max_running: int = 8,
) -> Scenario:
    return Scenario(
        name="unit",
        bytes_per_token=BYTES_PER_TOKEN,
        block_tokens=BLOCK_TOKENS,
        instances=instances,
        hbm_kv_bytes=hbm_blocks * BLOCK_BYTES,
        host_kv_bytes=host_blocks * BLOCK_BYTES,
        pool_link_bytes_per_second=POOL,
        host_link_bytes_per_second=4 * POOL,
        prefill_tokens_per_second=prefill,
        decode_seconds_per_token=DECODE,
        max_running_requests=max_running,
    )


def request(
    i: int, arrival: float, blocks: Sequence[int], session: str | None = None, output: int = 10
) -> SimRequest:
    return SimRequest(
        index=i,
        session_id=session or f"s{i}",
        arrival=arrival,
        input_tokens=BLOCK_TOKENS * len(blocks),
        output_tokens=output,
        hash_ids=tuple(blocks),
    )


class Placed:
    """A router that sends request i to instance place[i]."""

    name = "placed"

    def __init__(self, place: Sequence[int]) -> None:
        self.place = list(place)

    def route(self, r: SimRequest, cluster: Cluster) -> int:
        return self.place[r.index]


def run(
    scen: Scenario, requests: list[SimRequest], place: Sequence[int], policy: Policy | None = None
) -> Cluster:
    cluster = CheckedCluster(scen, requests, Placed(place), policy or Policy())
    cluster.run()
    return cluster


def context(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


# -- load or recompute --------------------------------------------------------------------------


def test_a_first_request_computes_everything_and_never_stalls() -> None:
    r = request(0, 1.0, context(0, 4))
    run(scenario(prefill=1e4), [r], [0])
    assert (r.reused_blocks, r.hit_blocks, r.stall_seconds, r.loaded_bytes, r.recompute_tokens) == (
        0,
        0,
        0.0,
        0,
        0,
    )
    assert r.finished_at == pytest.approx(1.0 + 400 / 1e4 + 10 * DECODE, abs=EXACT)


def test_reused_blocks_in_hbm_are_hits() -> None:
    first, again = request(0, 0.0, context(0, 4)), request(1, 10.0, [*context(0, 4), 99])
    run(scenario(prefill=1e4), [first, again], [0, 0])
    assert (again.reused_blocks, again.hit_blocks, again.stall_seconds, again.loaded_bytes) == (
        4,
        4,
        0.0,
        0,
    )
    assert again.finished_at == pytest.approx(10.0 + 100 / 1e4 + 10 * DECODE, abs=EXACT)


def test_reused_blocks_only_in_the_pool_are_loaded_when_that_is_sooner() -> None:
    # Load 4 blocks: 4e5 B / 1e6 B/s = 0.4 s; recompute 400 tokens at 100 tok/s: 4 s.
    first, again = request(0, 0.0, context(0, 4)), request(1, 50.0, [*context(0, 4), 99])
    run(scenario(prefill=100.0), [first, again], [0, 1])
    assert again.reused_blocks == 4 and again.hit_blocks == 0
    assert again.stall_seconds == pytest.approx(4 * BLOCK_BYTES / POOL, abs=EXACT)
    assert again.loaded_bytes == 4 * BLOCK_BYTES
    assert again.recompute_tokens == 0
    assert again.ready_at == pytest.approx(50.4, abs=EXACT)
    assert again.finished_at == pytest.approx(50.4 + 100 / 100.0 + 10 * DECODE, abs=EXACT)


def test_reused_blocks_are_recomputed_when_that_is_sooner() -> None:
    # Load 4 blocks: 0.4 s; recompute 400 tokens at 1e4 tok/s: 0.04 s.
    first, again = request(0, 0.0, context(0, 4)), request(1, 50.0, [*context(0, 4), 99])
    run(scenario(prefill=1e4), [first, again], [0, 1])
    assert again.reused_blocks == 4 and again.hit_blocks == 0
    assert again.recompute_tokens == 4 * BLOCK_TOKENS
    assert again.stall_seconds == pytest.approx(4 * BLOCK_TOKENS / 1e4, abs=EXACT)
    assert again.loaded_bytes == 0
    assert again.finished_at == pytest.approx(50.0 + 0.04 + 100 / 1e4 + 10 * DECODE, abs=EXACT)


def test_a_request_that_wants_blocks_being_recomputed_waits_for_them() -> None:
    first = request(0, 0.0, context(0, 4))
    a, b = request(1, 50.0, [*context(0, 4), 98]), request(2, 50.01, [*context(0, 4), 99])
    run(scenario(prefill=1e4), [first, a, b], [0, 1, 1])
    assert a.recompute_tokens == 400 and a.stall_seconds == pytest.approx(0.04, abs=EXACT)
    # b finds them in HBM but not yet recomputed: no hit, and it waits for the rest of a's
    # recompute.
    assert b.hit_blocks == 0 and b.recompute_tokens == 0 and b.loaded_bytes == 0
    assert b.ready_at == pytest.approx(a.ready_at, abs=EXACT)
    assert b.stall_seconds == pytest.approx(0.03, abs=EXACT)


def test_two_requests_loading_at_once_on_one_instance_both_stall_longer() -> None:
    """Each alone stalls 0.4 s; together they share the link and both land at 0.8 s."""
    scen = scenario(prefill=100.0)
    alone = request(2, 50.0, [*context(0, 4), 98])
    run(scen, [request(0, 0.0, context(0, 4)), request(1, 0.0, context(10, 4)), alone], [0, 0, 1])
    assert alone.stall_seconds == pytest.approx(0.4, abs=EXACT)

    a, b = request(2, 50.0, [*context(0, 4), 98]), request(3, 50.0, [*context(10, 4), 99])
    cluster = run(
        scen, [request(0, 0.0, context(0, 4)), request(1, 0.0, context(10, 4)), a, b], [0, 0, 1, 1]
    )
    for r in (a, b):
        assert r.loaded_bytes == 4 * BLOCK_BYTES and r.recompute_tokens == 0
        assert r.stall_seconds > alone.stall_seconds
        assert r.stall_seconds == pytest.approx(2 * 4 * BLOCK_BYTES / POOL, abs=EXACT)
    assert cluster.instances[1].pool_link.bytes_moved == 8 * BLOCK_BYTES


def test_a_load_joining_a_running_one() -> None:
    """b (2 blocks) joins a's 4-block load 0.1 s in: b lands at 0.1 + 2 * 0.2, a at 0.6
    (work conserving)."""
    scen = scenario(prefill=10.0)
    a, b = request(2, 50.0, [*context(0, 4), 98]), request(3, 50.1, [*context(10, 2), 99])
    run(scen, [request(0, 0.0, context(0, 4)), request(1, 0.0, context(10, 2)), a, b], [0, 0, 1, 1])
    assert b.stall_seconds == pytest.approx(0.4, abs=EXACT)
    assert a.stall_seconds == pytest.approx(0.6, abs=EXACT)


def test_the_decision_counts_the_traffic_already_on_the_link() -> None:
    """Recompute takes 0.6 s; a load alone 0.4 s, behind another 0.8 s: the second one
    recomputes."""
    scen = scenario(prefill=400 / 0.6)
    a, b = request(2, 50.0, [*context(0, 4), 98]), request(3, 50.0, [*context(10, 4), 99])
    run(scen, [request(0, 0.0, context(0, 4)), request(1, 0.0, context(10, 4)), a, b], [0, 0, 1, 1])
    assert a.loaded_bytes == 4 * BLOCK_BYTES and a.recompute_tokens == 0
    assert b.loaded_bytes == 0 and b.recompute_tokens == 400
    assert a.stall_seconds == pytest.approx(0.4, abs=EXACT)
    assert b.stall_seconds == pytest.approx(0.6, abs=EXACT)


def test_a_host_tier_serves_what_hbm_evicted_over_its_own_link() -> None:
    # HBM of 4 blocks: the second context evicts the first into host DRAM; the third request
    # loads it back over the host link (4x the pool's bandwidth).
    scen = scenario(prefill=100.0, instances=1, hbm_blocks=4, host_blocks=16)
    a, b = request(0, 0.0, context(0, 4)), request(1, 10.0, context(10, 4))
    c = request(2, 20.0, context(0, 4))
    cluster = run(scen, [a, b, c], [0, 0, 0])
    assert c.reused_blocks == 4 and c.hit_blocks == 0
    assert c.stall_seconds == pytest.approx(4 * BLOCK_BYTES / (4 * POOL), abs=EXACT)
    inst = cluster.instances[0]
    assert inst.host_link.bytes_moved == 4 * BLOCK_BYTES and inst.pool_link.bytes_moved == 0


def test_admission_waits_for_room_and_for_a_slot() -> None:
    scen = scenario(prefill=1e4, instances=1, hbm_blocks=6, max_running=4)
    a = request(0, 0.0, context(0, 4), output=100)  # runs 0.04 + 1.0 s
    b = request(1, 0.5, context(10, 4))  # 4 blocks, only 2 free while a runs
    run(scen, [a, b], [0, 0])
    assert b.admitted_at == pytest.approx(a.finished_at, abs=EXACT)
    scen = scenario(prefill=1e4, instances=1, hbm_blocks=64, max_running=1)
    a, b = request(0, 0.0, context(0, 4), output=100), request(1, 0.5, context(10, 4))
    run(scen, [a, b], [0, 0])
    assert b.admitted_at == pytest.approx(a.finished_at, abs=EXACT)


# -- the prefix a cache can use, and the order blocks go back in -------------------------------


class DemoteAfterFirst(Policy):
    """Advises evicting block 1 once request 0 is done: the next eviction opens a hole at it."""

    def on_finished(self, r: SimRequest, now: float) -> None:
        if r.index == 0:
            self.cluster.demote(r.instance, [1])


@pytest.mark.parametrize(
    ("prefill", "loaded_blocks", "recomputed_blocks"), [(100.0, 3, 0), (1e4, 0, 3)]
)
def test_a_hole_in_the_prefix_stops_the_hits(
    prefill: float, loaded_blocks: int, recomputed_blocks: int
) -> None:
    # Block 1 of [0, 1, 2, 3] is evicted; 2 and 3 stay resident but follow the hole, so only
    # block 0 is a hit and 1, 2, 3 are loaded (0.3 s) or recomputed (0.03 s), whichever is sooner.
    scen = scenario(prefill=prefill, instances=1, hbm_blocks=5)
    a, b = request(0, 0.0, context(0, 4)), request(1, 10.0, context(10, 2))
    c = request(2, 20.0, [*context(0, 4), 99])
    cluster = run(scen, [a, b, c], [0, 0, 0], DemoteAfterFirst())
    assert (c.reused_blocks, c.hit_blocks, c.reused_prefix, c.hit_prefix) == (4, 1, 4, 1)
    assert c.loaded_bytes == loaded_blocks * BLOCK_BYTES
    assert c.recompute_tokens == recomputed_blocks * BLOCK_TOKENS
    seconds = 3 * BLOCK_BYTES / POOL if loaded_blocks else 3 * BLOCK_TOKENS / prefill
    assert c.stall_seconds == pytest.approx(seconds, abs=EXACT)
    assert all(blk in cluster.instances[0].hbm for blk in context(0, 4))


def test_a_finished_request_goes_back_tail_first_so_its_tail_is_evicted_first() -> None:
    # HBM of 4: b's 2 blocks evict 2 of a's; the tail (2, 3) goes, the head (0, 1) stays a usable
    # prefix for c, which hits both and loads the other 2.
    scen = scenario(prefill=100.0, instances=1, hbm_blocks=4)
    a, b = request(0, 0.0, context(0, 4)), request(1, 10.0, context(10, 2))
    cluster = run(scen, [a, b], [0, 0])
    assert set(cluster.instances[0].hbm.entries) == {0, 1, 10, 11}
    a, b = request(0, 0.0, context(0, 4)), request(1, 10.0, context(10, 2))
    c = request(2, 20.0, context(0, 4))
    run(scen, [a, b, c], [0, 0, 0])
    assert (c.reused_blocks, c.hit_blocks) == (4, 2)
    assert c.loaded_bytes == 2 * BLOCK_BYTES


def test_a_prefetch_lands_head_most_recent() -> None:
    scen = scenario(prefill=100.0, instances=1, hbm_blocks=8)
    cluster = Cluster(scen, [], Placed([]), Policy())
    cluster.written.update(context(0, 4))
    assert cluster.prefetch(0, context(0, 4)) == 4
    assert list(cluster.instances[0].hbm.entries) == [3, 2, 1, 0]  # least recently used first


# -- the invariants, after every event ----------------------------------------------------------


class CheckedCluster(Cluster):
    """Cluster with its invariant hook on, plus an independent pin account.

    Every block evicted from HBM must be unpinned, held by no admitted-but-unfinished request and
    not landing; a finishing request must find all its blocks in HBM; and every few hundred
    events each entry's pin count must equal what the running requests and landing transfers
    account for.
    """

    check_invariants = True
    full_check_every = 300

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held: list[Counter[int]] = [Counter() for _ in self.instances]
        self.evicted = 0
        self.events_checked = 0
        for inst in self.instances:
            inst.hbm.remove = self._guarded_remove(inst)  # type: ignore[method-assign]

    def _guarded_remove(self, inst: Instance) -> Any:
        remove = BlockCache.remove.__get__(inst.hbm)

        def checked(block: int) -> Any:
            e = inst.hbm.entries.get(block)
            assert e is not None and e.pins == 0, (
                f"{inst.instance_id}: evicted block {block} has pins"
            )
            assert self.held[inst.idx][block] == 0, (
                f"{inst.instance_id}: evicted block {block} of a running request"
            )
            assert block not in inst.inflight, (
                f"{inst.instance_id}: evicted block {block} still landing"
            )
            self.evicted += 1
            return remove(block)

        return checked

    def _admit(self, inst: Instance, r: SimRequest) -> bool:
        if not super()._admit(inst, r):
            return False
        self.held[inst.idx].update(set(r.hash_ids))
        return True

    def _finish(self, r: SimRequest) -> None:
        inst = self.instances[r.instance]
        gone = [b for b in set(r.hash_ids) if b not in inst.hbm]
        assert not gone, f"request {r.index} finished without its blocks {gone[:5]} in HBM"
        assert r.admitted_at is not None and r.ready_at is not None
        assert r.arrival <= r.admitted_at <= r.ready_at <= self.now
        self.held[inst.idx].subtract(set(r.hash_ids))
        super()._finish(r)

    def _check(self) -> None:
        super()._check()
        self.events_checked += 1
        if self.events_checked % self.full_check_every == 0:
            self.check_pin_account()

    def check_pin_account(self) -> None:
        for inst in self.instances:
            held = self.held[inst.idx]
            for b, e in inst.hbm.entries.items():
                expected = held[b] + (1 if b in inst.inflight else 0)
                assert e.pins == expected, (
                    f"{inst.instance_id}: block {b} has {e.pins} pins, {expected} expected"
                )
            assert all(b in inst.hbm for b, n in held.items() if n), (
                f"{inst.instance_id}: a held block left HBM"
            )

    def run(self, progress: Any = None) -> None:
        super().run(progress)
        self.check_pin_account()
        assert all(r.finished_at is not None for r in self.requests), "some requests never finished"
        for inst in self.instances:
            assert inst.running == 0 and not inst.queue
            assert not +self.held[inst.idx]
        CheckedCluster.last = self  # type: ignore[attr-defined]


@functools.cache
def trace_prefix(name: str, n: int | None) -> tuple[TraceRequest, ...]:
    trace = load_trace(TRACES / name)
    return tuple(trace[:n] if n else trace)


@functools.cache
def checked_replay(
    trace: str,
    n: int | None,
    scenario_name: str,
    router: str,
    policy: str,
    overrides: tuple[tuple[str, Any], ...] = (),
) -> dict[str, Any]:
    """replay()'s summary, run on a CheckedCluster; cached (other test modules compare policies
    on it). An override's value may be a tuple of pairs, for a table (`signals`)."""
    scen = load_scenario(scenario_name)
    if overrides:
        table = {k: dict(v) if isinstance(v, tuple) else v for k, v in overrides}
        scen = Scenario.model_validate({**scen.model_dump(), **table})
    with mock.patch.object(sim.replay, "Cluster", CheckedCluster):
        result = replay(trace_prefix(trace, n), scen, policy=policy, router=router)
    cluster: CheckedCluster = CheckedCluster.last  # type: ignore[attr-defined]
    assert cluster.events_checked > 0
    summary = dict(result.summary)
    summary["_evicted"] = cluster.evicted
    summary["_host_blocks"] = sum(
        len(inst.host) for inst in cluster.instances if inst.host is not None
    )
    return summary


@pytest.mark.parametrize("policy", CHECKED_POLICIES)
@pytest.mark.parametrize("scenario_name", ["default", "tight-hbm"])
@pytest.mark.parametrize("trace", TRACE_FILES)
def test_invariants_hold_over_real_traces(trace: str, scenario_name: str, policy: str) -> None:
    n = PREFIX_FOR.get(policy, PREFIX)
    summary = checked_replay(trace, n, scenario_name, "sticky", policy)
    assert summary["requests"] == n
    if scenario_name == "tight-hbm":
        assert summary["_evicted"] > 0  # the check saw evictions, not an idle cache


@pytest.mark.parametrize("policy", ["none", "oracle"])
def test_invariants_hold_with_a_small_host_tier(policy: str) -> None:
    # Host DRAM twice HBM, both small, so both tiers fill and evict.
    small = (("hbm_kv_bytes", 60_000_000_000), ("host_kv_bytes", 120_000_000_000))
    summary = checked_replay(TRACE_FILES[0], 1000, "host-tier", "least-loaded", policy, small)
    assert summary["requests"] == 1000
    assert summary["_host_blocks"] == 4 * (120_000_000_000 // (512 * 327680))  # full, and no fuller


def test_a_request_bigger_than_hbm_is_refused_not_left_to_block_its_queue() -> None:
    with pytest.raises(ValueError, match="request 1 needs 9 blocks; an instance's HBM holds 8"):
        Cluster(
            scenario(prefill=1e4, hbm_blocks=8),
            [request(0, 0.0, context(0, 8)), request(1, 1.0, context(0, 9))],
            Placed([0, 0]),
            Policy(),
        )


def test_the_invariant_hook_catches_an_overfull_cache() -> None:
    r = request(0, 0.0, context(0, 4))
    cluster = CheckedCluster(scenario(prefill=1e4, instances=1), [r], Placed([0]), Policy())
    for b in range(cluster.instances[0].hbm.capacity + 1):  # a bug that fills past capacity
        cluster.instances[0].hbm.insert(1000 + b).pins = 1
    with pytest.raises(AssertionError, match="over capacity"):
        cluster.run()


def test_the_invariant_hook_catches_evicting_a_pinned_block() -> None:
    cluster = CheckedCluster(scenario(prefill=1e4, instances=1), [], Placed([]), Policy())
    hbm = cluster.instances[0].hbm
    hbm.insert(7).pins = 1
    with pytest.raises(AssertionError, match="has pins"):
        hbm.remove(7)
