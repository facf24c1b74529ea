"""One contract, every tier found (tests/implementations.py: every class under app/ or client/
that declares `Tier`): BufferTier over a pool directory, and MooncakeTier over a real
`mooncake_master` and a pool holder on loopback TCP (tests/client/agent/test_mooncake.py's
fixtures; slow, and it needs the `mooncake` extra: .ci/ensure-mooncake). A new tier needs a
factory in FACTORIES below (test_every_tier_has_a_factory says so).

What the protocol promises (client/kvprefetch_client/agent/tier.py), and the agent's runner
relies on: a prefetch lands the order's blocks from the pool and says which (`landed`, reported as
residency), moves nothing twice, and fails naming a block the pool lacks without landing any; a
pin needs its blocks in the tier; a demote never fails for a block the tier lacks, and leaves the
pool's copy, so a later prefetch brings the block back; `withdraw` undoes a pin or a demote where
the tier can, and the tier goes on serving; `status()` goes into the agent's JSON status file,
beside the agent's own fields, and lists the blocks landed (`buffer_blocks`, `buffer_bytes`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from kvprefetch_client.agent.buffer import HbmBuffer, PoolDir
from kvprefetch_client.agent.mooncake import MooncakeTier, store_key
from kvprefetch_client.agent.runner import AgentStats
from kvprefetch_client.agent.tier import BufferTier, Tier
from kvprefetch_client.events import BlockHash
from tests.client.agent.fakes import T0, order
from tests.client.agent.test_mooncake import (  # noqa: F401  (fixtures)
    NS,
    holder,
    master,
    settings,
)
from tests.implementations import factory_of, here, missing_factories, params

INSTANCE = "gpu-0"
# Blocks as agents see them: ints and strings (46 and "46" are different blocks).
A, B, C = 46, "46", "sess/a"
MISSING = "missing-7f3e"


@dataclass
class TierCase:
    """A tier for INSTANCE over an empty pool; `put(blocks)` puts blocks of `block_bytes` each in
    the pool."""

    tier: Tier
    put: Callable[[Sequence[BlockHash]], None]
    block_bytes: int


def _buffer_case(request: pytest.FixtureRequest) -> TierCase:
    tmp_path: Path = request.getfixturevalue("tmp_path")
    block_bytes = 1000
    pool = PoolDir(tmp_path / "pool")

    def put(blocks: Sequence[BlockHash]) -> None:
        for h in blocks:
            pool.write(h, bytes([len(str(h)) % 256]) * block_bytes)

    tier = BufferTier(INSTANCE, pool, HbmBuffer(100 * block_bytes), time.perf_counter)
    return TierCase(tier, put, block_bytes)


def _mooncake_case(request: pytest.FixtureRequest) -> TierCase:
    running = request.getfixturevalue("master")
    pool_holder = request.getfixturevalue("holder")
    block_bytes = 1 << 20

    def put(blocks: Sequence[BlockHash]) -> None:
        for h in blocks:
            assert pool_holder.put(store_key(NS, h), block_bytes) == 0

    return TierCase(MooncakeTier(INSTANCE, settings(running)), put, block_bytes)


@dataclass(frozen=True)
class Factory:
    case: Callable[[pytest.FixtureRequest], TierCase]
    marks: tuple[pytest.MarkDecorator, ...] = ()


# One per implementation found (test_every_tier_has_a_factory checks).
FACTORIES: dict[type, Factory] = {
    BufferTier: Factory(_buffer_case),
    MooncakeTier: Factory(_mooncake_case, marks=(pytest.mark.slow,)),
}


def test_every_tier_has_a_factory() -> None:
    missing = missing_factories(Tier, FACTORIES, here(__file__))
    assert not missing, "\n".join(missing)


@pytest.fixture(params=params(Tier, {cls: f.marks for cls, f in FACTORIES.items()}))
def case(request: pytest.FixtureRequest) -> Iterator[TierCase]:
    c = factory_of(Tier, FACTORIES, request.param, request).case(request)
    yield c
    c.tier.close()


def held(tier: Tier) -> list[BlockHash]:
    return list(tier.status()["buffer_blocks"])


def test_a_tier_names_where_it_is(case: TierCase) -> None:
    assert isinstance(case.tier.where, str) and INSTANCE in case.tier.where


def test_a_prefetch_lands_the_blocks_from_the_pool_and_moves_nothing_twice(case: TierCase) -> None:
    tier = case.tier
    assert held(tier) == []
    case.put([A, B, C])
    done = tier.prefetch(order("o1", [A, B, C]), T0)
    assert done.failure is None, done.failure
    assert (done.landed, done.removed) == ([A, B, C], [])
    assert done.bytes == 3 * case.block_bytes and done.seconds >= 0
    status = tier.status()
    assert sorted(map(repr, status["buffer_blocks"])) == sorted(map(repr, [A, B, C]))
    assert status["buffer_bytes"] == 3 * case.block_bytes
    again = tier.prefetch(order("o2", [B, A]), T0 + 1)
    assert (again.failure, again.landed, again.bytes) == (None, [], 0)


def test_a_block_missing_from_the_pool_fails_the_prefetch_by_name_and_lands_nothing(
    case: TierCase,
) -> None:
    case.put([A])
    done = case.tier.prefetch(order("o1", [A, MISSING]), T0)
    assert done.failure is not None and repr(MISSING) in done.failure
    assert done.landed == [] and held(case.tier) == []


def test_a_pin_needs_its_blocks_in_the_tier_and_a_withdrawn_one_leaves_it_serving(
    case: TierCase,
) -> None:
    tier = case.tier
    case.put([B, C])
    refused = tier.pin(order("p0", [B], kind="pin", ttl_seconds=30.0), T0)
    assert refused.failure is not None and repr(B) in refused.failure
    assert tier.prefetch(order("o1", [B]), T0).failure is None
    pin = order("p1", [B], kind="pin", ttl_seconds=30.0)
    assert tier.pin(pin, T0 + 1).failure is None
    assert tier.withdraw(pin, T0 + 2) is None
    done = tier.prefetch(order("o2", [C]), T0 + 3)
    assert (done.failure, done.landed) == (None, [C])


def test_a_demote_keeps_the_pools_copy_and_never_fails_for_a_block_not_there(
    case: TierCase,
) -> None:
    tier = case.tier
    case.put([A, B])
    assert tier.prefetch(order("o1", [A, B]), T0).landed == [A, B]
    demote = order("d1", [A], kind="demote")
    done = tier.demote(demote, T0 + 1)
    assert done.failure is None and set(map(repr, done.removed)) <= {repr(A)}
    nothing = tier.demote(order("d2", [MISSING], kind="demote"), T0 + 2)
    assert (nothing.failure, nothing.removed, nothing.landed) == (None, [], [])
    back = tier.prefetch(order("o2", [A]), T0 + 3)  # from the pool, or still there
    assert back.failure is None and repr(A) in map(repr, held(tier))
    assert tier.withdraw(demote, T0 + 4) is None


def test_status_goes_into_the_agents_json_beside_its_own_fields(case: TierCase) -> None:
    case.put([A, C])
    case.tier.prefetch(order("o1", [A, C]), T0)
    status = case.tier.status()
    written = orjson.loads(orjson.dumps(status))  # as runner.write_status_file writes it
    assert written.keys() == status.keys() and written["buffer_blocks"] == [A, C]
    agents_own = {"instance_id", "pending_orders"} | {
        f.name for f in dataclasses.fields(AgentStats)
    }
    assert not set(status) & agents_own
