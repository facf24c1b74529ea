"""The discrete-event cluster model: instances, their HBM, links from the shared pool, queues.

What happens to a request (all times simulated):
1. it arrives; the router picks an instance; it joins that instance's queue;
2. when a slot is free (`max_running_requests`) and HBM can make room for all its blocks, it is
   admitted. Its *reused* blocks are the longest prefix of its block ids already computed by an
   earlier request (the pool holds every block ever written). Its *hits* are the longest prefix
   of the reused blocks resident in HBM and landed, as vLLM's longest-cache-hit lookup finds
   them: prefix blocks are chained, so a block after the first one missing (absent, or still
   landing) cannot be used from HBM even when it is there. Every reused block after the hits is
   loaded (from the host tier when it is there, else from the pool, over that instance's links,
   shared with every other transfer) or recomputed, whichever is sooner (the scheduler's own
   rules, app/decide/room_and_links.py: split_by_source, load_or_recompute), resident ones
   included: those keep their slot (an engine would take a second one for the copy; not
   modelled) but their bytes cross the link, or their tokens are recomputed, all the same.
   Blocks still landing are waited for, not loaded again. The request stalls until the last
   byte it needs has landed, or for the recompute (its tokens / the prefill rate);
3. it computes: prefill of its new tokens, then decode of its output tokens;
4. it finishes; its blocks stay in HBM, unpinned, and are now in the pool too. They go back to
   the LRU order tail first, as vLLM frees a request's blocks (its free queue takes them in
   reverse), so a context's tail is evicted before its head and what remains is a usable prefix.
   A prefetch lands the same way (its head most recently used).

Blocks of admitted requests and blocks still landing are pinned: never evicted. Eviction is LRU
unless the policy advises otherwise (see sim/blockcache.py). With a host tier (the `host-tier`
scenario) what HBM evicts goes to host DRAM (its own LRU making room), and what the host gains
or loses is reported as kv_blocks_stored and kv_blocks_removed of tier "host", as an engine with
a CPU tier reports it: the scheduler sources from the host by what it was told. A prefetch reads
the tier its order names (`prefetch`'s `source`).

How a prefetch lands is the scenario's `landing` (an assumption): "chunked" (the default), chunk
by chunk (`chunk_tokens`, a whole number of blocks) in the order the prefetch lists its blocks,
head first, each chunk landed (unpinned, usable, stored) as its last byte crosses the link, as
LMCache loads in 256-token chunks and vLLM's connector loads asynchronously; "whole", all of it at
its last byte. Demand loads and recomputes land whole under either rule: the request that ordered
one needs every block of it before it can start.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from app.core.cluster import SourceTier
from app.decide.room_and_links import load_or_recompute, split_by_source
from sim.blockcache import BlockCache
from sim.compute import SharedCompute
from sim.links import Link, Transfer
from sim.scenario import Scenario

if TYPE_CHECKING:
    from sim.policies import Policy
    from sim.routers import Router
    from sim.signals import SimSignal

ARRIVAL, LINK, DONE, TICK, CALL, RECOMPUTED, SIGNAL, COMPUTE = range(8)


@dataclass(slots=True, eq=False)
class SimRequest:
    index: int
    session_id: str
    arrival: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    instance: int = -1
    admitted_at: float | None = None
    ready_at: float | None = None
    # When its first output token is out: its prefill of the new tokens done.
    first_token_at: float | None = None
    finished_at: float | None = None
    reused_blocks: int = 0  # distinct blocks in the reused prefix
    hit_blocks: int = 0  # distinct blocks in the hit prefix (HBM, usable)
    # Lengths, in positions of hash_ids, of the reused prefix and of its hit prefix.
    reused_prefix: int = 0
    hit_prefix: int = 0
    loaded_bytes: int = 0
    recompute_tokens: int = 0
    compute_seconds: float = 0.0
    # Closed loop (an agent trace): it arrives this long after its session's previous request
    # finished here (a tool's run, a human's think time); None: at its recorded `arrival`.
    after_seconds: float | None = None
    # The tool whose result it carries (None: a human turn, or not said).
    tool: str | None = None
    # Transfers waited for: id -> how many of its blocks (a prefix, as they land) must be in.
    waiting_on: dict[int, int] = field(default_factory=dict)

    def wait_for(self, t: Transfer, blocks: int | None = None) -> bool:
        """Wait until the first `blocks` of a transfer's blocks have landed (default: all of
        them); False when already waiting for it (then until the longer of the two)."""
        need = len(t.blocks) if blocks is None else blocks
        had = self.waiting_on.get(t.transfer_id)
        if had is not None:
            self.waiting_on[t.transfer_id] = max(had, need)
            return False
        self.waiting_on[t.transfer_id] = need
        return True

    @property
    def stall_seconds(self) -> float:
        if self.admitted_at is None or self.ready_at is None:
            return 0.0
        return self.ready_at - self.admitted_at

    @property
    def ttft_seconds(self) -> float | None:
        """Time to first token: arrival to its first output token (queueing, waiting for room,
        loading or recomputing its reused blocks, prefill of the rest)."""
        if self.first_token_at is None:
            return None
        return self.first_token_at - self.arrival


class Instance:
    def __init__(
        self, idx: int, scenario: Scenario, evict_key: Callable[[int], float] | None
    ) -> None:
        self.idx = idx
        self.instance_id = f"gpu-{idx}"
        self.hbm = BlockCache(
            scenario.hbm_blocks, evict_key=evict_key, hard_keeps=scenario.pins == "hard"
        )
        self.host = BlockCache(scenario.host_blocks) if scenario.host_blocks else None
        self.pool_link = Link(scenario.pool_link_bytes_per_second)
        self.host_link = Link(scenario.host_link_bytes_per_second)
        self.queue: deque[SimRequest] = deque()
        self.running = 0
        self.inflight: dict[int, Transfer] = {}  # block -> the transfer bringing it into HBM
        self.busy_seconds = 0.0
        # The GPU its running requests share in chunked-prefill steps (scenario compute
        # "shared"); None: each request computes as if alone (sim/compute.py).
        self.compute: SharedCompute | None = None

    @property
    def load(self) -> int:
        return self.running + len(self.queue)

    def link(self, source: SourceTier) -> Link:
        """The link from `source` into this instance's HBM."""
        return self.host_link if source == "host" else self.pool_link


def held_in(place: BlockCache | set[int] | None) -> Callable[[Sequence[int]], list[bool]]:
    """Which of a batch of blocks `place` holds, as the scheduler's store answers (None: a tier
    the instance lacks, holding nothing)."""
    if place is None:
        return lambda blocks: [False] * len(blocks)
    return lambda blocks: [b in place for b in blocks]


@dataclass(slots=True)
class Totals:
    bytes_prefetched: int = 0
    bytes_prefetched_unused: int = 0
    bytes_evicted: int = 0
    prefetch_orders: int = 0
    signals_emitted: int = 0
    signals_dropped: int = 0  # their request came (or got within 10 min) before they could


class Cluster:
    """Runs a trace's requests through instances, a router and a policy, under simulated time."""

    # Tests set this to check the model's invariants after every event (see _check).
    check_invariants = False

    def __init__(
        self,
        scenario: Scenario,
        requests: Sequence[SimRequest],
        router: Router,
        policy: Policy,
        emit: Callable[[str, float, dict[str, Any]], None] | None = None,
        signals: Sequence[SimSignal] = (),
    ) -> None:
        """`signals`: session_signal events to emit at their times (sim/signals.py), each held
        until the request it follows has finished. A request with `after_seconds` arrives that
        long after its session's previous request finished here (closed loop), unless the
        scenario's `arrivals` is "open": then at its recorded arrival, as every request of a
        trace without them."""
        self.scenario = scenario
        self.signals = signals
        # Signals waiting for the request they follow to finish, by its index.
        self._held_signals: dict[int, list[SimSignal]] = {}
        self._by_index = {r.index: r for r in requests} if signals else {}
        self.requests = list(requests)
        # Closed loop: each such request waits for its session's previous one, by index.
        self._next_in_session: dict[int, SimRequest] = {}
        if scenario.arrivals == "closed":
            last: dict[str, SimRequest] = {}
            for r in sorted(self.requests, key=lambda q: q.index):
                before = last.get(r.session_id)
                if before is not None and r.after_seconds is not None:
                    self._next_in_session[before.index] = r
                last[r.session_id] = r
        self.closed_loop = bool(self._next_in_session)
        # Each request's session's next one, by index: what an engine knows when a call ends in
        # a tool call (the call's output names the tool), the agent policies read it.
        self._following: dict[int, SimRequest] = {}
        last_of: dict[str, SimRequest] = {}
        for r in sorted(self.requests, key=lambda q: q.index):
            before = last_of.get(r.session_id)
            if before is not None:
                self._following[before.index] = r
            last_of[r.session_id] = r
        self._recorded = {r.index: r.arrival for r in self._next_in_session.values()}
        self.router = router
        self.policy = policy
        self.emit = emit or (lambda kind, ts, fields: None)
        self.now = 0.0
        self.spec = scenario.cluster  # the numbers the service's parts read too
        self.block_bytes = self.spec.bytes_per_block
        self.written: set[int] = set()  # blocks in the pool: every block ever computed
        self.session_instance: dict[str, int] = {}
        self._program_start: dict[str, float] = {}  # session -> its first arrival
        self.totals = Totals()
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._transfer_ids = itertools.count()
        too_big = next(
            (r for r in self.requests if len(set(r.hash_ids)) > scenario.hbm_blocks), None
        )
        if too_big is not None:  # it could never be admitted, and would block its queue for good
            raise ValueError(
                f"request {too_big.index} needs {len(set(too_big.hash_ids))} blocks; "
                f"an instance's HBM "
                f"holds {scenario.hbm_blocks} in scenario {scenario.name!r}"
            )
        policy.attach(self)
        self.instances = [
            Instance(i, scenario, policy.evict_key) for i in range(scenario.instances)
        ]
        if scenario.compute == "shared":
            for inst in self.instances:
                inst.compute = SharedCompute(
                    step_tokens=scenario.step_tokens,
                    prefill_tokens_per_second=scenario.prefill_tokens_per_second,
                    decode_seconds_per_token=scenario.decode_seconds_per_token,
                    schedule=self._compute_due(inst.idx),
                )

    # -- the event loop --------------------------------------------------------------------

    def schedule(self, at: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._events, (at, next(self._seq), kind, payload))

    def call_at(self, at: float, fn: Callable[[], None]) -> None:
        """Run `fn` at simulated time `at` (policies use it to act later)."""
        self.schedule(max(at, self.now), CALL, fn)

    def run(self, progress: Callable[[int], None] | None = None) -> None:
        waiting = {r.index for r in self._next_in_session.values()}
        # Signals for a request that comes in closed loop are timed when its predecessor ends.
        self._signals_after: dict[int, list[SimSignal]] = {}
        for r in self.requests:
            if r.index not in waiting:
                self.schedule(r.arrival, ARRIVAL, r)
        for s in self.signals:
            if self.closed_loop:
                self._signals_after.setdefault(s.after, []).append(s)
            else:
                self.schedule(s.ts, SIGNAL, s)
        if self.policy.tick_seconds:
            self.schedule(0.0, TICK, None)
        remaining = len(self.requests)
        while self._events and remaining:
            at, _, kind, payload = heapq.heappop(self._events)
            self.now = at
            if kind == ARRIVAL:
                self._arrive(payload)
            elif kind == LINK:
                self._link_due(*payload)
            elif kind == DONE:
                if self.closed_loop:  # first: a policy told of the finish sees the next arrival
                    self._next_turn(payload)
                self._finish(payload)
                for s in self._held_signals.pop(payload.index, ()):
                    self.schedule(at, SIGNAL, s)
                remaining -= 1
                if progress is not None:
                    progress(1)
                if remaining == 0:
                    break
            elif kind == RECOMPUTED:
                idx, t = payload
                t.done_at = at
                self._landed(self.instances[idx], t)
                self._try_start(self.instances[idx])
            elif kind == SIGNAL:
                self._signal(payload)
            elif kind == COMPUTE:
                idx, version = payload
                compute = self.instances[idx].compute
                assert compute is not None
                compute.advance(at, version)
            elif kind == TICK:
                self.policy.on_tick(at)
                self.schedule(at + self.policy.tick_seconds, TICK, None)  # type: ignore[operator]
            else:
                payload()
            if self.check_invariants:
                self._check()
        for inst in self.instances:  # prefetched blocks never used by the end are wasted too
            for e in inst.hbm.entries.values():
                if e.prefetched:
                    self.totals.bytes_prefetched_unused += self.block_bytes

    def _check(self) -> None:
        """The model's invariants (cheap ones; run after every event when check_invariants is
        set)."""
        for inst in self.instances:
            assert len(inst.hbm) <= inst.hbm.capacity, f"{inst.instance_id}: HBM over capacity"
            if inst.host is not None:
                assert len(inst.host) <= inst.host.capacity, (
                    f"{inst.instance_id}: host over capacity"
                )
            assert 0 <= inst.running <= self.scenario.max_running_requests, (
                f"{inst.instance_id}: running"
            )
            for b, t in inst.inflight.items():
                e = inst.hbm.entries.get(b)
                assert e is not None and e.pins > 0, (
                    f"{inst.instance_id}: block {b} landing but not pinned"
                )
                assert t.positions is None or t.positions[b] >= t.landed_blocks, (
                    f"{inst.instance_id}: block {b} landed but still landing"
                )

    def tool_call_after(self, r: SimRequest) -> SimRequest | None:
        """The session's next request when `r` ended in a tool call (the next one carries the
        tool's result: its `tool`), else None."""
        nxt = self._following.get(r.index)
        return nxt if nxt is not None and nxt.tool is not None else None

    def _next_turn(self, finished: SimRequest) -> None:
        """Closed loop: the session's next request arrives `after_seconds` from now; the signals
        that follow the finished request are timed from the arrivals as they happen here (a true
        signal its drawn lead before its request, a false alarm as far into the spell as drawn)."""
        now = self.now
        nxt = self._next_in_session.get(finished.index)
        if nxt is not None:
            nxt.arrival = now + (nxt.after_seconds or 0.0)
            self.schedule(nxt.arrival, ARRIVAL, nxt)
        shift = finished.arrival - self._recorded_arrival(finished)
        for s in self._signals_after.pop(finished.index, ()):
            if s.true and nxt is not None:
                ts, latest = max(nxt.arrival - s.lead_seconds, now), nxt.arrival
            else:
                ts, latest = s.ts + shift, s.latest + shift
            self.schedule(max(ts, now), SIGNAL, replace(s, ts=ts, latest=latest))

    def _recorded_arrival(self, r: SimRequest) -> float:
        return self._recorded.get(r.index, r.arrival)

    # -- signals ---------------------------------------------------------------------------

    def _signal(self, s: SimSignal) -> None:
        """Emit a session_signal and tell the policy; not before the request it follows has
        finished (a signal cannot precede the turn before it), not past its `latest`."""
        after = self._by_index[s.after]
        if after.finished_at is None:
            self._held_signals.setdefault(s.after, []).append(s)
            return
        if self.now >= s.latest:
            self.totals.signals_dropped += 1
            return
        self.totals.signals_emitted += 1
        fields: dict[str, Any] = {"session_id": s.session_id, "kind": s.kind}
        if s.tool is not None:
            fields["tool"] = s.tool
        self.emit("session_signal", self.now, fields)
        self.policy.on_signal(s.session_id, s.kind, self.now)

    # -- requests --------------------------------------------------------------------------

    def _arrive(self, r: SimRequest) -> None:
        inst = self.instances[self.router.route(r, self)]
        r.instance = inst.idx
        self.session_instance[r.session_id] = inst.idx
        self.emit(
            "request_routed",
            self.now,
            {
                "session_id": r.session_id,
                "request_id": f"q{r.index}",
                "instance_id": inst.instance_id,
                "prompt_tokens": r.input_tokens,
                "block_hashes": list(r.hash_ids),
                "block_tokens": self.scenario.block_tokens,
            },
        )
        self._enqueue(inst, r)
        self._try_start(inst)
        if r.admitted_at is None:  # it waits: the engine's queue grew, as its stats say
            self.report_status(inst)
        self.policy.on_arrival(r, self.now)

    def reused_prefix(self, hash_ids: Sequence[int]) -> int:
        n = 0
        for h in hash_ids:
            if h not in self.written:
                break
            n += 1
        return n

    def _enqueue(self, inst: Instance, r: SimRequest) -> None:
        """Join the queue: at its end, or under program-level first-come-first-served (the
        scenario's `admission = "program"`, Continuum's) ahead of every request of a program that
        started later (a session's first arrival is its program's start)."""
        start = self._program_start.setdefault(r.session_id, r.arrival)
        if self.scenario.admission != "program":
            inst.queue.append(r)
            return
        at = len(inst.queue)
        while at > 0 and self._program_start[inst.queue[at - 1].session_id] > start:
            at -= 1
        inst.queue.insert(at, r)

    def _try_start(self, inst: Instance) -> None:
        queue = inst.queue
        while queue and inst.running < self.scenario.max_running_requests:
            if self._admit(inst, queue[0]):
                queue.popleft()
                continue
            # Head-of-line blocked for room. Under hard pins a call whose whole context is held
            # in HBM needs none: admitted ahead, so a pin never waits behind the head it blocks.
            if not inst.hbm.hard_keeps:
                return
            held = next((r for r in queue if self._needs_no_room(inst, r)), None)
            if held is None or not self._admit(inst, held):
                return
            queue.remove(held)

    @staticmethod
    def _needs_no_room(inst: Instance, r: SimRequest) -> bool:
        hbm = inst.hbm
        return all(b in hbm for b in r.hash_ids)

    def _admit(self, inst: Instance, r: SimRequest) -> bool:
        blocks = list(dict.fromkeys(r.hash_ids))
        hbm = inst.hbm
        absent = [b for b in blocks if b not in hbm]
        if len(absent) > hbm.free and not self._make_room(
            inst, len(absent) - hbm.free, set(blocks)
        ):
            return False
        reused_ids = r.hash_ids[: self.reused_prefix(r.hash_ids)]
        hit = self.hit_prefix(inst, reused_ids)
        reused_set = set(reused_ids)
        hit_set = set(reused_ids[:hit])
        # Resident and landed, but after the first block missing: loaded or recomputed again.
        reload = [
            b
            for b in dict.fromkeys(reused_ids[hit:])
            if b in hbm and b not in inst.inflight and b not in hit_set
        ]
        r.admitted_at = self.now
        r.reused_prefix, r.hit_prefix = len(reused_ids), hit
        r.reused_blocks = len(reused_set)
        r.hit_blocks = len(hit_set)
        inst.running += 1
        self.policy.before_admit(r, self.now)
        # Pin what is there; wait for what is already on its way.
        for b in blocks:
            if b in hbm:
                e = hbm.entries[b]
                e.pins += 1
                if e.prefetched and b in hit_set:
                    e.prefetched = False
                hbm.touch(b)
                t = inst.inflight.get(b)
                if t is not None:
                    # A transfer landing in chunks serves it once the chunk holding b is in.
                    upto = None if t.positions is None else t.positions[b] + 1
                    if r.wait_for(t, upto):
                        t.waiters.append(r)
                    if b in reused_set:
                        t.claimed.add(b)
        missing = [b for b in absent if b in reused_set]
        new = [b for b in absent if b not in reused_set]
        for b in absent:
            hbm.insert(b).pins += 1
        if missing or reload:
            self._load_or_recompute(inst, r, missing, reload)
        self.emit(
            "request_started",
            self.now,
            {
                "session_id": r.session_id,
                "request_id": f"q{r.index}",
                "instance_id": inst.instance_id,
            },
        )
        if new:
            self.emit(
                "kv_blocks_stored",
                self.now,
                {
                    "tier": "hbm",
                    "instance_id": inst.instance_id,
                    "block_hashes": new,
                    "block_tokens": self.scenario.block_tokens,
                },
            )
        if not r.waiting_on:
            self._ready(r)
        return True

    def hit_prefix(self, inst: Instance, reused_ids: Sequence[int]) -> int:
        """How many of the leading reused ids an instance's HBM serves: resident and landed, up to
        the first one that is not."""
        n = 0
        for b in reused_ids:
            if b not in inst.hbm or b in inst.inflight:
                break
            n += 1
        return n

    def _load_or_recompute(
        self, inst: Instance, r: SimRequest, missing: list[int], reload: Sequence[int] = ()
    ) -> None:
        """Bring the absent reused blocks (`missing`) into their slots, and the bytes of the
        resident ones the hit prefix cannot reach (`reload`), by load or recompute."""
        moved = [*missing, *reload]
        by_source = self.by_source(inst, moved)
        # The two links run side by side.
        load_seconds = max(
            (
                inst.link(tier).estimate_seconds(len(part) * self.block_bytes, self.now)
                for tier, part in by_source
            ),
            default=0.0,
        )
        recompute_tokens = len(moved) * self.scenario.block_tokens
        recompute_seconds = self.spec.recompute_seconds(recompute_tokens)
        if load_or_recompute(load_seconds, recompute_seconds) == "recompute":
            # The request stalls while its context is recomputed, as it would while loading it;
            # the blocks stay pinned and count as landing (a request that wants them meanwhile
            # waits too) until the recompute is done.
            r.recompute_tokens += recompute_tokens
            t = Transfer(
                next(self._transfer_ids),
                inst.idx,
                missing,
                len(moved) * self.block_bytes,
                False,
                self.now,
            )
            for b in missing:
                inst.inflight[b] = t
                inst.hbm.entries[b].pins += 1
            r.wait_for(t)
            t.waiters.append(r)
            if inst.compute is None:
                self.schedule(self.now + recompute_seconds, RECOMPUTED, (inst.idx, t))
            else:  # its tokens are prefill in the steps it shares with the others
                inst.compute.add("prefill", recompute_tokens, self._recomputed(inst, t), self.now)
            return
        absent = set(missing)
        for tier, chunk in by_source:
            # Only the absent blocks land in a slot; the resident ones' bytes ride along.
            t = self._transfer(
                inst,
                inst.link(tier),
                [b for b in chunk if b in absent],
                prefetch=False,
                nbytes=len(chunk) * self.block_bytes,
            )
            r.wait_for(t)
            t.waiters.append(r)
            r.loaded_bytes += t.nbytes

    def by_source(
        self, inst: Instance, blocks: Sequence[int]
    ) -> list[tuple[SourceTier, list[int]]]:
        """`blocks` by where `inst` loads them from, by the scheduler's rule
        (app/decide/room_and_links.py `split_by_source`): its host tier first, then the pool
        (every block ever computed)."""
        return split_by_source(blocks, held_in(inst.host), held_in(self.written))

    def _compute_due(self, idx: int) -> Callable[[float, int], None]:
        def due(at: float, version: int) -> None:
            self.schedule(at, COMPUTE, (idx, version))

        return due

    def _recomputed(self, inst: Instance, t: Transfer) -> Callable[[], None]:
        def done() -> None:
            t.done_at = self.now
            self._landed(inst, t)
            self._try_start(inst)

        return done

    def _ready(self, r: SimRequest) -> None:
        r.ready_at = self.now
        new_tokens = max(r.input_tokens - r.reused_blocks * self.scenario.block_tokens, 0)
        compute = self.instances[r.instance].compute
        if compute is not None:
            compute.add("prefill", new_tokens, self._first_token(r, compute), self.now)
            return
        prefill_seconds = self.spec.recompute_seconds(new_tokens)
        r.first_token_at = self.now + prefill_seconds
        r.compute_seconds += (
            prefill_seconds + r.output_tokens * self.scenario.decode_seconds_per_token
        )
        self.schedule(self.now + r.compute_seconds, DONE, r)

    def _first_token(self, r: SimRequest, compute: SharedCompute) -> Callable[[], None]:
        def first() -> None:
            r.first_token_at = self.now
            compute.add("decode", r.output_tokens, lambda: self._done_now(r), self.now)

        return first

    def _done_now(self, r: SimRequest) -> None:
        r.compute_seconds = self.now - (r.ready_at if r.ready_at is not None else self.now)
        self.schedule(self.now, DONE, r)

    def _finish(self, r: SimRequest) -> None:
        inst = self.instances[r.instance]
        r.finished_at = self.now
        inst.running -= 1
        inst.busy_seconds += r.finished_at - r.admitted_at  # type: ignore[operator]
        # Tail first, as vLLM frees a request's blocks: the head ends most recently used.
        for b in reversed(list(dict.fromkeys(r.hash_ids))):
            if b in inst.hbm:
                inst.hbm.unpin(b)
                inst.hbm.touch(b)
        self.written.update(r.hash_ids)
        self.emit(
            "request_finished",
            self.now,
            {
                "session_id": r.session_id,
                "request_id": f"q{r.index}",
                "instance_id": inst.instance_id,
                "output_tokens": r.output_tokens,
                "context_tokens": r.input_tokens + r.output_tokens,
                "block_hashes": list(r.hash_ids),
                "block_tokens": self.scenario.block_tokens,
            },
        )
        self.emit(
            "kv_blocks_stored",
            self.now,
            {
                "tier": "pool",
                "instance_id": None,
                "block_hashes": list(r.hash_ids),
                "block_tokens": self.scenario.block_tokens,
            },
        )
        self.report_status(inst)
        self.policy.on_finished(r, self.now)
        self._try_start(inst)

    def report_status(self, inst: Instance) -> None:
        """The instance's room and load, as an engine reports them (here: at every finish, when a
        request must wait, and when a policy asks), so a scheduler knows where a prefetch fits
        and what waits."""
        self.emit(
            "instance_status",
            self.now,
            {
                "instance_id": inst.instance_id,
                "free_kv_bytes": inst.hbm.free * self.block_bytes,
                "total_kv_bytes": inst.hbm.capacity * self.block_bytes,
                "queue_depth": len(inst.queue),
                "running_requests": inst.running,
            },
        )

    # -- transfers and room ----------------------------------------------------------------

    def _transfer(
        self,
        inst: Instance,
        link: Link,
        blocks: list[int],
        *,
        prefetch: bool,
        nbytes: int | None = None,
    ) -> Transfer:
        """Move `blocks` into their (taken) slots; `nbytes`, when given, is what crosses the link
        (more than the blocks when resident ones are loaded again)."""
        t = Transfer(
            next(self._transfer_ids),
            inst.idx,
            blocks,
            len(blocks) * self.block_bytes if nbytes is None else nbytes,
            prefetch,
            self.now,
        )
        chunk_blocks = self.scenario.chunk_blocks
        if prefetch and self.scenario.landing == "chunked" and len(blocks) > chunk_blocks:
            t.chunk_bytes = chunk_blocks * self.block_bytes
            t.positions = {b: i for i, b in enumerate(blocks)}
        for b in blocks:
            inst.inflight[b] = t
            inst.hbm.entries[b].pins += 1  # pinned while landing
        link.add(t, self.now)
        self._schedule_link(inst, link)
        return t

    def _schedule_link(self, inst: Instance, link: Link) -> None:
        at = link.next_completion()
        if at is not None:
            self.schedule(max(at, self.now), LINK, (inst.idx, link is inst.host_link, link.version))

    def _link_due(self, idx: int, host: bool, version: int) -> None:
        inst = self.instances[idx]
        link = inst.host_link if host else inst.pool_link
        if version != link.version:
            return  # the link changed since this completion was predicted
        for t in link.chunks_due(self.now):
            self._land_chunks(inst, t)
        for t in link.complete_due(self.now):
            self._landed(inst, t)
        self._schedule_link(inst, link)
        self._try_start(inst)

    def _land_blocks(self, inst: Instance, t: Transfer, upto: int) -> None:
        """The transfer's blocks up to `upto` (of its list) are in HBM: unpin them and say so."""
        landed = t.blocks[t.landed_blocks : upto]
        t.landed_blocks = upto
        for b in landed:
            if inst.inflight.get(b) is t:
                del inst.inflight[b]
            e = inst.hbm.entries.get(b)
            if e is not None:
                inst.hbm.unpin(b)
                if t.prefetch and b not in t.claimed:
                    e.prefetched = True
        if t.prefetch:  # a prefetch's bytes are its blocks'
            self.totals.bytes_prefetched += len(landed) * self.block_bytes
        if landed:  # a load of resident blocks' bytes alone stores nothing new
            self.emit(
                "kv_blocks_stored",
                self.now,
                {
                    "tier": "hbm",
                    "instance_id": inst.instance_id,
                    "block_hashes": landed,
                    "block_tokens": self.scenario.block_tokens,
                },
            )

    def _land_chunks(self, inst: Instance, t: Transfer) -> None:
        """More chunks of a transfer have crossed: land their blocks, wake who needed no more."""
        upto = min(t.chunks_landed * self.scenario.chunk_blocks, len(t.blocks))
        self._land_blocks(inst, t, upto)
        waiting = []
        for r in t.waiters:
            if r.waiting_on[t.transfer_id] > upto:  # type: ignore[attr-defined]
                waiting.append(r)
                continue
            del r.waiting_on[t.transfer_id]  # type: ignore[attr-defined]
            if not r.waiting_on:  # type: ignore[attr-defined]
                self._ready(r)  # type: ignore[arg-type]
        t.waiters = waiting

    def _landed(self, inst: Instance, t: Transfer) -> None:
        """A transfer's (or a recompute's) blocks are all in HBM: unpin those not landed yet,
        wake who waited."""
        self._land_blocks(inst, t, len(t.blocks))
        for r in t.waiters:
            r.waiting_on.pop(t.transfer_id, None)  # type: ignore[attr-defined]
            if not r.waiting_on:  # type: ignore[attr-defined]
                self._ready(r)  # type: ignore[arg-type]

    def _make_room(
        self, inst: Instance, n: int, keep: set[int] | frozenset[int] = frozenset()
    ) -> bool:
        victims = inst.hbm.choose_victims(n, self.now, exclude=keep)
        if victims is None:
            return False
        for b in victims:
            e = inst.hbm.remove(b)
            if e is not None and e.prefetched:
                self.totals.bytes_prefetched_unused += self.block_bytes
        self.totals.bytes_evicted += len(victims) * self.block_bytes
        self.emit(
            "kv_blocks_removed",
            self.now,
            {"tier": "hbm", "instance_id": inst.instance_id, "block_hashes": victims},
        )
        if inst.host is not None:  # demoted to host DRAM rather than dropped
            self._to_host(inst, inst.host, victims)
        return True

    def _to_host(self, inst: Instance, host: BlockCache, blocks: Sequence[int]) -> None:
        """Blocks HBM evicted go to host DRAM, its LRU making room. What changed there is
        reported as an engine with a CPU tier reports it (vLLM's BlockStored and BlockRemoved
        with medium CPU), so the scheduler's store knows what it may load from the host."""
        # Net changes only: a block the host evicts and takes back within one batch stays put.
        stored: dict[int, None] = {}
        removed: dict[int, None] = {}
        for b in blocks:
            if b in host:
                host.touch(b)
                continue
            if host.free < 1:
                lru = host.choose_victims(1, self.now)
                if lru:
                    gone = lru[0]
                    host.remove(gone)
                    if gone in stored:
                        del stored[gone]
                    else:
                        removed[gone] = None
            if host.free >= 1:
                host.insert(b)
                if b in removed:
                    del removed[b]
                else:
                    stored[b] = None
        place = {"tier": "host", "instance_id": inst.instance_id}
        if removed:
            self.emit("kv_blocks_removed", self.now, {**place, "block_hashes": list(removed)})
        if stored:
            self.emit(
                "kv_blocks_stored",
                self.now,
                {
                    **place,
                    "block_hashes": list(stored),
                    "block_tokens": self.scenario.block_tokens,
                },
            )

    # -- what policies may do --------------------------------------------------------------

    def prefetch(self, idx: int, blocks: Sequence[int], source: str | None = None) -> int:
        """Start moving blocks into an instance's HBM; returns how many were ordered.

        Blocks already there or on their way, and blocks never computed, are skipped; room is
        made by the cache's eviction order, and nothing is ordered when there is no room.
        `source`, the tier an order names: a pool order reads the pool, over the link the
        scheduler booked, even for blocks the host took since; a host order reads the host for
        what it still holds and the pool for the rest; None (a policy's own prefetch): the host
        for what it holds, then the pool.
        """
        inst = self.instances[idx]
        wanted = [b for b in dict.fromkeys(blocks) if b in self.written and b not in inst.hbm]
        if not wanted:
            return 0
        if len(wanted) > inst.hbm.free and not self._make_room(
            inst, len(wanted) - inst.hbm.free, set(wanted)
        ):
            return 0
        for b in reversed(wanted):  # lands as a finished request leaves it: head most recent
            inst.hbm.insert(b)
        on_host = held_in(None if source == "pool" else inst.host)
        for tier, part in split_by_source(wanted, on_host, held_in(self.written)):
            self._transfer(inst, inst.link(tier), part, prefetch=True)
        self.totals.prefetch_orders += 1
        return len(wanted)

    def keep(self, idx: int, blocks: Sequence[int], until: float) -> None:
        """Advice: evict these blocks only after every unadvised block, until `until`."""
        inst = self.instances[idx]
        hbm = inst.hbm
        for b in blocks:
            hbm.keep(b, until)
        if hbm.hard_keeps:  # its end frees room a queued request may wait for
            self.call_at(until, lambda: self._try_start(inst))

    def clear_advice(self, idx: int) -> None:
        """Advice withdrawn: the instance's keeps and demotions lapse (plain LRU again)."""
        self.instances[idx].hbm.clear_advice()

    def demote(self, idx: int, blocks: Sequence[int]) -> None:
        """Advice: evict these blocks first."""
        hbm = self.instances[idx].hbm
        for b in blocks:
            hbm.demote(b)

    def unkeep(self, idx: int, blocks: Sequence[int]) -> None:
        """A keep withdrawn: these blocks go in plain LRU order again."""
        inst = self.instances[idx]
        for b in blocks:
            inst.hbm.unkeep(b)
        if inst.hbm.hard_keeps:
            self._try_start(inst)

    def undemote(self, idx: int, blocks: Sequence[int]) -> None:
        """A demotion withdrawn: these blocks go back to their places in LRU order."""
        hbm = self.instances[idx].hbm
        for b in blocks:
            hbm.undemote(b)
