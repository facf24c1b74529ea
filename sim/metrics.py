"""The byte hit rate of a replay, over all reused bytes and over the bytes a cache has to earn;
and its latencies in the field's currency (time to first token, task completion time).

`byte_hit_rate` counts every reused block. Some blocks are carried by nearly every request (the
conversation trace's block 0 is in all of its requests, a system prompt in a real deployment):
they are touched every few requests on every instance, so they stay resident under any policy and
lift every policy's rate alike, LRU's most of all. `byte_hit_rate_unshared` leaves out the blocks
carried by more than SHARED_BLOCK_SHARE of the trace's requests, a set computed from the trace
before any replay, so that every policy is judged on the same bytes.

Why 10%: on both shared traces the carry shares fall off a cliff (block 0 of the conversation
trace is in 100% of its requests, no other block of either trace in more than 0.6%), so any
share from 1% to 50% picks the same set; 10% sits in the middle of that range, and a block in
one request of ten is reused often enough that no eviction policy ever loses it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence

from sim.cluster import SimRequest

SHARED_BLOCK_SHARE = 0.1


def shared_blocks(
    requests: Sequence[SimRequest], share: float = SHARED_BLOCK_SHARE
) -> frozenset[int]:
    """The block ids carried by more than `share` of the requests."""
    counts: Counter[int] = Counter()
    for r in requests:
        counts.update(set(r.hash_ids))
    limit = share * len(requests)
    return frozenset(b for b, n in counts.items() if n > limit)


def unshared_blocks(r: SimRequest, shared: Collection[int]) -> tuple[int, int]:
    """(hit, reused) distinct blocks of a request, leaving out the shared ones."""
    hit = set(r.hash_ids[: r.hit_prefix])
    reused = set(r.hash_ids[: r.reused_prefix])
    return len(hit.difference(shared)), len(reused.difference(shared))


def byte_hit_rate_unshared(requests: Sequence[SimRequest], shared: Collection[int]) -> float:
    """Hit blocks over reused blocks, summed over the requests, shared blocks left out."""
    hit = reused = 0
    for r in requests:
        h, n = unshared_blocks(r, shared)
        hit += h
        reused += n
    return round(hit / reused, 4) if reused else 0.0


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank `q` quantile of already sorted values (0.0 for none)."""
    if not sorted_values:
        return 0.0
    k = min(round(q * (len(sorted_values) - 1)), len(sorted_values) - 1)
    return sorted_values[k]


def latency_summary(
    requests: Sequence[SimRequest], measure_from_seconds: float = 0.0
) -> dict[str, float | int]:
    """Time to first token per request (arrival to first output token: queueing, waiting for
    room, loading or recomputing reused blocks, prefill of the rest), over the requests arriving
    from `measure_from_seconds`; and task completion time per session (its first arrival to its
    last finish: an agent's task, a chat's conversation), over the sessions that start then, so
    that every task judged is judged whole."""
    ttfts = sorted(
        t
        for r in requests
        if r.arrival >= measure_from_seconds and (t := r.ttft_seconds) is not None
    )
    started: dict[str, float] = {}
    ended: dict[str, float] = {}
    for r in requests:
        s = r.session_id
        started[s] = min(started.get(s, r.arrival), r.arrival)
        if r.finished_at is not None:
            ended[s] = max(ended.get(s, r.finished_at), r.finished_at)
    tasks = sorted(
        ended[s] - t0 for s, t0 in started.items() if t0 >= measure_from_seconds and s in ended
    )
    return {
        "ttft_seconds_p50": round(percentile(ttfts, 0.5), 4),
        "ttft_seconds_p90": round(percentile(ttfts, 0.9), 4),
        "ttft_seconds_p99": round(percentile(ttfts, 0.99), 4),
        "ttft_seconds_mean": round(sum(ttfts) / len(ttfts), 4) if ttfts else 0.0,
        "tasks": len(tasks),
        "task_seconds_mean": round(sum(tasks) / len(tasks), 3) if tasks else 0.0,
        "task_seconds_p90": round(percentile(tasks, 0.9), 3),
    }
