"""Never worse than LRU: on the same arrivals, what the advice achieved against what plain LRU
would have, per instance; advice off where it loses, tried again after a while.

Every advice the planner gives (keep, demote, prefetch) changes what an instance's HBM holds
when the next request comes. Whether that beat the tier's own LRU is measured, not assumed:

- **LRU's side.** Each instance has a shadow LRU of its HBM: the block hashes of the requests
  routed to it (and of their finished contexts), most recent last, as many as its
  `total_kv_bytes` holds (its instance_status). That is what an LRU cache fed the same requests
  would hold, whatever the advice did to the real one. An instance that never reported its
  total is not judged (its advice stays on).
- **The advice's side.** The outcome of the same arrival (app/observe/outcomes.py): how many of
  its reused blocks were resident in the instance's HBM.
- **The verdict.** Per instance, the difference (advice's resident bytes less LRU's) on each
  judged arrival, its mean and spread over the arrivals, decayed so that the last
  `window_arrivals` or so count. Once `min_arrivals` are judged and the advice loses both
  clearly (its mean difference below zero by `z` standard errors: one busy minute of a few
  big contexts is not a verdict) and by more than `tolerance` of LRU's bytes, the instance goes
  to `lru`:
  its sessions get no keep, demote or prefetch (the tier's LRU decides alone). After
  `retry_seconds` it goes to `trial`: advice on again, sums fresh; if it then holds its own over
  `min_arrivals` it is back to `advice`, else `lru` again with the wait doubled (up to
  `max_retry_seconds`). A circuit breaker: under `lru` the advice has no effect to measure, so it
  is tried instead.

**Demotes priced on their own.** A demote gives its room to whatever the tier's LRU would have
evicted next; what that is worth differs by deployment (decisions 27), so it is measured per
instance on the same arrivals: a demote's **cost** is a reused block a demote named that the
arrival missed and LRU would have held; its **gain** is a reused block the arrival found that
LRU would have evicted and no pin or prefetch put or held there (room the demotes made is the
only other way a block outlives LRU). Once `min_arrivals` with demotes about are judged and
the cost clearly exceeds the gain (`z` standard errors), the instance's demotes are withdrawn and
its advice says `lru` where it said demote; tried again after `retry_seconds`, as the advice is.

Per instance, not per session: a session's next arrival is one sample, far too few, and an
instance is what one LRU serves. The model's own hit rate is the ledger's (app/observe/
ledger.py), judged on the raw advice; this judges the advice as carried out.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from app.decide.advisor import SessionAdvice
from app.observe.outcomes import RequestOutcome
from kvprefetch_client.events import (
    BlockHash,
    Event,
    InstanceStatus,
    RequestFinished,
    RequestRouted,
)
from kvprefetch_client.orders import Order

# Its settings (app/core/config.py), which a replay may set too (`kvprefetch replay --lru-guard`).
GUARD_SETTINGS = (
    "lru_guard",
    "lru_guard_min_arrivals",
    "lru_guard_retry_seconds",
    "lru_guard_demotes",
)

GuardState = Literal["advice", "lru", "trial"]
GUARD_STATES: tuple[GuardState, ...] = ("advice", "lru", "trial")


@dataclass(frozen=True, slots=True)
class GuardConfig:
    bytes_per_block: int
    min_arrivals: int = 50
    window_arrivals: int = 500
    # The advice may lose this share of LRU's resident bytes before it is turned off.
    tolerance: float = 0.01
    # ... and only when the loss is this many standard errors clear of zero.
    z: float = 2.0
    retry_seconds: float = 600.0
    max_retry_seconds: float = 6 * 3600.0
    # Price demotes on their own (above); off, a demote is judged only with the rest.
    demote_pricing: bool = True


@dataclass(slots=True)
class InstanceVerdict:
    """One instance's standing, as `/metrics` and the dashboard show it."""

    state: GuardState = "advice"
    since_ts: float = 0.0
    # Decayed sums over the judged arrivals since `since_ts`: weight, each side's resident
    # bytes, and the squared differences (for the spread).
    weight: float = 0.0
    advice_bytes: float = 0.0
    lru_bytes: float = 0.0
    squared_difference: float = 0.0
    judged: int = 0
    retry_seconds: float = 0.0
    # Times the advice was turned off here.
    fallbacks: int = 0


@dataclass(slots=True)
class DemoteVerdict:
    """Whether demotes pay on one instance: decayed sums of the blocks they cost and gained per
    judged arrival since `since_ts`, as InstanceVerdict's."""

    state: GuardState = "advice"
    since_ts: float = 0.0
    weight: float = 0.0
    cost_blocks: float = 0.0
    gain_blocks: float = 0.0
    squared_difference: float = 0.0
    judged: int = 0
    retry_seconds: float = 0.0
    # Times demotes were turned off here.
    suspensions: int = 0


class _Recent:
    """The blocks most recently named by orders of a kind at an instance, as many as it holds
    (older ones are long evicted or re-used)."""

    __slots__ = ("blocks",)

    def __init__(self) -> None:
        self.blocks: OrderedDict[BlockHash, None] = OrderedDict()

    def add(self, hashes: Sequence[BlockHash], capacity_blocks: int) -> None:
        blocks = self.blocks
        for b in hashes:
            blocks[b] = None
            blocks.move_to_end(b)
        for _ in range(len(blocks) - max(capacity_blocks, 1)):
            blocks.popitem(False)


@dataclass(slots=True)
class _Shadow:
    """An exact LRU of block hashes. Every routed and finished request moves all its blocks, on
    the ingest path: one dict operation per block where it can (a block already held is moved,
    a new one appended), and the lookups in C."""

    capacity_blocks: int = 0
    blocks: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)

    def held(self, hashes: Sequence[BlockHash]) -> list[bool]:
        return list(map(self.blocks.__contains__, hashes))

    def use(self, hashes: Sequence[BlockHash]) -> None:
        blocks = self.blocks
        move_to_end = blocks.move_to_end
        for b in hashes:
            if b in blocks:
                move_to_end(b)
            else:
                blocks[b] = None
        over = len(blocks) - self.capacity_blocks
        if over > 0:
            popitem = blocks.popitem
            for _ in range(over):
                popitem(False)


class LruGuard:
    """Fed by two ingest hooks, in this order for each batch: `observe(events)` (the shadow LRUs
    look the batch's arrivals up, then take their blocks) and `record(outcomes)` (the same
    arrivals' outcomes as judged on the real store). `allowed(instance_id, now)` and
    `filter(advice, now)` say what the planner may do."""

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self._shadows: dict[str, _Shadow] = {}
        self.verdicts: dict[str, InstanceVerdict] = {}
        # This batch's arrivals: request id -> (instance, its blocks, which the shadow held).
        self._lru_held: dict[str, tuple[str, Sequence[BlockHash], list[bool]]] = {}
        self.demotes: dict[str, DemoteVerdict] = {}
        # Per instance, the blocks demotes named, and those pins and prefetches named.
        self._demoted: dict[str, _Recent] = {}
        self._advised: dict[str, _Recent] = {}
        self._decay = math.exp(-1.0 / max(config.window_arrivals, 1))
        # Totals over every judged arrival, whatever the state (/metrics).
        self.served_bytes_total = 0
        self.lru_bytes_total = 0
        self.fallbacks_total = 0
        # ... and the demotes' blocks cost and gained, and times they were turned off.
        self.demote_cost_blocks_total = 0
        self.demote_gain_blocks_total = 0
        self.demote_suspensions_total = 0

    # -- the two hooks ---------------------------------------------------------------------------

    def observe(self, events: Sequence[Event]) -> None:
        self._lru_held.clear()
        for e in events:
            kind = e.type
            if kind == "request_routed":
                routed: RequestRouted = e  # type: ignore[assignment]
                if routed.block_hashes:
                    shadow = self._shadows.get(routed.instance_id)
                    if shadow is not None and shadow.capacity_blocks > 0:
                        hashes = routed.block_hashes
                        self._lru_held[routed.request_id] = (
                            routed.instance_id,
                            hashes,
                            shadow.held(hashes),
                        )
                        shadow.use(hashes)
            elif kind == "request_finished":
                finished: RequestFinished = e  # type: ignore[assignment]
                if finished.block_hashes:
                    shadow = self._shadows.get(finished.instance_id)
                    if shadow is not None:
                        shadow.use(finished.block_hashes)
            elif kind == "instance_status":
                status: InstanceStatus = e  # type: ignore[assignment]
                if status.total_kv_bytes is not None:
                    shadow = self._shadows.setdefault(status.instance_id, _Shadow())
                    shadow.capacity_blocks = status.total_kv_bytes // self.config.bytes_per_block
                    self.verdicts.setdefault(status.instance_id, InstanceVerdict())

    def record(self, outcomes: Sequence[RequestOutcome], now: float) -> None:
        """The outcomes of this batch's arrivals; each is compared with LRU's on the same one."""
        block_bytes = self.config.bytes_per_block
        for o in outcomes:
            shadow_side = self._lru_held.pop(o.request_id, None)
            if shadow_side is None or shadow_side[0] != o.instance_id:
                continue
            # LRU judged on the same reused prefix as the outcome: its first reused_blocks.
            _, hashes, lru_held = shadow_side
            reused = o.reused_blocks
            lru_resident = sum(lru_held[:reused])
            self._judge(o.instance_id, o.resident_bytes, lru_resident * block_bytes, now)
            demoted = self._demoted.get(o.instance_id)
            if demoted is not None and demoted.blocks:
                self._price_demotes(o, hashes[:reused], lru_held, demoted, now)
        self._lru_held.clear()

    def planned(self, orders: Sequence[Order]) -> None:
        """The planner's orders as decided (Dispatcher): which blocks demotes named, and which
        pins and prefetches, per instance."""
        if not self.config.demote_pricing:
            return
        for order in orders:
            shadow = self._shadows.get(order.instance_id)
            if shadow is None or order.tier != "hbm":
                continue
            into = self._demoted if order.kind == "demote" else self._advised
            into.setdefault(order.instance_id, _Recent()).add(
                order.block_hashes, shadow.capacity_blocks
            )

    def _price_demotes(
        self,
        o: RequestOutcome,
        hashes: Sequence[BlockHash],
        lru_held: Sequence[bool],
        demoted: _Recent,
        now: float,
    ) -> None:
        gone = o.missing_blocks
        named = demoted.blocks
        advised = self._advised.get(o.instance_id)
        held = advised.blocks if advised is not None else {}
        cost = gain = 0
        for b, lru_has in zip(hashes, lru_held):
            if lru_has:
                if b in gone and b in named:
                    cost += 1
            elif b not in gone and b not in held:
                gain += 1
        self._judge_demotes(o.instance_id, cost, gain, now)

    # -- what the planner asks -------------------------------------------------------------------

    def mode(self, instance_id: str | None, now: float) -> tuple[bool, bool]:
        """(advice allowed, demotes allowed) on the instance now."""
        return self.allowed(instance_id, now), self.demotes_allowed(instance_id, now)

    def demotes_allowed(self, instance_id: str | None, now: float) -> bool:
        """May the advice demote on this instance now? (Also moves `lru` to `trial` when due.)"""
        return self._on(None if instance_id is None else self.demotes.get(instance_id), now)

    def allowed(self, instance_id: str | None, now: float) -> bool:
        """May the advice act on this instance now? (Also moves `lru` to `trial` when due.)"""
        return self._on(None if instance_id is None else self.verdicts.get(instance_id), now)

    def _on(self, v: InstanceVerdict | DemoteVerdict | None, now: float) -> bool:
        if v is None:
            return True  # not judged (yet): on
        if v.state == "lru" and now - v.since_ts >= v.retry_seconds:
            self._enter(v, "trial", now)
        return v.state != "lru"

    def filter(self, advice: Sequence[SessionAdvice], now: float) -> list[SessionAdvice]:
        """The advice for instances where it may act; plain LRU (no keep, demote or prefetch)
        for the others."""
        out = []
        for a in advice:
            if self.allowed(a.instance_id, now) or (a.retention == "lru" and not a.prefetch):
                if a.retention == "demote" and not self.demotes_allowed(a.instance_id, now):
                    a = replace(a, retention="lru")
                out.append(a)
            else:
                out.append(replace(a, retention="lru", keep_seconds=0.0, prefetch=False))
        return out

    def states(self) -> dict[GuardState, int]:
        """How many instances are in each state."""
        counts = dict.fromkeys(GUARD_STATES, 0)
        for v in self.verdicts.values():
            counts[v.state] += 1
        return counts

    # -- the verdict -----------------------------------------------------------------------------

    def _judge(self, instance_id: str, advice_bytes: int, lru_bytes: int, now: float) -> None:
        v = self.verdicts.setdefault(instance_id, InstanceVerdict(since_ts=now))
        self.served_bytes_total += advice_bytes
        self.lru_bytes_total += lru_bytes
        if v.state == "lru":
            return  # the advice is off: nothing of its own to judge
        d = self._decay
        v.weight = v.weight * d + 1.0
        v.advice_bytes = v.advice_bytes * d + advice_bytes
        v.lru_bytes = v.lru_bytes * d + lru_bytes
        v.squared_difference = v.squared_difference * d + float(advice_bytes - lru_bytes) ** 2
        v.judged += 1
        if v.judged >= self.config.min_arrivals and self._turn(v, self.losing(v), now):
            v.fallbacks += 1
            self.fallbacks_total += 1

    def _judge_demotes(self, instance_id: str, cost: int, gain: int, now: float) -> None:
        v = self.demotes.setdefault(instance_id, DemoteVerdict(since_ts=now))
        self.demote_cost_blocks_total += cost
        self.demote_gain_blocks_total += gain
        if v.state == "lru":
            return
        d = self._decay
        v.weight = v.weight * d + 1.0
        v.cost_blocks = v.cost_blocks * d + cost
        v.gain_blocks = v.gain_blocks * d + gain
        v.squared_difference = v.squared_difference * d + float(gain - cost) ** 2
        v.judged += 1
        if v.judged >= self.config.min_arrivals and self._turn(v, self.demotes_losing(v), now):
            v.suspensions += 1
            self.demote_suspensions_total += 1
            self._demoted.pop(instance_id, None)

    def _turn(self, v: InstanceVerdict | DemoteVerdict, losing: bool, now: float) -> bool:
        """A verdict's step once enough arrivals are judged: off (`lru`) when losing, for the
        retry wait, doubled each time a trial loses again; a trial that holds its own is back on.
        True when it was turned off."""
        c = self.config
        if losing:
            v.retry_seconds = (
                c.retry_seconds
                if v.state == "advice"
                else min(2 * max(v.retry_seconds, c.retry_seconds), c.max_retry_seconds)
            )
            self._enter(v, "lru", now)
            return True
        if v.state == "trial":
            v.retry_seconds = 0.0
            self._enter(v, "advice", now)
        return False

    def demotes_losing(self, v: DemoteVerdict) -> bool:
        """Do the demotes cost this instance more than they gain, clearly?"""
        if v.weight <= 1.0 or v.cost_blocks <= v.gain_blocks:
            return False
        mean = (v.gain_blocks - v.cost_blocks) / v.weight
        variance = max(v.squared_difference / v.weight - mean * mean, 0.0)
        return mean < -self.config.z * math.sqrt(variance / v.weight)

    def losing(self, v: InstanceVerdict) -> bool:
        """Does the advice lose to LRU on this instance, clearly and by more than the tolerance?"""
        if v.weight <= 1.0:
            return False
        c = self.config
        mean = (v.advice_bytes - v.lru_bytes) / v.weight
        variance = max(v.squared_difference / v.weight - mean * mean, 0.0)
        standard_error = math.sqrt(variance / v.weight)
        return v.advice_bytes < (1.0 - c.tolerance) * v.lru_bytes and mean < -c.z * standard_error

    @staticmethod
    def _enter(v: InstanceVerdict | DemoteVerdict, state: GuardState, now: float) -> None:
        v.state = state
        v.since_ts = now
        v.weight = v.squared_difference = 0.0
        if isinstance(v, InstanceVerdict):
            v.advice_bytes = v.lru_bytes = 0.0
        else:
            v.cost_blocks = v.gain_blocks = 0.0
        v.judged = 0


__all__ = [
    "GUARD_SETTINGS",
    "GUARD_STATES",
    "DemoteVerdict",
    "GuardConfig",
    "GuardState",
    "InstanceVerdict",
    "LruGuard",
]
