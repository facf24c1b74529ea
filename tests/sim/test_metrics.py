"""sim.metrics: the byte hit rate without the blocks most requests carry, on hand-built requests
and in a replay's summary."""

from __future__ import annotations

import pytest

from sim.cluster import SimRequest
from sim.metrics import SHARED_BLOCK_SHARE, byte_hit_rate_unshared, shared_blocks
from sim.replay import replay
from sim.scenario import load_scenario
from tests.sim.test_cluster import TRACE_FILES, trace_prefix


def req(i: int, blocks: tuple[int, ...], reused: int = 0, hit: int = 0) -> SimRequest:
    return SimRequest(
        index=i,
        session_id=f"s{i}",
        arrival=float(i),
        input_tokens=len(blocks),
        output_tokens=1,
        hash_ids=blocks,
        reused_prefix=reused,
        hit_prefix=hit,
        reused_blocks=len(set(blocks[:reused])),
        hit_blocks=len(set(blocks[:hit])),
    )


def test_shared_blocks_are_those_carried_by_more_than_the_share_of_requests() -> None:
    # Block 0 in all 20 requests, block 1 in 3 (15%), block 2 in exactly 2 (10%: not more).
    requests = [req(i, (0, 100 + i)) for i in range(20)]
    for i in range(3):
        requests[i].hash_ids = (0, 1, 100 + i)
    for i in range(3, 5):
        requests[i].hash_ids = (0, 2, 100 + i)
    assert SHARED_BLOCK_SHARE == 0.1
    assert shared_blocks(requests) == {0, 1}
    assert shared_blocks(requests, share=0.5) == {0}
    assert shared_blocks([]) == frozenset()


def test_the_unshared_rate_leaves_out_the_ubiquitous_block() -> None:
    # Both requests reuse (0, x, y); only block 0, carried by every request, was a hit.
    requests = [req(0, (0, 1, 2, 3), reused=3, hit=1), req(1, (0, 1, 2, 4), reused=3, hit=1)]
    assert sum(r.hit_blocks for r in requests) / sum(r.reused_blocks for r in requests) == 1 / 3
    assert byte_hit_rate_unshared(requests, {0}) == 0.0
    # Hits past the shared block count; a block repeated in a prefix counts once.
    requests = [req(0, (0, 1, 1, 2), reused=4, hit=3), req(1, (0, 5, 6), reused=3, hit=0)]
    assert byte_hit_rate_unshared(requests, {0}) == pytest.approx(round(1 / 4, 4))
    assert byte_hit_rate_unshared(requests, frozenset()) == pytest.approx(round(2 / 6, 4))
    assert byte_hit_rate_unshared([], {0}) == 0.0


def test_a_replay_of_the_conversation_trace_reports_both_rates() -> None:
    # Its block 0 is in every request and always resident: the unshared rate is lower.
    s = replay(trace_prefix(TRACE_FILES[0], 1000), load_scenario("default")).summary
    assert s["shared_blocks"] == 1
    assert 0.0 <= s["byte_hit_rate_unshared"] < s["byte_hit_rate"] <= 1.0
    s = replay(trace_prefix(TRACE_FILES[1], 1000), load_scenario("default")).summary
    assert s["shared_blocks"] == 0 and s["byte_hit_rate_unshared"] == s["byte_hit_rate"]
