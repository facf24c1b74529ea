"""What a state store is: the views it returns and the interface both backends implement.

The rules every backend follows (in code: app/state/rules.py), so that state is a function of the
*set* of events, whatever order they arrive in (tests/state/test_store_contract.py checks them on
every backend):

- Request lifecycle: each request keeps the greatest `ts` seen for routed, started and finished.
  A session's *latest request* is the one routed last (by `ts`); its state (queued, running,
  idle) comes from that request alone, so a late `request_finished` of an older turn changes
  nothing current. A session keeps its last RECENT_REQUESTS requests.
- Context: the latest request's `context_tokens` when it has finished (or prompt + output when
  the engine did not say), else its `prompt_tokens`. The context's block hashes are those of the
  newest event (by `ts`) that carried block hashes.
- Instance of a session: the instance named by its newest request event (last writer wins by ts).
- Closed: a session is closed when its newest `session_closed` is not older than its latest
  routed request; a new request after a close reopens it.
- Residency: each (location, block) is a last-writer-wins register over stored/removed events
  by `ts`, a removal winning a tie. `kv_blocks_cleared` at `ts` removes every block stored
  before `ts` and makes older stores of that location no-ops.
- Instances: an instance is forgotten, with its locations (its hbm, host and disk), once the
  store has seen an event more than `instance_retention_seconds` newer than the newest event
  that named it; a later event starts it afresh. An event naming an instance the store does not
  hold, while it holds `max_instances` others, is ignored whole (the ingestor refuses it first,
  422 on its instance_id), so a flood of distinct ids costs no more than the cap. Views and
  counts leave out a forgotten instance not deleted yet.
- Instance status and order progress: last writer wins by `ts`; an order's terminal status
  (completed, failed) beats `accepted` whatever the timestamps.
- Orders are forgotten like sessions: an order whose newest progress event is older than the
  newest event ts minus the session retention is gone (`order()` None, not counted), and an
  order_progress event older than that is ignored.
- Signals (`session_signal`): a session keeps its RECENT_SIGNALS greatest signals, ordered by
  (ts, kind, tool, instance, expected_in_seconds, expected_prompt_tokens), oldest first in the
  view; `signals_total` counts signal events. A signal for an unknown session creates it (idle,
  0 turns). Signals never move the times of a session that has any other event: its first seen
  and last activity are the earliest and newest ts of its other events. A session that has had
  only signals takes them from its signals (and, once any other event comes, from those alone),
  so it is listed, and forgotten after the retention, by its newest signal. Signals are
  forgotten with their session; a signal older than the retention cutoff is ignored.
- Counters (turns, signals_total) count events, so they rely on event-id idempotency: a resent
  event with the same `event_id` is never applied twice.
- Listing: `live_sessions` orders by (last activity ts, session id), both descending, and
  filters by the state above, so a listing and its pages are also functions of the set of events
  (the id breaks timestamp ties, which traces are full of).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict

from app.state.rules import SessionStateName
from kvprefetch_client.events import BlockHash, Event, Tier


def location_name(tier: str, instance_id: str | None) -> str:
    """`hbm@gpu-0`, `host@gpu-0`, or `pool`: how a location reads in views and keys."""
    return tier if instance_id is None else f"{tier}@{instance_id}"


class _View(BaseModel):
    model_config = ConfigDict(frozen=True)


class RequestView(_View):
    request_id: str
    instance_id: str | None
    routed_ts: float | None
    started_ts: float | None
    finished_ts: float | None
    prompt_tokens: int | None
    output_tokens: int | None
    context_tokens: int | None


class SignalView(_View):
    """One session_signal, as a session remembers it."""

    ts: float
    kind: str
    tool: str | None = None
    instance_id: str | None = None
    expected_in_seconds: float | None = None
    expected_prompt_tokens: int | None = None


class SessionView(_View):
    session_id: str
    state: SessionStateName
    turns: int
    first_seen_ts: float
    last_activity_ts: float
    closed_ts: float | None
    instance_id: str | None
    context_tokens: int
    context_bytes: int
    block_hashes: list[BlockHash]
    block_tokens: int
    # Routed times of the last RECENT_ARRIVALS turns, oldest first, and the gaps between them.
    recent_arrivals_ts: list[float]
    inter_turn_gaps_seconds: list[float]
    last_request: RequestView | None
    # How many of the context's blocks each location holds right now.
    resident_blocks: dict[str, int]
    # Its latest RECENT_SIGNALS session_signal events by ts, oldest first, and how many it has
    # had in all (a count of events, like turns).
    signals: list[SignalView] = []
    signals_total: int = 0


class InstanceView(_View):
    instance_id: str
    last_seen_ts: float
    status_ts: float | None
    free_kv_bytes: int | None
    total_kv_bytes: int | None
    queue_depth: int | None
    running_requests: int | None
    # Blocks held per tier of this instance (hbm, host, disk).
    resident_blocks: dict[str, int]
    resident_bytes: dict[str, int]


class OrderView(_View):
    order_id: str
    status: Literal["accepted", "completed", "failed"]
    status_ts: float
    bytes: int | None
    seconds: float | None
    reason: str | None


class LocationView(_View):
    location: str
    tier: Tier
    instance_id: str | None
    blocks: int
    bytes: int
    block_tokens: int
    cleared_ts: float | None


@dataclass(frozen=True, slots=True)
class SessionContext:
    """What a route hint needs of a session, without the residency count a SessionView costs:
    its context's block hashes (the store's own sequence: read it, never change it)."""

    session_id: str
    instance_id: str | None
    context_bytes: int
    block_hashes: Sequence[BlockHash]
    block_tokens: int


# One residency question: does (tier, instance) hold each of these blocks?
HoldsQuery = tuple[Tier, str | None, Sequence[BlockHash]]
# The same question put as `present` puts it: which of these blocks does it hold?
PresentQuery = tuple[Tier, str | None, Iterable[BlockHash]]
# A place blocks are held: (tier, instance id), the instance None for the pool.
Location = tuple[Tier, str | None]


# Where a listing of live sessions stopped: the (last_activity_ts, session_id) of its last session.
SessionCursor = tuple[float, str]


def cursor_of(view: SessionView) -> SessionCursor:
    return (view.last_activity_ts, view.session_id)


@dataclass(frozen=True, slots=True)
class LogPosition:
    """A place in the event log: segment number and byte offset just past the last record."""

    segment: int
    offset: int


class StateStore(Protocol):
    """The live picture of the cluster. Implementations: memory (embedded) and Redis (shared)."""

    # A session event older than the newest event ts applied minus this is ignored (math.inf:
    # none is); the ingestor rejects such events before they are logged.
    session_retention_seconds: float
    # The most instances held (None: no cap); see the rules above.
    max_instances: int | None

    def seen(self, event_ids: Sequence[str]) -> list[bool]:
        """Which of these events were already applied (within the idempotency window)."""
        ...

    def seen_and_newest(self, event_ids: Sequence[str]) -> tuple[list[bool], float]:
        """`seen(event_ids)`, and the newest event ts applied (-inf: none), in one read."""
        ...

    def apply(self, events: Sequence[Event]) -> list[bool]:
        """Apply events; for each, False when it had already been applied (a duplicate)."""
        ...

    def session(self, session_id: str) -> SessionView | None: ...

    def sessions(
        self, session_ids: Sequence[str], *, resident: bool = True
    ) -> list[SessionView | None]:
        """`session()` of each id, in that order, in one read (one pipeline in Redis): what the
        scoring loop refreshes its table's changed rows with. `resident=False` leaves every
        `resident_blocks` empty: the scoring loop never reads it, and finding it checks each
        block against every location (most of a read's cost, with many instances)."""
        ...

    def context(self, session_id: str) -> SessionContext | None:
        """The session's context for a route hint (None where `session()` is None); costs one
        read, whatever the length of the context."""
        ...

    def live_sessions(
        self,
        limit: int,
        *,
        before: SessionCursor | None = None,
        active_since_ts: float | None = None,
    ) -> list[SessionView]:
        """Up to `limit` sessions that are not closed, most recently active first.

        Ordered by (last_activity_ts, session_id) descending; only sessions after `before` in that
        order (pass the cursor of the last session of the previous page) and, when given, active
        at or after `active_since_ts`. Each view equals what `session()` returns. Costs one pass
        over the sessions in memory and a few round trips in Redis, whatever `limit` is.
        """
        ...

    def instances(
        self,
        *,
        after: str | None = None,
        limit: int | None = None,
        ids: Sequence[str] | None = None,
    ) -> list[InstanceView]:
        """Instances by id: all of them, or up to `limit` whose id is greater than `after` (a
        page: pass the last id of the previous one), or those of `ids` the store knows. A page
        costs its own instances, not the fleet's."""
        ...

    def known_instances(
        self, instance_ids: Sequence[str], newest_ts: float | None = None
    ) -> tuple[list[bool], int]:
        """Whether the store holds each of these instances (not forgotten), and how many it
        holds: now, or once an event at `newest_ts` has moved the cutoff. What the ingestor
        checks a batch against `max_instances` with."""
        ...

    def locations(
        self, *, after: str | None = None, limit: int | None = None
    ) -> list[LocationView]:
        """Locations by name: all of them, or up to `limit` whose name is greater than `after`
        (a page: pass the last name of the previous one). A page costs its own locations."""
        ...

    def holds(
        self, tier: Tier, instance_id: str | None, block_hashes: Sequence[BlockHash]
    ) -> list[bool]:
        """For each block, whether the location holds it now."""
        ...

    def holds_many(self, queries: Sequence[HoldsQuery]) -> list[list[bool]]:
        """`holds` for each query, in one round trip."""
        ...

    def held_prefixes(
        self,
        where: Sequence[Location],
        block_hashes: Sequence[BlockHash],
        starts: Sequence[int] | None = None,
    ) -> list[int]:
        """For each location, where the run of `block_hashes` it holds from its start (default 0)
        ends: from 0, the length of the longest prefix it holds.

        By binary search, so residency is taken to be prefix-closed (block i held: every block
        before it held), which an engine's tail-first eviction keeps; where it is not, the answer
        is the end of some held run. Reads at most `len(block_hashes).bit_length()` blocks per
        location, whatever the length: one pass in memory, one script call a round in Redis.
        """
        ...

    def instance_loads(self, ids: Sequence[str]) -> dict[str, tuple[int | None, int | None]]:
        """(queue_depth, running_requests) of the instances of `ids` the store knows, as their
        last `instance_status` said (None: never said); costs those instances only."""
        ...

    def present(
        self, tier: Tier, instance_id: str | None, block_hashes: Iterable[BlockHash]
    ) -> set[BlockHash]:
        """The blocks of `block_hashes` the location holds now (`holds` as a set, for callers that
        ask about many blocks at once: the arrival judging on the ingest path)."""
        ...

    def present_many(self, queries: Sequence[PresentQuery]) -> list[set[BlockHash]]:
        """`present` for each query, in one round trip (the arrival judging's read of a batch)."""
        ...

    def order(self, order_id: str) -> OrderView | None: ...

    def stats(self) -> dict[str, int]:
        """Counts for health and metrics: sessions, instances, locations, blocks, orders."""
        ...

    def checkpoint(self, replica_id: str) -> LogPosition | None:
        """How far into this replica's event log the store has applied; None: nothing known."""
        ...

    def set_checkpoint(self, replica_id: str, position: LogPosition) -> None: ...

    def ping(self) -> None:
        """Raise StoreUnavailable when the store cannot serve."""
        ...

    def clear(self) -> None:
        """Forget everything (tests, and `kvprefetch` admin tooling)."""
        ...

    def close(self) -> None: ...
