"""The seam between the agent's loop and the tier it fills: what an order becomes in bytes.

The runner decides when an order runs, reports its progress and acks it; a `Tier` does the
prefetch, pin or demote and says what happened (`Done`). Two tiers exist: `BufferTier` (a pool
directory read into an in-memory buffer, the reference agent's own) and
`kvprefetch_client.agent.mooncake.MooncakeTier` (replicas in a Mooncake Store segment).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvprefetch_client.agent.buffer import BufferFull, HbmBuffer, PoolDir
from kvprefetch_client.events import BlockHash
from kvprefetch_client.orders import Order

# A block list in a failure reason names at most this many blocks.
_NAMED_BLOCKS = 3


def name_blocks(blocks: Sequence[BlockHash]) -> str:
    named = ", ".join(repr(h) for h in blocks[:_NAMED_BLOCKS])
    more = len(blocks) - _NAMED_BLOCKS
    return named + (f" and {more} more" if more > 0 else "")


@dataclass(frozen=True, slots=True)
class Done:
    """What a tier did for one order. `failure` set means the order failed (with that reason);
    `landed` and `removed` are reported as residency either way, since they happened."""

    bytes: int = 0
    seconds: float = 0.0  # a prefetch's time to last byte; the operation's time otherwise
    failure: str | None = None
    landed: list[BlockHash] = field(default_factory=list)
    removed: list[BlockHash] = field(default_factory=list)


class Tier(Protocol):
    """An instance's tier, filled by orders. Calls come from the agent's loop only, one at a
    time; `now` is the loop's clock (pins end at `now + ttl`). An implementation declares it
    (`class MyTier(Tier)`): tests/client/test_tier_contract.py then checks it."""

    where: str  # "hbm@gpu-0", named in failure reasons

    def prefetch(self, order: Order, now: float) -> Done: ...

    def pin(self, order: Order, now: float) -> Done: ...

    def demote(self, order: Order, now: float) -> Done: ...

    def withdraw(self, order: Order, now: float) -> None:
        """A Cancel of a pin or demote this tier completed: undo it where the tier can (a pin
        released, a demote's blocks back in LRU order)."""
        ...

    def status(self) -> dict[str, Any]:
        """Merged into the agent's status (its JSON status file), beside the agent's own fields:
        `buffer_blocks` and `buffer_bytes` say what it landed and holds."""
        ...

    def close(self) -> None: ...


class BufferTier(Tier):
    """The reference tier: blocks read from a PoolDir into an HbmBuffer."""

    def __init__(
        self,
        instance_id: str,
        pool: PoolDir,
        buffer: HbmBuffer,
        timer: Callable[[], float],
    ) -> None:
        self.where = f"hbm@{instance_id}"
        self.pool = pool
        self.buffer = buffer
        self._timer = timer

    def prefetch(self, order: Order, now: float) -> Done:
        wanted = list(dict.fromkeys(order.block_hashes))
        to_move = self.buffer.missing(wanted)
        absent = [h for h in to_move if not self.pool.has(h)]
        if absent:
            return Done(
                failure=f"block {name_blocks(absent)} not in the pool ({self.pool.directory})"
            )
        protect = set(wanted)
        landed: list[BlockHash] = []
        evicted: list[BlockHash] = []
        moved = 0
        failure = None
        # Time to last byte: from the first byte read to the last byte written.
        t0 = self._timer()
        for h in to_move:
            try:
                data = self.pool.read(h)
                evicted += self.buffer.put(h, data, now, protect)
            except FileNotFoundError:
                failure = f"block {h!r} left the pool ({self.pool.directory}) during the transfer"
                break
            except BufferFull as exc:
                failure = f"no room in {self.where}: {exc}"
                break
            landed.append(h)
            moved += len(data)
        seconds = self._timer() - t0
        for h in wanted:
            if h not in landed:
                self.buffer.get(h)  # already there: prefetching it counts as a use
        if failure is None and order.ttl_seconds is not None:
            self.buffer.pin(wanted, now + order.ttl_seconds)  # held for the return it was for
        return Done(moved, seconds, failure, landed, evicted)

    def pin(self, order: Order, now: float) -> Done:
        missing = self.buffer.missing(order.block_hashes)
        if missing:
            return Done(failure=f"cannot pin: block {name_blocks(missing)} not in {self.where}")
        t0 = self._timer()
        assert order.ttl_seconds is not None  # the Order model requires it for a pin
        pinned = self.buffer.pin(order.block_hashes, now + order.ttl_seconds)
        return Done(pinned, self._timer() - t0)

    def demote(self, order: Order, now: float) -> Done:
        t0 = self._timer()
        demoted = self.buffer.demote(order.block_hashes)  # absent blocks are gone already
        return Done(demoted, self._timer() - t0)

    def withdraw(self, order: Order, now: float) -> None:
        if order.kind == "pin":
            self.buffer.unpin(order.block_hashes)
        elif order.kind == "demote":
            self.buffer.undemote(order.block_hashes)

    def status(self) -> dict[str, Any]:
        return {
            "buffer_blocks": self.buffer.hashes(),
            "buffer_bytes": self.buffer.used_bytes,
            "capacity_bytes": self.buffer.capacity_bytes,
        }

    def close(self) -> None:
        pass
