"""A link that transfers bytes: processor sharing, so concurrent transfers slow each other down.

Each active transfer gets bandwidth / n; a transfer's time to last byte is its queueing behind the
others plus bytes / bandwidth. That is how several RDMA flows into one NIC behave (REFERENCE.md:
"A multi-GB fetch is bound by throughput").
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

    def __post_init__(self) -> None:
        self.remaining = float(self.nbytes)


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
        """When the first active transfer will finish, if nothing else joins."""
        if not self.active:
            return None
        smallest = min(t.remaining for t in self.active.values())
        return self._last + max(smallest, 0.0) * len(self.active) / self.bytes_per_second

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
