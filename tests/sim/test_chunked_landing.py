"""Chunked landing (issue 27): a prefetch lands chunk by chunk, head first, each chunk usable as
its last byte crosses the link; `landing = "whole"` keeps the all-or-nothing rule, and its replay
numbers are the ones the model gave before chunks."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from kvprefetch_cli import cli
from sim.cluster import Cluster, SimRequest
from sim.links import Link, Transfer
from sim.policies import Policy
from sim.replay import replay
from sim.scenario import Scenario, load_scenario
from sim.signals import SignalSettings
from tests.conftest import trace_slice
from tests.sim.test_cluster import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    EXACT,
    POOL,
    TRACE_FILES,
    CheckedCluster,
    Placed,
    checked_replay,
    context,
    request,
    scenario,
    trace_prefix,
)
from tests.sim.test_signals import flat

# -- the scenario's fields ---------------------------------------------------------------------


def unit(landing: str = "chunked", chunk_tokens: int = BLOCK_TOKENS, **kw: Any) -> Scenario:
    """test_cluster's hand-made scenario (a block of 100 tokens loads in 0.1 s) with a landing
    rule; one block per chunk unless told."""
    return scenario(prefill=100.0, **kw).model_copy(
        update={"landing": landing, "chunk_tokens": chunk_tokens}
    )


def test_a_chunk_is_a_whole_number_of_blocks_at_least_one() -> None:
    assert unit(chunk_tokens=100).chunk_blocks == 1
    assert unit(chunk_tokens=256).chunk_blocks == 2  # 256 // 100
    assert unit(chunk_tokens=99).chunk_blocks == 1  # never less than a block
    assert unit(chunk_tokens=1000).chunk_blocks == 10


@pytest.mark.parametrize("name", ["default", "fast-link", "tight-hbm", "host-tier", "busy"])
def test_the_shipped_scenarios_land_in_256_token_chunks_of_one_512_token_block(name: str) -> None:
    scen = load_scenario(name)
    assert (scen.landing, scen.chunk_tokens, scen.block_tokens, scen.chunk_blocks) == (
        "chunked",
        256,
        512,
        1,
    )


@pytest.mark.parametrize(("field", "value"), [("chunk_tokens", 0), ("landing", "partial")])
def test_a_bad_landing_rule_or_chunk_size_is_refused(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        Scenario.model_validate({**load_scenario("default").model_dump(), field: value})


# -- the link: chunk boundaries are events, the sharing is unchanged ---------------------------


def chunked(tid: int, nbytes: int, chunk_bytes: int) -> Transfer:
    t = Transfer(tid, 0, [tid], nbytes, True, 0.0)
    t.chunk_bytes = chunk_bytes
    return t


def test_a_chunked_transfer_reports_each_chunk_boundary_then_its_last_byte() -> None:
    link = Link(1e9)
    t = chunked(1, int(3e9), int(1e9))
    link.add(t, 0.0)
    seen = []
    while (at := link.next_completion()) is not None:
        for c in link.chunks_due(at):
            seen.append((at, c.chunks_landed))
        seen += [(at, -1) for _ in link.complete_due(at)]
    assert seen == [
        (pytest.approx(1.0, abs=EXACT), 1),
        (pytest.approx(2.0, abs=EXACT), 2),
        (pytest.approx(3.0, abs=EXACT), -1),  # the last chunk lands with the last byte
    ]


def test_chunks_cross_at_the_shared_rate_and_leave_the_last_byte_where_it_was() -> None:
    """Two 2e9-byte transfers share the link: each 1e9-byte chunk takes 2 s, both end at 4 s as
    they do landing whole (test_links)."""
    link = Link(1e9)
    a, b = chunked(1, int(2e9), int(1e9)), Transfer(2, 0, [2], int(2e9), True, 0.0)
    link.add(a, 0.0)
    link.add(b, 0.0)
    assert link.next_completion() == pytest.approx(2.0, abs=EXACT)
    assert link.chunks_due(2.0) == [a] and a.chunks_landed == 1
    assert link.complete_due(2.0) == []
    assert link.next_completion() == pytest.approx(4.0, abs=EXACT)
    assert link.chunks_due(4.0) == []  # done, not a chunk more: complete_due lands it
    assert set(link.complete_due(4.0)) == {a, b}


def test_a_transfer_landing_whole_reports_only_its_last_byte() -> None:
    link = Link(1e9)
    link.add(Transfer(1, 0, [1], int(3e9), True, 0.0), 0.0)
    assert link.next_completion() == pytest.approx(3.0, abs=EXACT)
    assert link.chunks_due(2.5) == []


# -- the cluster: a prefetch of 8 blocks to instance 1 at t = 50, one block landing per 0.1 s ---

START = 50.0
PREFETCHED = context(0, 8)


class PrefetchAt(Policy):
    """Prefetches request 0's context to instance 1 at START (head first, as policies list it)
    and records what the cluster looks like at given times."""

    def __init__(self, blocks: Sequence[int] = PREFETCHED, look_at: Sequence[float] = ()) -> None:
        self.blocks = list(blocks)
        self.look_at = look_at
        self.looks: dict[float, dict[str, Any]] = {}

    def attach(self, cluster: Cluster) -> None:
        super().attach(cluster)
        cluster.call_at(START, self._fetch)
        for at in self.look_at:
            cluster.call_at(at, lambda at=at: self._look(at))  # type: ignore[misc]

    def _fetch(self) -> None:
        assert self.cluster.prefetch(1, self.blocks) == len(self.blocks)

    def _look(self, at: float) -> None:
        inst = self.cluster.instances[1]
        self.looks[at] = {
            "landing": sorted(inst.inflight),
            "pins": {b: inst.hbm.entries[b].pins for b in self.blocks},
            "hit_prefix": self.cluster.hit_prefix(inst, self.blocks),
            "bytes_prefetched": self.cluster.totals.bytes_prefetched,
        }


def case(
    landing: str,
    arrival: float | None,
    wanted: Sequence[int] = PREFETCHED,
    policy: PrefetchAt | None = None,
    chunk_tokens: int = BLOCK_TOKENS,
) -> tuple[CheckedCluster, SimRequest | None, list[tuple[float, list[int]]]]:
    """Request 0 writes PREFETCHED on instance 0; a request arriving at `arrival` on instance 1
    wants `wanted` plus a new block. Returns the cluster, that request, and instance 1's hbm
    kv_blocks_stored events (time, blocks) of the prefetched blocks."""
    stored: list[tuple[float, list[int]]] = []

    def emit(kind: str, ts: float, f: dict[str, Any]) -> None:
        if kind == "kv_blocks_stored" and f["tier"] == "hbm" and f["instance_id"] == "gpu-1":
            stored.append((ts, [b for b in f["block_hashes"] if b in PREFETCHED]))

    requests = [request(0, 0.0, PREFETCHED)]
    if arrival is not None:
        requests.append(request(1, arrival, [*wanted, 99]))
    # The run ends with its last request: one more, later, elsewhere, lets the prefetch finish.
    requests.append(request(len(requests), START + 10.0, [500]))
    cluster = CheckedCluster(
        unit(landing, chunk_tokens),
        requests,
        Placed([0, 1, 0] if arrival is not None else [0, 0]),
        policy or PrefetchAt(),
        emit=emit,
    )
    cluster.run()
    return cluster, requests[1] if arrival is not None else None, [s for s in stored if s[1]]


def test_chunks_land_head_first_as_their_bytes_cross() -> None:
    cluster, _, stored = case("chunked", None)
    assert stored == [(pytest.approx(START + 0.1 * (k + 1), abs=EXACT), [k]) for k in range(8)]
    assert cluster.totals.bytes_prefetched == 8 * BLOCK_BYTES
    assert cluster.instances[1].pool_link.bytes_moved == 8 * BLOCK_BYTES


def test_a_chunk_of_several_blocks_lands_them_together() -> None:
    _, _, stored = case("chunked", None, chunk_tokens=3 * BLOCK_TOKENS)
    # 3 blocks a chunk: 0-2 at 0.3 s, 3-5 at 0.6 s, the short last chunk (6, 7) with the last byte.
    assert stored == [
        (pytest.approx(START + 0.3, abs=EXACT), [0, 1, 2]),
        (pytest.approx(START + 0.6, abs=EXACT), [3, 4, 5]),
        (pytest.approx(START + 0.8, abs=EXACT), [6, 7]),
    ]


def test_the_head_lands_first_whatever_the_pool_held_first() -> None:
    # The policy lists the context head first: that is the order it lands in.
    _, _, stored = case("chunked", None, policy=PrefetchAt(blocks=[5, 6, 7, 0, 1]))
    assert [blocks for _, blocks in stored] == [[5], [6], [7], [0], [1]]


def test_whole_lands_everything_at_the_last_byte() -> None:
    cluster, _, stored = case("whole", None)
    assert stored == [(pytest.approx(START + 0.8, abs=EXACT), PREFETCHED)]
    assert cluster.totals.bytes_prefetched == 8 * BLOCK_BYTES


@pytest.mark.parametrize(("landing", "landed"), [("chunked", 3), ("whole", 0)])
def test_mid_transfer_the_landed_chunks_are_unpinned_usable_and_counted(
    landing: str, landed: int
) -> None:
    policy = PrefetchAt(look_at=[START + 0.35])
    case(landing, None, policy=policy)
    look = policy.looks[START + 0.35]
    assert look["landing"] == PREFETCHED[landed:]
    assert look["pins"] == {b: 0 if b < landed else 1 for b in PREFETCHED}
    assert look["hit_prefix"] == landed
    assert look["bytes_prefetched"] == landed * BLOCK_BYTES


def test_a_request_arriving_mid_transfer_hits_the_chunks_landed_so_far() -> None:
    # At START + 0.35 blocks 0-2 have landed; the request wants 0-5: chunked, it hits 3 and waits
    # for 3-5 (ready at + 0.6); whole, it hits none and waits for the last byte (+ 0.8).
    arrival, wanted = START + 0.35, context(0, 6)
    _, chunked_r, _ = case("chunked", arrival, wanted)
    _, whole_r, _ = case("whole", arrival, wanted)
    assert chunked_r is not None and whole_r is not None
    assert (chunked_r.reused_blocks, chunked_r.hit_blocks, chunked_r.hit_prefix) == (6, 3, 3)
    assert (whole_r.reused_blocks, whole_r.hit_blocks, whole_r.hit_prefix) == (6, 0, 0)
    assert chunked_r.stall_seconds == pytest.approx(0.25, abs=EXACT)
    assert whole_r.stall_seconds == pytest.approx(0.45, abs=EXACT)
    # Neither loads what is on its way.
    assert chunked_r.loaded_bytes == whole_r.loaded_bytes == 0
    assert chunked_r.recompute_tokens == whole_r.recompute_tokens == 0


def test_a_request_needing_the_whole_prefetch_still_waits_for_its_last_byte() -> None:
    _, r, _ = case("chunked", START + 0.35)
    assert r is not None and r.hit_blocks == 3
    assert r.ready_at == pytest.approx(START + 0.8, abs=EXACT)


def test_a_request_needing_only_the_landed_head_is_ready_before_the_transfer_ends() -> None:
    # It wants blocks 0-1 while 0 is landing: ready when 1 has landed (+ 0.2), not at + 0.8.
    arrival = START + 0.05
    _, chunked_r, _ = case("chunked", arrival, context(0, 2))
    _, whole_r, _ = case("whole", arrival, context(0, 2))
    assert chunked_r is not None and whole_r is not None
    assert chunked_r.ready_at == pytest.approx(START + 0.2, abs=EXACT)
    assert whole_r.ready_at == pytest.approx(START + 0.8, abs=EXACT)
    # Arriving after its head has landed, it does not wait at all.
    _, r, _ = case("chunked", START + 0.25, context(0, 2))
    assert r is not None and r.hit_blocks == 2 and r.stall_seconds == 0.0


def test_a_landed_chunk_used_mid_transfer_is_not_counted_unused() -> None:
    cluster, r, _ = case("chunked", START + 0.35, context(0, 3))
    assert r is not None and r.hit_blocks == 3
    # Blocks 3-7 were never used by a request: only they are unused at the end.
    assert cluster.totals.bytes_prefetched_unused == 5 * BLOCK_BYTES


def test_a_demand_load_lands_whole_under_chunked_landing() -> None:
    """A demand load is for the request that ordered it, which needs all of it: it lands at its
    last byte, and a request wanting its head meanwhile waits for that too."""
    a = request(0, 0.0, context(0, 4))
    b = request(1, 50.0, [*context(0, 4), 98])  # loads 4 blocks on instance 1: 0.4 s
    c = request(2, 50.15, [*context(0, 2), 99])  # wants the head, 1.5 blocks in
    stored: list[tuple[float, list[int]]] = []
    cluster = CheckedCluster(
        unit("chunked"),
        [a, b, c],
        Placed([0, 1, 1]),
        Policy(),
        emit=lambda kind, ts, f: (
            stored.append((ts, f["block_hashes"]))
            if kind == "kv_blocks_stored" and f["tier"] == "hbm" and f["instance_id"] == "gpu-1"
            else None
        ),
    )
    cluster.run()
    assert b.loaded_bytes == 4 * BLOCK_BYTES and b.stall_seconds == pytest.approx(0.4, abs=EXACT)
    assert c.hit_blocks == 0 and c.ready_at == pytest.approx(50.4, abs=EXACT)
    assert (pytest.approx(50.4, abs=EXACT), context(0, 4)) in stored
    assert cluster.instances[1].pool_link.bytes_moved == 4 * BLOCK_BYTES == 4 * POOL / 10


# -- real traces: invariants under both rules, and "whole" as the model was -------------------

SIGNALS = (("coverage", 1.0), ("lead_median_seconds", 5.0), ("false_alarms", 0.0))


# 1024-token chunks: two of the shipped scenarios' 512-token blocks a chunk.
@pytest.mark.parametrize(
    ("landing", "chunk_tokens"), [("chunked", 256), ("chunked", 1024), ("whole", 256)]
)
@pytest.mark.parametrize("policy", ["oracle", "signal"])
@pytest.mark.parametrize("trace", TRACE_FILES)
def test_invariants_hold_over_real_traces_under_both_rules(
    trace: str, policy: str, landing: str, chunk_tokens: int
) -> None:
    overrides = (("landing", landing), ("chunk_tokens", chunk_tokens), ("signals", SIGNALS))
    summary = checked_replay(trace, 1000, "tight-hbm", "sticky", policy, overrides)
    assert summary["requests"] == 1000
    assert summary["bytes_prefetched"] > 0 and summary["_evicted"] > 0


# Summaries of the first 1500 requests of each shared trace on `tight-hbm` with signals
# (coverage 0.5, lead 5 s, one false alarm per true signal), computed by the model before chunked
# landing (main at e9a9d60): "whole" must give them exactly.
BEFORE_CHUNKS: dict[str, dict[str, float | int]] = {
    "mooncake_conversation_first60.jsonl/signal": {
        "hit_rate": 0.8678,
        "byte_hit_rate": 0.5471,
        "byte_hit_rate_unshared": 0.4758,
        "stall_seconds_total": 71.242,
        "stall_seconds_p99": 1.0469,
        "bytes_loaded_on_demand": 706_656_337_920,
        "bytes_prefetched": 1_211_482_767_360,
        "bytes_prefetched_unused": 670_753_095_680,
        "recompute_tokens": 145_920,
        "simulated_seconds": 565.728,
        "signals_emitted": 332,
    },
    "mooncake_conversation_first60.jsonl/oracle": {
        "hit_rate": 0.9966,
        "byte_hit_rate": 0.9751,
        "byte_hit_rate_unshared": 0.9712,
        "stall_seconds_total": 1.515,
        "stall_seconds_p99": 0.0,
        "bytes_loaded_on_demand": 0,
        "bytes_prefetched": 268_099_911_680,
        "bytes_prefetched_unused": 0,
        "recompute_tokens": 0,
        "simulated_seconds": 564.654,
        "signals_emitted": 332,
    },
    "mooncake_synthetic.jsonl/signal": {
        "hit_rate": 0.5615,
        "byte_hit_rate": 0.5219,
        "byte_hit_rate_unshared": 0.5219,
        "stall_seconds_total": 54.131,
        "stall_seconds_p99": 1.4764,
        "bytes_loaded_on_demand": 613_710_561_280,
        "bytes_prefetched": 706_991_882_240,
        "bytes_prefetched_unused": 220_620_390_400,
        "recompute_tokens": 68_608,
        "simulated_seconds": 421.552,
        "signals_emitted": 175,
    },
    "mooncake_synthetic.jsonl/oracle": {
        "hit_rate": 0.9893,
        "byte_hit_rate": 0.9862,
        "byte_hit_rate_unshared": 0.9862,
        "stall_seconds_total": 0.19,
        "stall_seconds_p99": 0.0,
        "bytes_loaded_on_demand": 0,
        "bytes_prefetched": 189_918_085_120,
        "bytes_prefetched_unused": 0,
        "recompute_tokens": 0,
        "simulated_seconds": 421.552,
        "signals_emitted": 175,
    },
}


def before_chunks_replay(trace: str, policy: str, landing: str) -> dict[str, Any]:
    scen = load_scenario("tight-hbm").model_copy(
        update={
            "landing": landing,
            "signals": SignalSettings(coverage=0.5, lead_median_seconds=5.0, false_alarms=1.0),
        }
    )
    return replay(trace_prefix(trace, 1500), scen, policy=policy).summary


@pytest.mark.parametrize("key", sorted(BEFORE_CHUNKS))
def test_whole_landing_gives_the_numbers_of_the_model_before_chunks(key: str) -> None:
    trace, policy = key.split("/")
    summary = before_chunks_replay(trace, policy, "whole")
    expected = BEFORE_CHUNKS[key]
    assert {k: summary[k] for k in expected} == expected
    # And chunked landing changes them: the comparison means something.
    chunked_summary = before_chunks_replay(trace, policy, "chunked")
    assert chunked_summary["byte_hit_rate"] != expected["byte_hit_rate"]


# -- the replay command ------------------------------------------------------------------------


def invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, ["replay", *args])


def test_the_landing_options_pick_the_rule(tmp_path: Path) -> None:
    trace = trace_slice(tmp_path, "conversation_first60", 1500)
    common = ["--trace", str(trace), "--scenario", "tight-hbm", "--policy", "oracle", "--json"]
    runs = {}
    for name, extra in {
        "default": [],
        "chunked": ["--landing", "chunked"],
        "whole": ["--landing", "whole"],
        "big chunks": ["--chunk-tokens", "4096"],
    }.items():
        result = invoke(*common, *extra)
        assert result.exit_code == 0, result.output
        runs[name] = json.loads(result.stdout)
        runs[name].pop("wall_seconds")
    scen = load_scenario("tight-hbm")
    updates: dict[str, dict[str, Any]] = {
        "whole": {"landing": "whole"},
        "big chunks": {"chunk_tokens": 4096},
    }
    for name, update in updates.items():
        expected = replay(
            trace_prefix(TRACE_FILES[0], 1500), scen.model_copy(update=update), policy="oracle"
        ).summary
        expected.pop("wall_seconds")
        expected["trace"] = trace.name
        assert runs[name] == expected, name
    assert runs["default"] == runs["chunked"]  # the shipped scenarios land in chunks
    assert runs["whole"]["byte_hit_rate"] < runs["chunked"]["byte_hit_rate"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--landing", "partial"], "'partial': chunked or whole"),
        (["--chunk-tokens", "0"], "'--chunk-tokens': Input should be greater than or equal to 1"),
    ],
)
def test_a_bad_landing_option_is_refused(tmp_path: Path, args: list[str], message: str) -> None:
    result = invoke("--trace", str(trace_slice(tmp_path, "synthetic", 10)), *args, "--json")
    assert result.exit_code == 2 and result.stdout == ""
    assert flat(message) in flat(result.stderr), result.stderr
