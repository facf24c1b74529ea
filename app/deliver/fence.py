"""The planning lease as the order sinks see it (decisions.md, 23): one fence for every sink
that sends outside, so a planning replica that paused past its lease sends nothing when it
wakes.

The engine gives each such sink a `Fence`: the lease's Redis key and this replica's value while
it holds it by its own clock (None once it lapsed). `check()` is called right before each send:

- the Redis stream sink passes key and value to its scripts too, which add nothing unless Redis
  still holds that value, in the same call (exact);
- the webhook sink checks before each POST, retries included; the lmcache sink before each call
  that changes LMCache (prefetch, pin, delete; not its polls, nor the release of its own pins).

A replica counts itself the holder only until its lease's start plus the lease less a drift
margin (app/decide/lease.py), so an HTTP send checked in time reaches the wire before another
replica can take over, unless the process stops between the check and its write: a window of
one call, which the stream sink alone closes (a receiver can close it with the order ids' term).
"""

from __future__ import annotations

from collections.abc import Callable

from app.deliver.base import SinkFenced


class Fence:
    def __init__(self, key: str, value: Callable[[], str | None]) -> None:
        self.key = key
        self._value = value

    def value(self) -> str | None:
        """The lease's value while this replica holds it; None when it does not."""
        return self._value()

    def check(self) -> str:
        """The value held, or SinkFenced: this replica must not send now."""
        value = self._value()
        if value is None:
            raise SinkFenced(
                "FENCED this replica does not hold the planning lease: nothing sent "
                "(another replica plans)"
            )
        return value
