"""The published agent policies, as replay baselines: what kvprefetch is measured against on agent
traffic (issue 28; ../shared/REFERENCE.md has the citations). Each acts when a call ends, through
the cluster's keep (a soft pin: evicted only after every unadvised block, until its end, as
Mooncake's soft pin), demote and prefetch, and learns each tool's run times from the calls it has
seen return (a call carrying a tool's result arrived that long after the call before finished),
as the serving system would online: nothing from the future.

- `ttl` (`ttl-N` for N seconds; 30 by default): every call's context kept for a fixed time after
  it ends, as SGLang's `retention_seconds` or Mooncake's `default_kv_soft_pin_ttl`.
- `continuum` (Continuum, arXiv 2511.02230): when a call ends in a tool call, its context kept
  for the TTL tau* that maximises F(tau) x (reload + queueing avoided) - E[min(D, tau)] x price,
  over tau in the tool's past run times D (F their empirical distribution); the reload is the
  sooner of loading the context from the pool and recomputing it, the queueing what the
  instance's queue would add (its length times its mean call time over its slots), the price the
  HBM share the context holds times the calls waiting in the instance's queue (memory held costs
  nothing while no call waits). Simplified: the paper's utility is ours in this reading of it, its
  program-level first-come-first-served is not modelled, and the pin is soft; no pin for a tool
  with no past run (Continuum's cold start falls back to the engine's eviction too).
- `tokencake` (Tokencake, arXiv 2510.18586): when a call ends in a tool call predicted (the
  tool's median past run) to outlast the context's reload from the pool, the context is offloaded
  (demoted: first to go) and uploaded again (prefetched) at the predicted return less the
  transfer time (and `UPLOAD_MARGIN_SECONDS`); a shorter tool's context is kept until twice the
  predicted return. Simplified:
  the developer's time estimate is the tool's running median, and its GPU/CPU space scheduling
  is the cluster's own.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sim.policies import Policy

if TYPE_CHECKING:
    from sim.cluster import Cluster, SimRequest

AGENT_POLICIES = ("ttl", "continuum", "tokencake")
DEFAULT_TTL_SECONDS = 30.0
CALL_SECONDS_WEIGHT = 0.1  # of each finished call in the running mean of call times
# Tokencake's upload starts this much before the transfer would end exactly at the predicted
# return (as the oracle's does: sim/policies.py).
UPLOAD_MARGIN_SECONDS = 0.25


class ToolHistory:
    """Each tool's past run times, sorted, learned from the calls seen returning."""

    def __init__(self) -> None:
        self.runs: dict[str, list[float]] = {}
        self._finished: dict[str, float] = {}  # session -> its last call's finish

    def finished(self, r: SimRequest, now: float) -> None:
        self._finished[r.session_id] = now

    def arrived(self, r: SimRequest, now: float) -> None:
        before = self._finished.get(r.session_id)
        if r.tool is not None and before is not None and now >= before:
            bisect.insort(self.runs.setdefault(r.tool, []), now - before)

    def median(self, tool: str) -> float | None:
        runs = self.runs.get(tool)
        return statistics.median(runs) if runs else None


class AgentPolicy(Policy):
    """Learns tool run times as calls come back; subclasses act on `call_ended`."""

    def attach(self, cluster: Cluster) -> None:
        super().attach(cluster)
        self.tools = ToolHistory()
        # A call's admission to finish, averaged over the recent ones (the queue's pace).
        self.call_seconds = 0.0

    def on_arrival(self, r: SimRequest, now: float) -> None:
        self.tools.arrived(r, now)

    def on_finished(self, r: SimRequest, now: float) -> None:
        self.tools.finished(r, now)
        took = now - (r.admitted_at if r.admitted_at is not None else r.arrival)
        self.call_seconds += CALL_SECONDS_WEIGHT * (took - self.call_seconds)
        self.call_ended(r, self.cluster.tool_call_after(r), now)

    def call_ended(self, r: SimRequest, tool_call: SimRequest | None, now: float) -> None:
        """`tool_call`: the call that will carry the tool's result, when `r` ended in one."""

    def reload_seconds(self, r: SimRequest) -> float:
        """The sooner of loading `r`'s context from the pool and recomputing it."""
        spec = self.cluster.spec
        n = len(set(r.hash_ids))
        return min(
            spec.load_seconds(n * self.cluster.block_bytes, "pool"),
            spec.recompute_seconds(n * self.cluster.scenario.block_tokens),
        )


class FixedTtl(AgentPolicy):
    def __init__(self, ttl_seconds: float = DEFAULT_TTL_SECONDS) -> None:
        self.ttl_seconds = ttl_seconds
        self.name = "ttl" if ttl_seconds == DEFAULT_TTL_SECONDS else f"ttl-{ttl_seconds:g}"

    def call_ended(self, r: SimRequest, tool_call: SimRequest | None, now: float) -> None:
        self.cluster.keep(r.instance, list(dict.fromkeys(r.hash_ids)), now + self.ttl_seconds)


def continuum_ttl(runs: Sequence[float], avoided_seconds: float, price_per_second: float) -> float:
    """tau* over the candidates 0 and each past run `runs` (sorted): the most of
    F(tau) x avoided_seconds - E[min(D, tau)] x price_per_second."""
    n = len(runs)
    best_tau, best = 0.0, 0.0
    below = 0.0  # the sum of the runs up to tau
    for k, tau in enumerate(runs):
        below += tau
        covered = (k + 1) / n
        held = (below + tau * (n - k - 1)) / n
        utility = covered * avoided_seconds - held * price_per_second
        if utility > best:
            best_tau, best = tau, utility
    return best_tau


class Continuum(AgentPolicy):
    name = "continuum"

    def call_ended(self, r: SimRequest, tool_call: SimRequest | None, now: float) -> None:
        if tool_call is None:
            return
        runs = self.tools.runs.get(tool_call.tool or "")
        if not runs:
            return
        cluster = self.cluster
        inst = cluster.instances[r.instance]
        blocks = list(dict.fromkeys(r.hash_ids))
        slots = cluster.scenario.max_running_requests
        queueing = len(inst.queue) * self.call_seconds / slots
        # Memory held costs the calls waiting for room or a slot: its share of HBM of them.
        share = len(blocks) / inst.hbm.capacity
        price = share * len(inst.queue)
        ttl = continuum_ttl(runs, self.reload_seconds(r) + queueing, price)
        if ttl > 0:
            cluster.keep(r.instance, blocks, now + ttl)


class Tokencake(AgentPolicy):
    name = "tokencake"

    def call_ended(self, r: SimRequest, tool_call: SimRequest | None, now: float) -> None:
        if tool_call is None:
            return
        predicted = self.tools.median(tool_call.tool or "")
        if predicted is None:
            return
        cluster = self.cluster
        blocks = list(dict.fromkeys(r.hash_ids))
        transfer = cluster.spec.load_seconds(len(blocks) * cluster.block_bytes, "pool")
        if predicted <= transfer:
            cluster.keep(r.instance, blocks, now + 2 * predicted)
            return
        cluster.demote(r.instance, blocks)
        idx = r.instance

        def upload() -> None:
            # The blocks were written to the pool when the call finished: all reusable.
            cluster.prefetch(idx, blocks)

        cluster.call_at(now + predicted - transfer - UPLOAD_MARGIN_SECONDS, upload)


def make_agent_policy(name: str) -> Policy | None:
    """The agent policy called `name` (`ttl-N`: N seconds), or None when it names none."""
    if name == "continuum":
        return Continuum()
    if name == "tokencake":
        return Tokencake()
    if name == "ttl":
        return FixedTtl()
    if name.startswith("ttl-"):
        try:
            seconds = float(name.removeprefix("ttl-"))
        except ValueError:
            raise ValueError(f"{name!r}: ttl-N with N a number of seconds") from None
        if not 0 < seconds < float("inf"):
            raise ValueError(f"{name!r}: ttl-N with N > 0 seconds")
        return FixedTtl(seconds)
    return None
