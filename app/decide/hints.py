"""Route hints: for a session's next request, where its context is (or soonest will be) among the
candidate instances, how long it would take to have it there, and which candidate to pick.

One engine, two drivers: `POST /v1/route-hint` (app/api/routes/hints.py) and the replay
simulator's `hinted` router (sim/routers.py) both call `route_hint`, so what the simulator
measures is what the endpoint answers.

Per candidate:

- **resident**: the longest prefix of the context in that instance's HBM (the store's
  residency; a prefix cache serves no block past the first one it misses);
- **in flight**: the blocks after it that are in open prefetch orders to that instance's HBM
  (the scheduler's `open_orders()`); they are taken to land by the order's `needed_by_ts`;
- **missing**: the rest, loaded from that instance's host DRAM as far as it holds the prefix,
  then from the shared pool as far as it does; blocks after that are recomputed;
- **expected load seconds**: the missing bytes over each source's link (host and pool links run
  side by side, so the slower one counts), or recomputing every missing token when that is
  sooner (what an engine does); never before the in-flight blocks are due;
- **expected wait seconds**: the requests queued ahead times a typical request's slot time,
  over the requests running (the slots that free up); 0 with no queue or no status;
- **rank**: by load + wait; ties to the session's last instance, then to the lesser load (queued
  + running), then candidate order. A tie means no candidate holds more of the context, most
  often because it is gone everywhere; sending the session home anyway keeps its next turns
  where this one's context will be (replaying the shared synthetic trace, ties to the lesser
  load alone moved 544 of 1,782 returns and stalled 4% longer in total than going home).

A session the store does not know, or whose blocks no event has named, has no context to place:
every candidate's load is 0 and the ranking falls to the wait and the load (least loaded).
That is an answer, not an error, because a router asks for every request, first turns included.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from app.core.cluster import ClusterSpec
from app.state.base import Location, StateStore
from kvprefetch_client.events import BlockHash
from kvprefetch_client.orders import Order

__all__ = [
    "DEFAULT_REQUEST_SECONDS",
    "CandidateHint",
    "HintConfig",
    "InstanceLoad",
    "RouteHint",
    "prefix_lookups",
    "route_hint",
]

# A typical request's time in a slot: ~350 output tokens at 30 ms each plus its prefill, the
# mean of the shared conversation trace in the default scenario. Only the wait estimate uses it.
DEFAULT_REQUEST_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class HintConfig(ClusterSpec):
    """The cluster's numbers a hint is computed with (app/core/cluster.py: the ones the scheduler
    and outcomes use), and a typical request's time in a slot."""

    request_seconds: float = DEFAULT_REQUEST_SECONDS

    @classmethod
    def for_cluster(
        cls, cluster: ClusterSpec, request_seconds: float = DEFAULT_REQUEST_SECONDS
    ) -> HintConfig:
        return cls(
            **{f: getattr(cluster, f) for f in ClusterSpec.__slots__},
            request_seconds=request_seconds,
        )

    def __post_init__(self) -> None:
        for name in (
            "bytes_per_token",
            "pool_link_bytes_per_second",
            "host_link_bytes_per_second",
            "prefill_tokens_per_second",
            "request_seconds",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """What an instance is doing now; None where it never said."""

    queue_depth: int | None = None
    running_requests: int | None = None

    @property
    def requests(self) -> int:
        return (self.queue_depth or 0) + (self.running_requests or 0)


# Not frozen: a hint builds one per candidate (64), and a frozen dataclass's init costs 5 times
# as much (its fields set one by one through object.__setattr__). Treat it as read-only.
@dataclass(slots=True)
class CandidateHint:
    instance_id: str
    resident_bytes: int
    inflight_bytes: int
    missing_bytes: int
    # Where the missing bytes would come from: "none" (nothing missing), "host", "pool",
    # "host+pool", or "recompute" (sooner than loading, or held nowhere).
    source: str
    expected_load_seconds: float
    queue_depth: int | None
    running_requests: int | None
    expected_wait_seconds: float
    recommended: bool
    reason: str

    @property
    def expected_seconds(self) -> float:
        return self.expected_load_seconds + self.expected_wait_seconds


@dataclass(frozen=True, slots=True)
class RouteHint:
    session_id: str
    # False: the store knows no blocks of this session; every candidate's load is 0.
    context_known: bool
    context_bytes: int
    recommended: str
    reason: str
    # In the order the candidates were asked for.
    candidates: list[CandidateHint]


def route_hint(
    store: StateStore,
    session_id: str,
    candidates: Sequence[str],
    now: float,
    *,
    config: HintConfig,
    inflight: Iterable[Order] = (),
    loads: Mapping[str, InstanceLoad] | None = None,
) -> RouteHint:
    """Rank `candidates` (distinct instance ids, at least one) for `session_id`'s next request.

    `inflight`: open orders (the scheduler's `open_orders()`); only prefetches to a candidate's
    HBM count. `loads`: each instance's queue and running requests when the caller knows them
    better than the store's last `instance_status` (the simulator reads its cluster); None reads
    the store's, for the candidates only.

    Costs at most `prefix_lookups(n)` residency lookups per location asked about (each
    candidate's HBM and host, and the pool) in two `held_prefixes` calls, whatever the context's
    length n; plus the blocks of the open orders to the candidates, and their load records.
    """
    if not candidates:
        raise ValueError("candidates is empty")
    if len(set(candidates)) != len(candidates):
        raise ValueError("candidates has duplicates")
    if loads is None:
        loads = {i: InstanceLoad(q, r) for i, (q, r) in store.instance_loads(candidates).items()}
    context = store.context(session_id)
    blocks = context.block_hashes if context is not None else ()
    if not blocks:
        return _rank(
            session_id,
            False,
            context.context_bytes if context is not None else 0,
            None,
            [_no_context(c, loads.get(c, InstanceLoad()), config) for c in candidates],
        )
    assert context is not None
    block_bytes = context.block_tokens * config.bytes_per_token
    # When each block on its way to a candidate's HBM is due; the earliest order carrying it counts.
    due: dict[str, dict[BlockHash, float]] = {c: {} for c in candidates}
    for o in inflight:
        to = due.get(o.instance_id)
        if to is not None and o.kind == "prefetch" and o.tier == "hbm":
            for b in o.block_hashes:
                to[b] = min(to.get(b, o.needed_by_ts), o.needed_by_ts)
    # Two searches (the store's `held_prefixes`): the pool's prefix and each HBM's; then each
    # host's run from where the HBM prefix and what is on its way end.
    first: list[Location] = [("pool", None), *(("hbm", c) for c in candidates)]
    held = store.held_prefixes(first, blocks)
    pool_end, hbm_end = held[0], held[1:]
    ready = [h + _run(blocks, h, due[c]) for c, h in zip(candidates, hbm_end)]
    host_end = store.held_prefixes([("host", c) for c in candidates], blocks, ready)
    hints = [
        _candidate(
            c,
            len(blocks),
            hbm_end[k],
            ready[k],
            due[c],
            blocks,
            host_end[k],
            pool_end,
            context.block_tokens,
            block_bytes,
            now,
            loads.get(c, _UNKNOWN_LOAD),
            config,
        )
        for k, c in enumerate(candidates)
    ]
    return _rank(session_id, True, context.context_bytes, context.instance_id, hints)


def prefix_lookups(n: int) -> int:
    """The most blocks `StateStore.held_prefixes` looks up per location for a context of n."""
    return n.bit_length()


def _run(blocks: Sequence[BlockHash], start: int, due: Mapping[BlockHash, float]) -> int:
    """How many blocks from `start` on are in open orders, up to the first that is not. Walked,
    not bisected: the open orders need not cover a contiguous run (an order moves only what was
    missing when it was planned), and the walk is bounded by the blocks they carry."""
    n, end = start, len(blocks)
    while n < end and blocks[n] in due:
        n += 1
    return n - start


_UNKNOWN_LOAD = InstanceLoad()


def _wait_seconds(load: InstanceLoad, config: HintConfig) -> float:
    # Each running request frees its slot after ~request_seconds, so the queue ahead drains at
    # running / request_seconds requests a second.
    if not load.queue_depth:
        return 0.0
    return load.queue_depth * config.request_seconds / max(load.running_requests or 0, 1)


def _candidate(
    instance_id: str,
    total: int,
    resident_n: int,
    ready: int,
    due: Mapping[BlockHash, float],
    blocks: Sequence[BlockHash],
    host_end: int,
    pool_end: int,
    block_tokens: int,
    block_bytes: int,
    now: float,
    load: InstanceLoad,
    config: HintConfig,
) -> CandidateHint:
    # The context loads in order: HBM's prefix, then what is on its way, then the host's run
    # from there, then the pool's prefix beyond it; from the first block held nowhere, recomputed.
    coming_n = ready - resident_n
    missing_n = total - ready
    host_n = host_end - ready
    pool_n = max(0, pool_end - max(ready, host_end))
    nowhere_n = missing_n - host_n - pool_n
    recompute_seconds = config.recompute_seconds(missing_n * block_tokens)
    # The two links run side by side; blocks held nowhere are recomputed meanwhile.
    load_seconds = max(
        config.load_seconds(host_n * block_bytes, "host"),
        config.load_seconds(pool_n * block_bytes, "pool"),
        config.recompute_seconds(nowhere_n * block_tokens),
    )
    if not missing_n:
        source = "none"
    elif recompute_seconds < load_seconds or nowhere_n == missing_n:
        source, load_seconds = "recompute", recompute_seconds
    else:
        source = ("host+pool" if pool_n else "host") if host_n else "pool"
    # The run on its way is at most the blocks of the open orders: bounded by them, not the context.
    landing_seconds = (
        max((due[blocks[i]] - now for i in range(resident_n, ready)), default=0.0)
        if coming_n
        else 0.0
    )
    expected_load = max(load_seconds, landing_seconds, 0.0)
    wait = _wait_seconds(load, config)
    return CandidateHint(
        instance_id=instance_id,
        resident_bytes=resident_n * block_bytes,
        inflight_bytes=coming_n * block_bytes,
        missing_bytes=missing_n * block_bytes,
        source=source,
        expected_load_seconds=expected_load,
        queue_depth=load.queue_depth,
        running_requests=load.running_requests,
        expected_wait_seconds=wait,
        recommended=False,
        reason=_describe(total, resident_n, coming_n, source, expected_load, load, wait),
    )


def _no_context(instance_id: str, load: InstanceLoad, config: HintConfig) -> CandidateHint:
    wait = _wait_seconds(load, config)
    return CandidateHint(
        instance_id=instance_id,
        resident_bytes=0,
        inflight_bytes=0,
        missing_bytes=0,
        source="none",
        expected_load_seconds=0.0,
        queue_depth=load.queue_depth,
        running_requests=load.running_requests,
        expected_wait_seconds=wait,
        recommended=False,
        reason="no context known; " + _describe_load(load, wait),
    )


def _describe(
    total: int,
    resident: int,
    coming: int,
    source: str,
    load_seconds: float,
    load: InstanceLoad,
    wait: float,
) -> str:
    parts = [f"{resident}/{total} blocks in HBM"]
    if coming:
        parts.append(f"{coming} on their way")
    if source != "none":
        parts.append(f"rest by {source}")
    parts.append(f"ready in {load_seconds:.3f} s")
    return ", ".join(parts) + "; " + _describe_load(load, wait)


def _describe_load(load: InstanceLoad, wait: float) -> str:
    if load.queue_depth is None and load.running_requests is None:
        return "load unknown"
    return (
        f"{load.queue_depth or 0} queued, {load.running_requests or 0} running, wait {wait:.3f} s"
    )


def _rank(
    session_id: str, known: bool, context_bytes: int, home: str | None, hints: list[CandidateHint]
) -> RouteHint:
    # Rounded so that float noise does not beat the tie-breaks.
    keys = sorted(
        (
            round(h.expected_load_seconds + h.expected_wait_seconds, 9),
            h.instance_id != home,
            _load_of(h),
            k,
        )
        for k, h in enumerate(hints)
    )
    order = [key[3] for key in keys]
    best_k = order[0]
    best = hints[best_k]
    hints[best_k] = replace(best, recommended=True)
    if len(hints) == 1:
        why = "the only candidate"
    else:
        runner = hints[order[1]]
        if round(runner.expected_seconds, 9) == round(best.expected_seconds, 9):
            tie = "its last instance" if best.instance_id == home else "less loaded"
            why = f"ties {runner.instance_id} at {best.expected_seconds:.3f} s, {tie}"
        else:
            why = (
                f"{best.expected_seconds:.3f} s to start against "
                f"{runner.expected_seconds:.3f} s on {runner.instance_id}"
            )
    if not known:
        why = "no context known; " + why
    return RouteHint(
        session_id=session_id,
        context_known=known,
        context_bytes=context_bytes,
        recommended=best.instance_id,
        reason=f"{best.instance_id}: {why}",
        candidates=hints,
    )


def _load_of(h: CandidateHint) -> int:
    return (h.queue_depth or 0) + (h.running_requests or 0)
