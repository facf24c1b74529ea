"""A link that transfers bytes: processor sharing, so concurrent transfers slow each other down.

Each active transfer gets bandwidth / n; a transfer's time to last byte is its queueing behind the
others plus bytes / bandwidth. That is how several RDMA flows into one NIC behave (REFERENCE.md:
"A multi-GB fetch is bound by throughput").

A transfer may land in chunks (`chunk_bytes`): its bytes cross in order, and each chunk counts as
landed as soon as its last byte has crossed, so the link's next event is the first chunk
boundary (or last byte) any active transfer reaches. Chunks change no rate: the sharing is
still by active transfers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Float rounding over many rate changes leaves a few bytes: a microsecond's worth counts as landed.
_LANDED_SECONDS = 1e-6


@dataclass(slots=True, eq=False)
class Transfer:
    transfer_id: int
    instance: int
    blocks: list[int]
    nbytes: int
    prefetch: bool
    started_at: float
    remaining: float = 0.0
    done_at: float | None = None
    # Requests waiting for this transfer to land.
    waiters: list[object] = field(default_factory=list)
    # Blocks of a prefetch that a request claimed while they were still landing.
    claimed: set[int] = field(default_factory=set)
    # Bytes per chunk when it lands chunk by chunk; 0: it lands whole, at its last byte.
    chunk_bytes: int = 0
    # Chunks whose last byte has crossed (Link.chunks_due counts them).
    chunks_landed: int = 0
    # How many of `blocks`, a prefix, have landed already (the cluster keeps it).
    landed_blocks: int = 0
    # Each block's place in `blocks`, for a transfer landing in chunks (who waits for which).
    positions: dict[int, int] | None = None

    def __post_init__(self) -> None:
        self.remaining = float(self.nbytes)

    def next_mark(self) -> float:
        """`remaining` at the next chunk boundary: 0 for the last chunk, or a whole transfer."""
        if not self.chunk_bytes:
            return 0.0
        return float(max(self.nbytes - (self.chunks_landed + 1) * self.chunk_bytes, 0))


class Link:
    def __init__(self, bytes_per_second: float) -> None:
        self.bytes_per_second = bytes_per_second
        self.active: dict[int, Transfer] = {}
        self.version = 0
        self._last = 0.0
        self.bytes_moved = 0.0
        self.busy_seconds = 0.0

    def _advance(self, now: float) -> None:
        dt = now - self._last
        if dt > 0 and self.active:
            share = self.bytes_per_second / len(self.active) * dt
            for t in self.active.values():
                t.remaining -= share
            self.busy_seconds += dt
        self._last = max(self._last, now)

    def add(self, transfer: Transfer, now: float) -> None:
        self._advance(now)
        self.active[transfer.transfer_id] = transfer
        self.version += 1

    def next_completion(self) -> float | None:
        """When the first active transfer will finish, or land its next chunk, if nothing else
        joins."""
        if not self.active:
            return None
        smallest = min(t.remaining - t.next_mark() for t in self.active.values())
        return self._last + max(smallest, 0.0) * len(self.active) / self.bytes_per_second

    def chunks_due(self, now: float) -> list[Transfer]:
        """Transfers landing in chunks that have had one more chunk (or several) cross by `now`,
        short of their last byte (complete_due finishes those); each one's `chunks_landed`
        counts every chunk crossed so far."""
        self._advance(now)
        landed = self.bytes_per_second * _LANDED_SECONDS
        moved = []
        for t in self.active.values():
            if t.chunk_bytes and t.remaining > landed:
                crossed = int((t.nbytes - t.remaining + landed) // t.chunk_bytes)
                if crossed > t.chunks_landed:
                    t.chunks_landed = crossed
                    moved.append(t)
        return moved

    def complete_due(self, now: float) -> list[Transfer]:
        """Finish every transfer whose last byte has landed by `now`."""
        self._advance(now)
        landed = self.bytes_per_second * _LANDED_SECONDS
        done = [t for t in self.active.values() if t.remaining <= landed]
        for t in done:
            del self.active[t.transfer_id]
            t.done_at = now
            self.bytes_moved += t.nbytes
        if done:
            self.version += 1
        return done

    def estimate_seconds(self, nbytes: float, now: float) -> float:
        """Time to last byte for a transfer of `nbytes` started now, if nothing else joins.

        Under processor sharing it waits for min(remaining, nbytes) of every active transfer.
        """
        self._advance(now)
        ahead = sum(min(max(t.remaining, 0.0), nbytes) for t in self.active.values())
        return (ahead + nbytes) / self.bytes_per_second
