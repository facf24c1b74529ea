"""What each arriving request found: was the context it reuses already in its instance's HBM?

Judged per accepted `request_routed` that names its blocks, from the store's residency after the
batch carrying it was applied (an ingest observer: duplicates and the log replayed at startup
never count), less what a later event of the same batch stored in its HBM (the engine computing
or loading the context for it, reported in the same batch):

- the **reused** blocks are the request's prefix that was computed before: every block up to the
  last one the store holds where a load could come from (the instance's HBM or host DRAM, or the
  shared pool). Block hashes are prefix-chained, so a block held there means all blocks before it
  were computed once; those held nowhere now are recomputed. Blocks after the last held one are
  the request's new part, computed for the first time;
- **hit**: every reused block was resident (`hbm@<instance>`); **partial**: some were;
  **miss**: none were. A request with no reused block (a first turn, or a context gone from
  every place looked at) has no outcome: there was nothing to have ready.

Stall estimates use the same numbers the scheduler and route hints use. **Incurred**: the
non-resident reused blocks loaded from the host (host link) and the pool (pool link) side by
side, those held nowhere recomputed meanwhile, or all of them recomputed when that is sooner
(what an engine does). **Avoided**: what the resident reused blocks would have cost from the
pool, or their recompute if sooner. Neither counts queueing or contention on the link.

Limits: a context held only in another instance's HBM is not looked for (two lookups per
instance and one of the pool per batch, in one round trip, keep this bounded on the ingest path),
so a request sent away from its context with no pool or host copy counts as having no reuse
rather than as a miss. Residency is as the
events posted so far say: a request posted after later residency changes is judged on them.

Cost: one store read per batch (a few lookups per instance, one round trip in Redis) plus some
microseconds per routed request that names its blocks (README.md, "Metrics", has the measurement).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Literal, cast

from app.core.cluster import ClusterSpec
from app.ingest.ingestor import Observer
from app.state.base import StateStore
from kvprefetch_client.events import (
    BlockHash,
    Event,
    KvBlocksStored,
    RequestRouted,
    Tier,
    VllmKvEvents,
)

Outcome = Literal["hit", "partial", "miss"]
OUTCOMES: tuple[Outcome, ...] = ("hit", "partial", "miss")
_NEAR: tuple[Tier, Tier] = ("hbm", "host")  # an instance's own tiers, asked in this order


# The cluster's numbers (app/core/cluster.py), the ones the scheduler and route hints use.
OutcomeConfig = ClusterSpec


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs twice as much, per request
class RequestOutcome:
    request_id: str
    instance_id: str
    outcome: Outcome
    reused_blocks: int
    resident_blocks: int
    resident_bytes: int
    missing_bytes: int
    stall_seconds: float
    stall_avoided_seconds: float
    # Which reused blocks were not resident (the LRU guard prices demotes by them).
    missing_blocks: frozenset[BlockHash] = frozenset()


def judge(
    store: StateStore, events: Sequence[Event], config: OutcomeConfig
) -> list[RequestOutcome]:
    """The outcome of every `request_routed` in `events` with a reused block, in order.

    One store read per call (`present_many`: HBM and host per instance, and the pool), not per
    request or per instance: on the ingest path a batch of a thousand routed requests costs one
    round trip to Redis.
    The store answers as of the end of the batch; blocks a later event of the same batch stored
    in the request's HBM (the engine computing or loading them for it) count as not there: later
    in the batch and not earlier in time (an engine that stores a request's blocks at the very
    ts it was routed, as the replay's does, reports them after it).
    """
    routed, landed = _scan(events)
    if not routed:
        return []
    wanted: dict[str, set[BlockHash]] = {}  # instance -> the blocks its requests name
    for _, e in routed:
        # _scan keeps only the requests that name blocks.
        wanted.setdefault(e.instance_id, set()).update(cast("list[BlockHash]", e.block_hashes))
    # One store read (one round trip in Redis): each instance's HBM and host and the pool asked
    # about every block named; the host's and pool's answers are then cut to what was not nearer.
    # Sets of what is held: the per-block work below is then set operations in C, which is what
    # keeps this a fraction of applying the batch.
    found = store.present_many(
        [(tier, inst, blocks) for inst, blocks in wanted.items() for tier in _NEAR]
        + [("pool", None, chain.from_iterable(wanted.values()))]  # a store dedupes as it reads
    )
    in_hbm: dict[str, set[BlockHash]] = {}
    on_host: dict[str, set[BlockHash]] = {}
    pool_ask: set[BlockHash] = set()
    for k, (inst, blocks) in enumerate(wanted.items()):
        in_hbm[inst] = here = found[2 * k]
        rest = blocks - here
        for _, _, stored in landed.get(inst, ()):
            # Where blocks that landed in HBM during the batch came from, for requests before them.
            rest.update(here.intersection(stored))
        on_host[inst] = host = found[2 * k + 1] & rest
        pool_ask |= rest - host
    in_pool = found[-1] & pool_ask
    held = {
        inst: in_hbm[inst] | on_host[inst] | (blocks & in_pool) for inst, blocks in wanted.items()
    }
    landed_any = {
        inst: set().union(*(stored for _, _, stored in stores)) for inst, stores in landed.items()
    }

    pool_bps, host_bps = config.pool_link_bytes_per_second, config.host_link_bytes_per_second
    prefill = config.prefill_tokens_per_second
    out = []
    for position, e in routed:
        inst = e.instance_id
        named = cast("list[BlockHash]", e.block_hashes)
        here, host, known = in_hbm[inst], on_host[inst], held[inst]
        stores = landed.get(inst)
        if stores and not landed_any[inst].isdisjoint(named):
            late: set[BlockHash] = set()
            for where, ts, stored in stores:
                if where > position and ts >= e.ts:
                    late.update(stored)
            late.intersection_update(named)
            if late:
                here = here - late
                known = known - (late - host - in_pool)
        if known.isdisjoint(named):
            continue  # nothing reused: a first turn, or a context gone from every place looked at
        last = len(named) - 1
        while named[last] not in known:  # the new tail: a few blocks at most
            last -= 1
        reused = named[: last + 1]
        # Counted as sets, so a block named twice counts once.
        resident = len(here.intersection(reused))
        block_tokens = e.block_tokens or config.block_tokens
        block_bytes = block_tokens * config.bytes_per_token
        missing, stall = 0, 0.0
        gone: set[BlockHash] = set()
        if resident < len(reused):
            gone = set(reused).difference(here)
            missing = len(gone)
        if missing:
            from_host = gone & host
            pool_n = len(in_pool.intersection(gone - from_host))
            host_n = len(from_host)
            # The host and pool links run side by side, and blocks held nowhere are recomputed
            # meanwhile; or all of it is recomputed, when that is sooner.
            stall = min(
                max(
                    host_n * block_bytes / host_bps,
                    pool_n * block_bytes / pool_bps,
                    (missing - host_n - pool_n) * block_tokens / prefill,
                ),
                missing * block_tokens / prefill,
            )
        out.append(
            RequestOutcome(
                request_id=e.request_id,
                instance_id=inst,
                outcome="hit" if not missing else "miss" if not resident else "partial",
                reused_blocks=resident + missing,
                resident_blocks=resident,
                resident_bytes=resident * block_bytes,
                missing_bytes=missing * block_bytes,
                stall_seconds=stall,
                stall_avoided_seconds=min(
                    resident * block_bytes / pool_bps, resident * block_tokens / prefill
                ),
                missing_blocks=frozenset(gone),
            )
        )
    return out


def _scan(
    events: Sequence[Event],
) -> tuple[
    list[tuple[int, RequestRouted]], dict[str, list[tuple[int, float, Sequence[BlockHash]]]]
]:
    """The batch's requests that name blocks, and the blocks each instance's HBM took in it with
    where in the batch and when (position, ts, blocks), in one pass (by type name: cheaper than
    isinstance on the ingest path)."""
    routed: list[tuple[int, RequestRouted]] = []
    landed: dict[str, list[tuple[int, float, Sequence[BlockHash]]]] = {}
    for i, e in enumerate(events):
        kind = e.type  # the type name says the class: the casts below narrow by it
        if kind == "request_routed":
            routed_event = cast(RequestRouted, e)
            if routed_event.block_hashes:
                routed.append((i, routed_event))
        elif kind == "kv_blocks_stored":
            stored = cast(KvBlocksStored, e)
            if stored.tier == "hbm" and stored.instance_id is not None:
                landed.setdefault(stored.instance_id, []).append(
                    (i, stored.ts, stored.block_hashes)
                )
        elif kind == "vllm_kv_events":
            batch = cast(VllmKvEvents, e)
            for sub in batch.expand():
                if isinstance(sub, KvBlocksStored) and sub.tier == "hbm":
                    # Every event expand() makes is at the batch's instance.
                    landed.setdefault(batch.instance_id, []).append((i, sub.ts, sub.block_hashes))
    return routed, landed


def outcome_observer(
    store: StateStore, config: OutcomeConfig, record: Callable[[Sequence[RequestOutcome]], None]
) -> Observer:
    """The ingest observer: judges each batch's arriving requests and hands `record` their
    outcomes, a batch at a time (none: not called)."""

    def observe(events: Sequence[Event]) -> None:
        outcomes = judge(store, events, config)
        if outcomes:
            record(outcomes)

    return observe
