"""Shared compute (sim/compute.py): an instance's running requests share its GPU in
chunked-prefill steps, so a long prefill or recompute slows the requests beside it."""

from __future__ import annotations

import pytest

from sim.compute import SharedCompute
from sim.policies import Policy
from tests.sim.test_cluster import DECODE, CheckedCluster, Placed, context, request, scenario

RATE = 1000.0  # prefill tokens per second
STEP = 100  # tokens a step


class Clock:
    """Runs a SharedCompute's events in time order, as the cluster's loop does."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int]] = []
        self.done: dict[str, float] = {}
        self.compute = SharedCompute(
            step_tokens=STEP,
            prefill_tokens_per_second=RATE,
            decode_seconds_per_token=DECODE,
            schedule=lambda at, v: self.events.append((at, v)),
        )

    def add(self, name: str, kind: str, tokens: float, now: float = 0.0) -> None:
        self.compute.add(kind, tokens, lambda: self.done.setdefault(name, self.now), now)

    def run(self) -> None:
        while self.events:
            self.events.sort()
            at, version = self.events.pop(0)
            self.now = at
            self.compute.advance(at, version)

    now = 0.0


def test_a_prefill_alone_runs_at_the_prefill_rate_plus_a_decode_step_per_chunk() -> None:
    c = Clock()
    c.add("p", "prefill", 250)
    c.run()
    # 2.5 steps of 100 tokens, each 0.01 s of decode step and 0.1 s of prefill.
    assert c.done["p"] == pytest.approx(2.5 * (DECODE + STEP / RATE))
    assert c.compute.busy_seconds == pytest.approx(c.done["p"])
    assert c.compute.prefill_seconds == pytest.approx(0.25)


def test_a_decode_alone_takes_its_time_per_token() -> None:
    c = Clock()
    c.add("d", "decode", 40)
    c.run()
    assert c.done["d"] == pytest.approx(40 * DECODE)
    assert c.compute.prefill_seconds == 0.0


def test_a_long_prefill_slows_the_decode_beside_it() -> None:
    c = Clock()
    c.add("d", "decode", 40)
    c.add("p", "prefill", 990)  # ten steps of 99 tokens beside the decode's one
    c.run()
    step_with = DECODE + (STEP - 1) / RATE
    assert c.done["p"] == pytest.approx(10 * step_with)
    # Ten of the decode's 40 tokens came in those slow steps, the other 30 at its own pace.
    assert c.done["d"] == pytest.approx(10 * step_with + 30 * DECODE)


def test_prefills_take_the_budget_first_come_first_served() -> None:
    c = Clock()
    c.add("first", "prefill", 150)
    c.add("second", "prefill", 100)
    c.run()
    step = DECODE + STEP / RATE
    assert c.done["first"] == pytest.approx(1.5 * step)  # the whole budget, then half a step
    assert c.done["second"] == pytest.approx(2.5 * step)  # the rest of that step, then its own
    c2 = Clock()
    done: list[str] = []
    c2.compute.add("prefill", 0, lambda: done.append("at once"), 0.0)
    assert done == ["at once"]


def test_in_the_cluster_a_recompute_delays_the_request_running_beside_it() -> None:
    """B decodes while A, arriving later, recomputes a context that left HBM: under shared
    compute B finishes later than alone; under independent compute it does not notice."""

    def finish_of_b(compute: str) -> float:
        # Recompute (600 tokens at 2,000 a second: 0.3 s) beats loading (0.6 s from the pool).
        scen = scenario(prefill=2 * RATE, instances=1, hbm_blocks=8).model_copy(
            update={"compute": compute, "step_tokens": STEP}
        )
        warm = request(0, 0.0, context(0, 6), output=1)  # computes blocks 0-5: in the pool
        filler = request(1, 50.0, context(30, 7), output=1)  # evicts most of them from HBM
        b = request(2, 100.0, context(20, 1), output=200)
        a = request(3, 100.5, context(0, 6), output=1)
        cluster = CheckedCluster(scen, [warm, filler, b, a], Placed([0] * 4), Policy())
        cluster.run()
        assert a.recompute_tokens > 0
        return b.finished_at  # type: ignore[return-value]

    assert finish_of_b("shared") > finish_of_b("independent") + 0.1


@pytest.mark.parametrize("policy", ["none", "oracle", "heuristic"])
def test_the_models_invariants_hold_with_shared_compute_over_a_real_trace(policy: str) -> None:
    from tests.sim.test_cluster import TRACE_FILES, checked_replay

    summary = checked_replay(
        TRACE_FILES[0], 800, "tight-hbm", "least-loaded", policy, (("compute", "shared"),)
    )
    assert summary["requests"] == 800 and summary["compute"] == "shared"
    assert 0 < summary["prefill_gpu_share"] < 1 and 0 < summary["gpu_busy_share"] <= 1
