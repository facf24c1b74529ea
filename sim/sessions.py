"""Sessions for traces that have none, derived from the prefix-chained block ids.

The rule: a request's parent is the most recent earlier request that holds the deepest block
this request shares with any earlier request, ignoring *hot* blocks (those that a large share of
all requests carry: system prompts). The request joins its parent's session; a request with no
parent starts a new session.

Why not "the earlier request whose whole block list is my prefix": a prompt's last block is
almost always partial, so its id never recurs, and an exact-prefix rule finds almost no parents.
On the shared conversation trace 82% of derived parents lack exactly that one last block.
Hot blocks must be ignored or every request that starts with the system prompt would join
one giant session. Edits and branches (a user rewriting an earlier message) share a shorter
prefix and stay in the session, as they do in the chat application.

The hot-block test uses the whole trace's block frequencies: deriving sessions is labelling
the trace (the router's session ids), not prediction, so it may look ahead.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from sim.traces import TraceRequest

DEFAULT_HOT_BLOCK_SHARE = 0.05


@dataclass(frozen=True, slots=True)
class SessionAssignment:
    session_ids: list[str]
    parents: list[int | None]  # index of each request's parent request, None for a first turn
    hot_blocks: frozenset[int]

    @property
    def sessions(self) -> int:
        return len(set(self.session_ids))


def hot_blocks(
    trace: Sequence[TraceRequest], share: float = DEFAULT_HOT_BLOCK_SHARE
) -> frozenset[int]:
    counts: Counter[int] = Counter()
    for r in trace:
        counts.update(set(r.hash_ids))
    threshold = share * len(trace)
    # A block must also recur to be hot: in a tiny trace one request is a large share.
    return frozenset(h for h, c in counts.items() if c >= threshold and c > 1)


def derive_sessions(
    trace: Sequence[TraceRequest], *, hot_block_share: float = DEFAULT_HOT_BLOCK_SHARE
) -> SessionAssignment:
    hot = hot_blocks(trace, hot_block_share)
    holder: dict[int, int] = {}  # block id -> the most recent request (index) that carried it
    session_ids: list[str] = []
    parents: list[int | None] = []
    for i, r in enumerate(trace):
        parent = None
        for h in reversed(r.hash_ids):
            if h in hot:
                continue
            p = holder.get(h)
            if p is not None:
                parent = p
                break
        parents.append(parent)
        session_ids.append(session_ids[parent] if parent is not None else f"s{i}")
        for h in r.hash_ids:
            holder[h] = i
    return SessionAssignment(session_ids=session_ids, parents=parents, hot_blocks=hot)
