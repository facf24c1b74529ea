"""The session rules, once: what a request event, a session_closed or a session_signal does to a
session, which of its requests is the latest and what state and context that gives it, what it
keeps (its last RECENT_REQUESTS requests, RECENT_ARRIVALS arrivals and RECENT_SIGNALS signals),
and the two windows: retention (when a session or an order is forgotten) and the reorder window
(how long a removal shadows a late store). app/state/base.py says the rules in words; this
module is them in code.

Both Python stores call it: MemoryStore applies every session event through SessionRecord and
RequestRecord and reads them back through `session_state` and `context_tokens`; RedisStore reads
its stored records through the same functions. Events reach Redis through redis_apply.lua, which
has to run server-side: it is a copy of the apply side of this module, each part commented with
the name it mirrors here, and tests/state/test_store_contract.py runs every case on both stores
(the Lua included) so the copy cannot drift unseen.

Timestamps and counts are plain numbers with NONE (-1) for "none": every real one is >= 0, and
the stores keep millions of these records.
"""

from __future__ import annotations

import bisect
from array import array
from typing import Literal

from kvprefetch_client.events import BlockHash, SessionSignal

RECENT_REQUESTS = 3
RECENT_ARRIVALS = 16
# A session keeps its latest RECENT_SIGNALS session_signal events (by ts): a flood costs no more.
RECENT_SIGNALS = 8
NONE = -1.0  # "no timestamp" (and, as -1, "no count")

SessionStateName = Literal["queued", "running", "idle", "closed"]


# -- the two windows ------------------------------------------------------------------------------


def retention_cutoff(newest_ts: float, session_retention_seconds: float) -> float:
    """A session or an order last active before this is forgotten, and an event older than it
    ignored; `newest_ts` is the newest event ts the store has applied."""
    return newest_ts - session_retention_seconds


def tombstone_floor(location_newest_ts: float, reorder_window_seconds: float) -> float:
    """A removal at a location shadows a store older than it while its ts is at least this;
    `location_newest_ts` is the newest event ts at that location."""
    return location_newest_ts - reorder_window_seconds


# -- reads ----------------------------------------------------------------------------------------


def request_rank(routed_ts: float, started_ts: float, finished_ts: float) -> float:
    """Which request is the latest: the greatest rank. Its routed time, else the earliest other
    time seen (a started or finished that came before its routed)."""
    if routed_ts >= 0:
        return routed_ts
    if started_ts >= 0 and finished_ts >= 0:
        return min(started_ts, finished_ts)
    return started_ts if started_ts >= 0 else finished_ts if finished_ts >= 0 else NONE


def context_tokens(
    finished_ts: float, prompt_tokens: int, output_tokens: int, context_tokens: int
) -> int:
    """A session's context, from its latest request: what the engine said it was when the
    request finished (else prompt + output), its prompt before that."""
    if finished_ts >= 0 and context_tokens >= 0:
        return context_tokens
    if finished_ts >= 0 and prompt_tokens >= 0:
        return prompt_tokens + output_tokens
    return max(prompt_tokens, 0)


def session_state(closed_ts: float, latest: tuple[float, float, float] | None) -> SessionStateName:
    """From the session's newest close and its latest request's (routed, started, finished):
    closed when the close is not older than the latest routing, else that request's stage."""
    latest_routed = latest[0] if latest is not None else NONE
    if closed_ts >= 0 and closed_ts >= latest_routed:
        return "closed"
    if latest is None or latest[2] >= 0:
        return "idle"
    if latest[1] >= 0:
        return "running"
    return "queued"


# -- the records and what each event does to them -------------------------------------------


class RequestRecord:
    """One request of a session: the greatest ts seen of each stage, and the instance named by
    its newest event."""

    __slots__ = (
        "context_tokens",
        "finished_ts",
        "instance_id",
        "instance_ts",
        "output_tokens",
        "prompt_tokens",
        "request_id",
        "routed_ts",
        "started_ts",
    )

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.instance_id: str | None = None
        self.instance_ts = NONE
        self.routed_ts = NONE
        self.started_ts = NONE
        self.finished_ts = NONE
        self.prompt_tokens = -1
        self.output_tokens = -1
        self.context_tokens = -1

    def rank(self) -> float:
        return request_rank(self.routed_ts, self.started_ts, self.finished_ts)

    def stages(self) -> tuple[float, float, float]:
        return self.routed_ts, self.started_ts, self.finished_ts


# One remembered session_signal: (ts, kind, tool, instance_id, expected_in_seconds,
# expected_prompt_tokens), "" and NONE for "none". The whole tuple is its order (ts first), so the
# RECENT_SIGNALS kept are the greatest of the set of signals, whatever order they came in.
SignalEntry = tuple[float, str, str, str, float, int]


def signal_entry(e: SessionSignal) -> SignalEntry:
    return (
        e.ts,
        e.kind,
        e.tool or "",
        e.instance_id or "",
        e.expected_in_seconds if e.expected_in_seconds is not None else NONE,
        e.expected_prompt_tokens if e.expected_prompt_tokens is not None else -1,
    )


def add_signal(signals: list[SignalEntry], entry: SignalEntry) -> None:
    """A signal into the sorted signals; the greatest RECENT_SIGNALS kept (a flood costs no
    more)."""
    bisect.insort(signals, entry)
    if len(signals) > RECENT_SIGNALS:
        del signals[0]


class SessionRecord:
    """One session, as the events so far made it. Kept small (slotted, floats rather than
    optional objects, block hashes packed in an array): a store holds millions."""

    __slots__ = (
        "arrivals",
        "block_tokens",
        "blocks",
        "blocks_ts",
        "closed_ts",
        "first_ts",
        "instance_id",
        "instance_ts",
        "last_ts",
        "requests",
        "signal_only",
        "signals",
        "signals_total",
        "turns",
    )

    def __init__(self, ts: float, *, signal_only: bool = False) -> None:
        self.turns = 0
        self.first_ts = ts
        self.last_ts = ts
        # Every event so far was a session_signal: first seen and last activity are the signals'
        # until any other event comes, then that event's alone (see `touch`).
        self.signal_only = signal_only
        self.signals: list[SignalEntry] = []
        self.signals_total = 0
        self.closed_ts = NONE
        self.instance_id: str | None = None
        self.instance_ts = NONE
        self.blocks: array[int] | tuple[BlockHash, ...] = ()
        self.blocks_ts = NONE
        self.block_tokens = 0
        self.arrivals: list[float] = []
        self.requests: list[RequestRecord] = []

    def touch(self, ts: float) -> None:
        """Any event of the session but a signal: first seen and last activity. A session that
        has had only signals so far takes both from this event alone (signals never move the
        times of a session that has other events)."""
        if self.signal_only:
            self.signal_only = False
            self.first_ts = self.last_ts = ts
            return
        if ts < self.first_ts:
            self.first_ts = ts
        if ts > self.last_ts:
            self.last_ts = ts

    def request(self, request_id: str, instance_id: str, ts: float) -> RequestRecord:
        """What every request event does (after `touch`): the newest request event names the
        session's instance and the request's (a tie: the later applied wins); returns the
        request, new if the session has not seen it."""
        if ts >= self.instance_ts:
            self.instance_id, self.instance_ts = instance_id, ts
        for r in self.requests:
            if r.request_id == request_id:
                break
        else:
            r = RequestRecord(request_id)
            self.requests.append(r)
        if ts >= r.instance_ts:
            r.instance_id, r.instance_ts = instance_id, ts
        return r

    def routed(
        self,
        r: RequestRecord,
        ts: float,
        prompt_tokens: int,
        block_hashes: list[BlockHash] | None,
        block_tokens: int,
    ) -> None:
        """request_routed: one more turn and arrival; the prompt of the newest routing."""
        self.turns += 1
        add_arrival(self.arrivals, ts)
        self.set_blocks(block_hashes, block_tokens, ts)
        if ts >= r.routed_ts:
            r.routed_ts, r.prompt_tokens = ts, prompt_tokens
        self.trim_requests()

    def started(self, r: RequestRecord, ts: float) -> None:
        """request_started: the newest start."""
        if ts > r.started_ts:
            r.started_ts = ts
        self.trim_requests()

    def finished(
        self,
        r: RequestRecord,
        ts: float,
        output_tokens: int,
        context_tokens: int | None,
        block_hashes: list[BlockHash] | None,
        block_tokens: int,
    ) -> None:
        """request_finished: the output and context of the newest finish."""
        self.set_blocks(block_hashes, block_tokens, ts)
        if ts >= r.finished_ts:
            r.finished_ts, r.output_tokens = ts, output_tokens
            r.context_tokens = context_tokens if context_tokens is not None else -1
        self.trim_requests()

    def signal(self, entry: SignalEntry) -> None:
        """session_signal: one more signal, kept among the RECENT_SIGNALS greatest; the signals
        are the times of a session that has had nothing else."""
        self.signals_total += 1
        add_signal(self.signals, entry)
        if self.signal_only:
            ts = entry[0]
            if ts < self.first_ts:
                self.first_ts = ts
            if ts > self.last_ts:
                self.last_ts = ts

    def closed(self, ts: float) -> None:
        """session_closed: the newest close (what `session_state` weighs against the routing)."""
        if ts > self.closed_ts:
            self.closed_ts = ts

    def set_blocks(
        self, block_hashes: list[BlockHash] | None, block_tokens: int, ts: float
    ) -> None:
        """The context's blocks are those of the newest event that carried any (a tie: the
        later applied wins)."""
        if block_hashes is not None and ts >= self.blocks_ts:
            self.blocks, self.blocks_ts, self.block_tokens = pack(block_hashes), ts, block_tokens

    def join_blocks(
        self,
        parent: BlockHash | None,
        block_hashes: list[BlockHash],
        block_tokens: int,
        ts: float,
        max_blocks: int,
    ) -> None:
        """An engine stored blocks for this session (vLLM's BlockStored `session_id`): they follow
        `parent` in its context, which is cut after the parent's first place and extended (no
        parent: they start it). A parent the context does not hold, a chain longer than
        `max_blocks`, or an event older than the context's: nothing changes."""
        if ts < self.blocks_ts:
            return
        if parent is None:
            chain = list(block_hashes)
        else:
            current = list(self.blocks)
            try:
                at = next(
                    i for i, h in enumerate(current) if type(h) is type(parent) and h == parent
                )
            except StopIteration:
                return
            chain = current[: at + 1] + list(block_hashes)
        if len(chain) <= max_blocks:
            self.blocks, self.blocks_ts, self.block_tokens = pack(chain), ts, block_tokens

    def trim_requests(self) -> None:
        """Keep the RECENT_REQUESTS latest requests: a stable sort by rank, the oldest dropped."""
        if len(self.requests) > RECENT_REQUESTS:
            self.requests.sort(key=RequestRecord.rank)
            del self.requests[: len(self.requests) - RECENT_REQUESTS]

    def latest(self) -> RequestRecord | None:
        return max(self.requests, key=RequestRecord.rank) if self.requests else None

    def state(self, latest: RequestRecord | None) -> SessionStateName:
        return session_state(self.closed_ts, latest.stages() if latest is not None else None)


def latest_context_tokens(latest: RequestRecord | None) -> int:
    if latest is None:
        return 0
    return context_tokens(
        latest.finished_ts, latest.prompt_tokens, latest.output_tokens, latest.context_tokens
    )


def add_arrival(arrivals: list[float], ts: float) -> None:
    """A routing's ts into the sorted arrivals (late ones in their place); the last
    RECENT_ARRIVALS kept."""
    if not arrivals or ts >= arrivals[-1]:
        arrivals.append(ts)
    else:
        bisect.insort(arrivals, ts)
    if len(arrivals) > RECENT_ARRIVALS:
        del arrivals[0]


def pack(block_hashes: list[BlockHash]) -> array[int] | tuple[BlockHash, ...]:
    """Block hashes in 8 bytes each when they are 64-bit ints (a tuple of ints costs ~36)."""
    for code in ("q", "Q"):
        try:
            return array(code, block_hashes)  # type: ignore[arg-type]
        except (OverflowError, TypeError):
            continue
    return tuple(block_hashes)
