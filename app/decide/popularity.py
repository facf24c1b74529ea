"""Prefix popularity: which blocks other sessions are using too, so advice about one session
never pushes out what many share.

LRU keeps a system prompt or a tool schema resident for free: every session that carries it
touches it. Advice made per session does not see that; demoting a quiet session's context would
demote the shared head it carries too, and every other session on that instance would miss it
(on an agent-like workload this alone made the advice lose to plain LRU: docs/decisions.md, 21).
So a block is *shared* while sessions other than the last one to use it have routed a request
carrying it within `window_seconds`, and retention leaves a context's shared head alone.

Only the first `prefix_blocks` of each request are looked at: what many sessions share is a
prefix (block hashes are prefix-chained, so two contexts share blocks only from their start),
and it bounds the cost per event. Memory is bounded by `max_blocks` (least recently used go).
By event time, as the store's rules are.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvprefetch_client.events import BlockHash


class PrefixPopularity:
    def __init__(
        self,
        *,
        window_seconds: float = 600.0,
        prefix_blocks: int = 64,
        max_blocks: int = 200_000,
    ) -> None:
        if window_seconds <= 0 or prefix_blocks <= 0 or max_blocks <= 0:
            raise ValueError("window_seconds, prefix_blocks and max_blocks must be positive")
        self.window_seconds = window_seconds
        self.prefix_blocks = prefix_blocks
        self.max_blocks = max_blocks
        # block -> [the last session that used it, when, shared until when]; oldest touch first.
        # Lists changed in place and moved: the common case (a session's own blocks again) is a
        # lookup, two comparisons and a move, no new entry (this runs per block of every routed
        # request, on the ingest path).
        self._blocks: OrderedDict[BlockHash, list[Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def routed(self, session_id: str, block_hashes: Sequence[BlockHash], ts: float) -> None:
        """A request of `session_id` carrying `block_hashes` was routed at `ts`."""
        blocks = self._blocks
        get, move_to_end = blocks.get, blocks.move_to_end
        window = self.window_seconds
        for b in block_hashes[: self.prefix_blocks]:
            entry = get(b)
            if entry is None:
                blocks[b] = [session_id, ts, -1.0]
                continue
            if entry[0] != session_id:
                if ts - entry[1] <= window and ts + window > entry[2]:
                    entry[2] = ts + window
                entry[0] = session_id
            if ts > entry[1]:
                entry[1] = ts
            move_to_end(b)
        over = len(blocks) - self.max_blocks
        if over > 0:
            popitem = blocks.popitem
            for _ in range(over):
                popitem(False)

    def shared_prefix(self, block_hashes: Sequence[BlockHash], now: float) -> int:
        """How many leading blocks of a context are shared at `now`."""
        blocks = self._blocks
        n = 0
        for b in block_hashes[: self.prefix_blocks]:
            entry = blocks.get(b)
            if entry is None or entry[2] < now:
                break
            n += 1
        return n
