"""Hard pins and the admission rules (scenario `pins`, `admission`): a pinned block is never
evicted for room until its end, a call whose context is held is admitted ahead of a head that
needs room (no deadlock), and program-level first-come-first-served orders a queue by program."""

from __future__ import annotations

from sim.blockcache import BlockCache
from sim.cluster import SimRequest
from sim.policies import Policy
from tests.sim.test_cluster import CheckedCluster, Placed, context, request, scenario


def test_a_hard_keep_is_never_a_victim_until_its_end() -> None:
    for hard, expected in ((False, [1, 0]), (True, None)):
        cache = BlockCache(2, hard_keeps=hard)
        cache.insert(0)
        cache.insert(1)
        cache.keep(0, until=10.0)
        cache.keep(1, until=10.0)
        assert cache.choose_victims(2, now=5.0) == (expected if expected is None else [0, 1])
    cache = BlockCache(2, hard_keeps=True)
    cache.insert(0)
    cache.keep(0, until=10.0)
    assert cache.choose_victims(1, now=11.0) == [0]  # its end passed: plain LRU again


class PinAll(Policy):
    """Pins every finished call's context for a long time."""

    def on_finished(self, r: SimRequest, now: float) -> None:
        self.cluster.keep(r.instance, list(r.hash_ids), now + 1000.0)


def test_a_call_whose_context_is_pinned_goes_ahead_of_a_head_that_needs_room() -> None:
    """HBM of 8: A's context (4 blocks) pinned; B needs 6 new blocks and waits for the pin's end;
    A's next call (its context held, no new room) is admitted ahead of B, not behind it."""
    a1 = request(0, 0.0, context(0, 4), session="a")
    b = request(1, 10.0, context(10, 6), session="b")
    a2 = request(2, 10.1, context(0, 4), session="a")
    scen = scenario(prefill=1e4, instances=1, hbm_blocks=8).model_copy(update={"pins": "hard"})
    cluster = CheckedCluster(scen, [a1, b, a2], Placed([0, 0, 0]), PinAll())
    cluster.run()
    assert a2.admitted_at is not None and b.admitted_at is not None
    assert a2.admitted_at < b.admitted_at  # ahead of the blocked head
    assert b.admitted_at >= 1000.0  # the pin held until its end
    soft = scenario(prefill=1e4, instances=1, hbm_blocks=8)
    r1, r2, r3 = (
        request(0, 0.0, context(0, 4), session="a"),
        request(1, 10.0, context(10, 6), session="b"),
        request(2, 10.1, context(0, 4), session="a"),
    )
    CheckedCluster(soft, [r1, r2, r3], Placed([0, 0, 0]), PinAll()).run()
    assert r2.admitted_at is not None and r2.admitted_at < 11.0  # a soft pin gives way


def test_program_level_fcfs_admits_by_the_programs_start() -> None:
    """One slot, busy until 5 s; queued meanwhile: a new program's first call (3 s), then an
    older program's second call (4 s). By arrival the new one goes first; by program the old."""
    order = {}
    for admission in ("fcfs", "program"):
        old1 = request(0, 0.0, context(0, 1), session="old", output=1)
        busy = request(1, 0.1, context(10, 1), session="busy", output=490)
        new = request(2, 3.0, context(20, 1), session="new", output=1)
        old2 = request(3, 4.0, context(0, 2), session="old", output=1)
        scen = scenario(prefill=1e4, instances=1, max_running=1).model_copy(
            update={"admission": admission}
        )
        CheckedCluster(scen, [old1, busy, new, old2], Placed([0] * 4), Policy()).run()
        order[admission] = sorted(
            ("new", "old"), key=lambda s: (new if s == "new" else old2).admitted_at
        )  # type: ignore[arg-type, return-value]
    assert order == {"fcfs": ["new", "old"], "program": ["old", "new"]}


def test_the_agents_scenario_runs_a_real_trace_with_its_invariants() -> None:
    from tests.sim.test_cluster import TRACE_FILES, checked_replay

    summary = checked_replay(TRACE_FILES[0], 600, "agents", "least-loaded", "heuristic")
    assert summary["requests"] == 600 and summary["compute"] == "shared"
    assert summary["_evicted"] > 0


def test_a_request_that_must_wait_is_reported_in_its_instances_queue_at_once() -> None:
    """An engine's stats say when its queue grows; the planner prices pins by it."""
    from sim.cluster import Cluster

    statuses: list[tuple[float, int]] = []
    a = request(0, 0.0, context(0, 2), output=500)
    b = request(1, 1.0, context(10, 2))
    Cluster(
        scenario(prefill=1e4, instances=1, max_running=1),
        [a, b],
        Placed([0, 0]),
        Policy(),
        emit=lambda kind, ts, f: (
            statuses.append((ts, f["queue_depth"])) if kind == "instance_status" else None
        ),
    ).run()
    assert (1.0, 1) in statuses  # b waits behind a, reported as it arrives
