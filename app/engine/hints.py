"""Route hints: for a session's next request, where its context is (or soonest will be) among the
candidate instances, how long it would take to have it there, and which candidate to pick.

One engine, two drivers: `POST /v1/route-hint` (app/api/routes/hints.py) and the replay
simulator's `hinted` router (sim/routers.py) both call `route_hint`, so what the simulator
measures is what the endpoint answers.

Per candidate:

- **resident**: the context's blocks in that instance's HBM (the store's residency);
- **in flight**: blocks not resident but in an open prefetch order to that instance's HBM
  (the scheduler's `open_orders()`); they are taken to land by the order's `needed_by_ts`;
- **missing**: the rest, loaded from that instance's host DRAM when it holds them, else from the
  shared pool; blocks in neither are recomputed;
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

from app.engine.events import BlockHash
from app.engine.orders import Order
from app.engine.state.base import InstanceView, StateStore

__all__ = ["DEFAULT_REQUEST_SECONDS", "CandidateHint", "HintConfig", "InstanceLoad", "RouteHint", "route_hint"]

# A typical request's time in a slot: ~350 output tokens at 30 ms each plus its prefill, the
# mean of the shared conversation trace in the default scenario. Only the wait estimate uses it.
DEFAULT_REQUEST_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class HintConfig:
    """The cluster's numbers a hint is computed with (the same ones SchedulerConfig carries)."""

    bytes_per_token: int
    pool_link_bytes_per_second: float = 12.5e9
    host_link_bytes_per_second: float = 50e9
    prefill_tokens_per_second: float = 20_000.0
    request_seconds: float = DEFAULT_REQUEST_SECONDS

    def __post_init__(self) -> None:
        for name in ("bytes_per_token", "pool_link_bytes_per_second", "host_link_bytes_per_second",
                     "prefill_tokens_per_second", "request_seconds"):
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


@dataclass(frozen=True, slots=True)
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


def route_hint(store: StateStore, session_id: str, candidates: Sequence[str], now: float, *,
               config: HintConfig, inflight: Iterable[Order] = (),
               loads: Mapping[str, InstanceLoad] | None = None) -> RouteHint:
    """Rank `candidates` (distinct instance ids, at least one) for `session_id`'s next request.

    `inflight`: open orders (the scheduler's `open_orders()`); only prefetches to a candidate's
    HBM count. `loads`: each instance's queue and running requests when the caller knows them
    better than the store's last `instance_status` (the simulator reads its cluster); None reads
    the store.
    """
    if not candidates:
        raise ValueError("candidates is empty")
    if len(set(candidates)) != len(candidates):
        raise ValueError("candidates has duplicates")
    if loads is None:
        loads = _loads_from(store.instances())
    session = store.session(session_id)
    blocks = list(dict.fromkeys(session.block_hashes)) if session is not None else []
    if not blocks:
        return _rank(session_id, False, session.context_bytes if session is not None else 0, None,
                     [_no_context(c, loads.get(c, InstanceLoad()), config) for c in candidates])
    assert session is not None
    block_bytes = session.block_tokens * config.bytes_per_token
    orders = [o for o in inflight if o.kind == "prefetch" and o.tier == "hbm"]
    wanted = set(blocks)
    in_pool = dict(zip(blocks, store.holds("pool", None, blocks)))
    hints = []
    for c in candidates:
        # When each block on its way here is due; the earliest order carrying it counts.
        due: dict[BlockHash, float] = {}
        for o in orders:
            if o.instance_id == c:
                for b in o.block_hashes:
                    if b in wanted:
                        due[b] = min(due.get(b, o.needed_by_ts), o.needed_by_ts)
        hints.append(_candidate(store, c, blocks, in_pool, due, session.block_tokens, block_bytes, now,
                                loads.get(c, InstanceLoad()), config))
    return _rank(session_id, True, session.context_bytes, session.instance_id, hints)


def _loads_from(instances: Iterable[InstanceView]) -> dict[str, InstanceLoad]:
    return {i.instance_id: InstanceLoad(i.queue_depth, i.running_requests) for i in instances}


def _wait_seconds(load: InstanceLoad, config: HintConfig) -> float:
    # Each running request frees its slot after ~request_seconds, so the queue ahead drains at
    # running / request_seconds requests a second.
    if not load.queue_depth:
        return 0.0
    return load.queue_depth * config.request_seconds / max(load.running_requests or 0, 1)


def _candidate(store: StateStore, instance_id: str, blocks: list[BlockHash], in_pool: dict[BlockHash, bool],
               due: dict[BlockHash, float], block_tokens: int, block_bytes: int, now: float, load: InstanceLoad,
               config: HintConfig) -> CandidateHint:
    resident = [b for b, h in zip(blocks, store.holds("hbm", instance_id, blocks)) if h]
    resident_set = set(resident)
    coming = [b for b in blocks if b not in resident_set and b in due]
    missing = [b for b in blocks if b not in resident_set and b not in due]
    on_host = set(b for b, h in zip(missing, store.holds("host", instance_id, missing)) if h) if missing else set()
    host_n = len(on_host)
    pool_n = sum(1 for b in missing if b not in on_host and in_pool[b])
    nowhere_n = len(missing) - host_n - pool_n
    recompute_seconds = len(missing) * block_tokens / config.prefill_tokens_per_second
    # The two links run side by side; blocks held nowhere are recomputed meanwhile.
    load_seconds = max(host_n * block_bytes / config.host_link_bytes_per_second,
                       pool_n * block_bytes / config.pool_link_bytes_per_second,
                       nowhere_n * block_tokens / config.prefill_tokens_per_second)
    if not missing:
        source = "none"
    elif recompute_seconds < load_seconds or nowhere_n == len(missing):
        source, load_seconds = "recompute", recompute_seconds
    else:
        source = "+".join(name for name, n in (("host", host_n), ("pool", pool_n)) if n)
    landing_seconds = max((due[b] - now for b in coming), default=0.0)
    expected_load = max(load_seconds, landing_seconds, 0.0)
    wait = _wait_seconds(load, config)
    return CandidateHint(
        instance_id=instance_id, resident_bytes=len(resident) * block_bytes,
        inflight_bytes=len(coming) * block_bytes, missing_bytes=len(missing) * block_bytes, source=source,
        expected_load_seconds=expected_load, queue_depth=load.queue_depth, running_requests=load.running_requests,
        expected_wait_seconds=wait, recommended=False,
        reason=_describe(len(blocks), len(resident), len(coming), source, expected_load, load, wait))


def _no_context(instance_id: str, load: InstanceLoad, config: HintConfig) -> CandidateHint:
    wait = _wait_seconds(load, config)
    return CandidateHint(
        instance_id=instance_id, resident_bytes=0, inflight_bytes=0, missing_bytes=0, source="none",
        expected_load_seconds=0.0, queue_depth=load.queue_depth, running_requests=load.running_requests,
        expected_wait_seconds=wait, recommended=False, reason="no context known; " + _describe_load(load, wait))


def _describe(total: int, resident: int, coming: int, source: str, load_seconds: float, load: InstanceLoad,
              wait: float) -> str:
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
    return f"{load.queue_depth or 0} queued, {load.running_requests or 0} running, wait {wait:.3f} s"


def _rank(session_id: str, known: bool, context_bytes: int, home: str | None,
          hints: list[CandidateHint]) -> RouteHint:
    # Rounded so that float noise does not beat the tie-breaks.
    order = sorted(range(len(hints)), key=lambda k: (round(hints[k].expected_seconds, 9),
                                                      hints[k].instance_id != home, _load_of(hints[k]), k))
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
            why = f"{best.expected_seconds:.3f} s to start against {runner.expected_seconds:.3f} s on " \
                  f"{runner.instance_id}"
    if not known:
        why = "no context known; " + why
    return RouteHint(session_id=session_id, context_known=known, context_bytes=context_bytes,
                     recommended=best.instance_id, reason=f"{best.instance_id}: {why}", candidates=hints)


def _load_of(h: CandidateHint) -> int:
    return (h.queue_depth or 0) + (h.running_requests or 0)

