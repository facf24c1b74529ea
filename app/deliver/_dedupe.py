"""The in-process half of "once per order id": ids seen within a window, bounded in number."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

# Past this many ids the oldest are forgotten early (a resend of one of those is delivered
# again, which consumers tolerate): bounds memory at about 100 bytes an id.
MAX_REMEMBERED_IDS = 500_000


class RecentIds:
    """Ids added in the last `window_seconds`; one window for all ids, so insertion order is
    expiry order and pruning only ever looks at the front."""

    def __init__(
        self,
        window_seconds: float,
        *,
        max_ids: int = MAX_REMEMBERED_IDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_seconds = window_seconds
        self.max_ids = max_ids
        self._clock = clock
        # Not a dict: finding a dict's first item after many deletions at its front scans every
        # deleted slot until the next resize; an OrderedDict's front is a linked list's head.
        self._expiry: OrderedDict[str, float] = OrderedDict()

    def add(self, key: str) -> bool:
        """Remember `key`; False when it was already remembered (a repeat)."""
        now = self._clock()
        self._prune(now)
        if key in self._expiry:
            return False
        self._expiry[key] = now + self.window_seconds
        return True

    def discard(self, key: str) -> None:
        """Forget `key`: its delivery failed, so a resubmission must go through."""
        self._expiry.pop(key, None)

    def __contains__(self, key: object) -> bool:
        expiry = self._expiry.get(key)  # type: ignore[call-overload]
        return expiry is not None and expiry > self._clock()

    def __len__(self) -> int:
        return len(self._expiry)

    def _prune(self, now: float) -> None:
        expiry = self._expiry
        while expiry:
            first = next(iter(expiry))
            if expiry[first] > now and len(expiry) < self.max_ids:
                break
            expiry.popitem(last=False)
