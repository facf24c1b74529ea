"""The bench's traffic: routers' conversations and their instances' HBM, as events.

Each event connection is a router with its own shard of the cluster (its conversations and
instances). A bounded population of conversations comes back turn after turn: a turn is
request_routed (the prompt's block hashes), request_started, kv_blocks_stored for the blocks the
prefill computed, and later request_finished (the context's block hashes) and kv_blocks_stored
for the output's full blocks. Each instance's HBM is an LRU of `hbm_blocks` blocks: what falls
out is reported with kv_blocks_removed, as engines do. Instances report instance_status now and
then. A conversation ends after its turns; half the time the router says session_closed, and a
new conversation takes its place. Every event is stamped with the wall clock, so the scoring
loop and the scheduler see a live cluster.
"""

from __future__ import annotations

import math
import random
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import orjson

BLOCK_TOKENS = 512
BYTES_PER_TOKEN = 327_680  # the service's default (Llama-3.1-70B bf16)
BYTES_PER_BLOCK = BYTES_PER_TOKEN * BLOCK_TOKENS


class _Conv:
    __slots__ = (
        "blocks",
        "instance_id",
        "request_id",
        "session_id",
        "slot",
        "tokens",
        "turn",
        "turns_left",
    )

    def __init__(
        self,
        slot: int,
        session_id: str,
        instance_id: str,
        tokens: int,
        blocks: list[int],
        turns: int,
    ) -> None:
        self.slot = slot
        self.session_id = session_id
        self.instance_id = instance_id
        self.tokens = tokens
        self.blocks = blocks
        self.turns_left = turns
        self.turn = 0
        self.request_id = ""


class Held(NamedTuple):
    """What the store may hold from one shard's events (Shard's properties of the same names)."""

    sessions_within_retention: int = 0
    tombstones_alive: int = 0
    tombstones_held_at_most: int = 0


class Tombstones:
    """The tombstones one location's events leave in the store, worked out from those events by
    the store's rule (docs/decisions.md 13): a removal leaves one, a later store of the block
    drops it, and it is in force while its ts is within `window` of the location's newest event.

    `alive`: those in force. `aging`: older, but within two windows: the memory store drops its
    tombstones a generation at a time, so it may still hold these (it holds between one and two
    windows). Past two windows nothing holds them. Both are ordered by removal ts, which is this
    shard's clock and only moves forward, so expiring looks at the front only.

    Written by the shard's generator thread; other threads read only the lengths."""

    __slots__ = ("aging", "alive", "window")

    def __init__(self, window: float) -> None:
        self.alive: OrderedDict[int, float] = OrderedDict()
        self.aging: OrderedDict[int, float] = OrderedDict()
        self.window = window

    def advance(self, ts: float) -> None:
        """The location's newest event is now at `ts`."""
        alive, aging = self.alive, self.aging
        cutoff = ts - self.window
        while alive:
            h, t = next(iter(alive.items()))
            if t >= cutoff:
                break
            alive.popitem(last=False)
            aging[h] = t
        cutoff -= self.window
        while aging and next(iter(aging.values())) < cutoff:
            aging.popitem(last=False)

    def removed(self, hashes: Iterable[int], ts: float) -> None:
        for h in hashes:
            self.alive[h] = ts

    def stored(self, h: int) -> None:
        if self.alive.pop(h, None) is None:
            self.aging.pop(h, None)


class Shard:
    """One router's conversations and instances, generating events as they happen (wall clock).

    Not thread-safe: one generator thread owns it. `hintable` (slot -> a session id the service
    has acknowledged) is written by the poster after each 200 and read by the hint threads, and
    `acked` (what the store may hold, as of the last batch acknowledged) by the sampler.
    `reorder_window` and `session_retention` are the service's KVP_REORDER_WINDOW_SECONDS and
    KVP_SESSION_RETENTION_SECONDS, for the counts of what the store may hold.
    """

    def __init__(
        self,
        *,
        seed: int,
        sessions: int,
        instance_ids: Sequence[str],
        hbm_blocks: int,
        close_share: float = 0.5,
        kv_events: bool = True,
        status_events: bool = True,
        reorder_window: float = math.inf,
        session_retention: float = math.inf,
    ) -> None:
        self.rng = random.Random(seed)
        self._id_prefix = str(uuid.uuid4())[:23]  # unique per run, so no two runs' ids collide
        self._next_id = 0
        self.instances = list(instance_ids)
        self.hbm_blocks = hbm_blocks
        self.close_share = close_share
        self.kv_events = kv_events
        self.status_events = status_events
        # System prompts shared by many conversations: their full blocks hash alike everywhere.
        self._system = []
        for _ in range(50):
            tokens = self.rng.randint(600, 3000)
            self._system.append(
                (tokens, [self.rng.getrandbits(63) for _ in range(tokens // BLOCK_TOKENS)])
            )
        self.hbm: dict[str, OrderedDict[int, None]] = {i: OrderedDict() for i in self.instances}
        self.tombstones: dict[str, Tombstones] = {
            i: Tombstones(reorder_window) for i in self.instances
        }
        self.session_retention = session_retention
        self._begun = 0  # conversations of the population that have sent an event
        self._ended: deque[float] = (
            deque()
        )  # the last event ts of each ended one, within the retention
        self.running_on: Counter[str] = Counter()
        self.idle: list[_Conv] = []
        self.running: deque[_Conv] = deque()
        self.running_target = max(1, sessions // 20)
        self.hintable: list[str | None] = [None] * sessions
        self.sessions_started = 0
        self.sessions_closed = 0
        self.sessions_abandoned = 0
        self.events = Counter[str]()
        self._last_ts = 0.0
        self._out: list[dict[str, Any]] = []
        self._publish: list[tuple[int, str]] = []
        self.acked = Held()
        for slot in range(sessions):
            self.idle.append(self._new_conv(slot))

    @property
    def tombstones_alive(self) -> int:
        return sum(len(t.alive) for t in self.tombstones.values())

    @property
    def tombstones_held_at_most(self) -> int:
        return sum(len(t.alive) + len(t.aging) for t in self.tombstones.values())

    @property
    def sessions_within_retention(self) -> int:
        """At most the sessions the store may track (docs/decisions.md 13): every conversation
        under way (as if none idled past the retention) and those ended within it."""
        return self._begun + len(self._ended)

    def _ts(self) -> float:
        # Wall clock, strictly increasing: a removal never lands before the store it undoes.
        ts = self._last_ts = max(time.time(), self._last_ts + 1e-6)
        return ts

    def _event_id(self) -> str:
        self._next_id += 1
        return f"{self._id_prefix}-{self._next_id:012x}"

    def _new_conv(self, slot: int) -> _Conv:
        rng = self.rng
        self.sessions_started += 1
        tokens, system_blocks = rng.choice(self._system)
        sid = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        # Mostly short conversations, some long (mean ~5 turns).
        turns = min(30, 2 + int(rng.expovariate(1 / 3)))
        return _Conv(slot, sid, rng.choice(self.instances), tokens, list(system_blocks), turns)

    def _grow(self, conv: _Conv, tokens: int) -> list[int]:
        """Adds tokens to the context; returns the hashes of the full blocks that makes."""
        conv.tokens = min(conv.tokens + tokens, 131_072)
        n = conv.tokens // BLOCK_TOKENS - len(conv.blocks)
        new = [self.rng.getrandbits(63) for _ in range(max(0, n))]
        conv.blocks.extend(new)
        return new

    def _emit(self, event: dict[str, Any]) -> None:
        event["event_id"] = self._event_id()
        self.events[event["type"]] += 1
        self._out.append(event)

    def store(self, instance_id: str, hashes: list[int]) -> None:
        """The engine stored these blocks in HBM; what falls out of its LRU is removed."""
        lru = self.hbm[instance_id]
        new = []
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                new.append(h)
        if not new or not self.kv_events:
            return
        tomb = self.tombstones[instance_id]
        ts = self._ts()
        self._emit(
            {
                "type": "kv_blocks_stored",
                "ts": ts,
                "tier": "hbm",
                "instance_id": instance_id,
                "block_hashes": new,
                "block_tokens": BLOCK_TOKENS,
            }
        )
        tomb.advance(ts)
        for h in new:
            tomb.stored(h)
        over = len(lru) - self.hbm_blocks
        if over > 0:
            gone = [lru.popitem(last=False)[0] for _ in range(over)]
            ts = self._ts()
            self._emit(
                {
                    "type": "kv_blocks_removed",
                    "ts": ts,
                    "tier": "hbm",
                    "instance_id": instance_id,
                    "block_hashes": gone,
                }
            )
            tomb.advance(ts)
            tomb.removed(gone, ts)

    def _start_turn(self) -> None:
        rng, idle = self.rng, self.idle
        i = rng.randrange(len(idle))
        conv = idle[i]
        idle[i] = idle[-1]
        idle.pop()
        if conv.turn > 0 and rng.random() < 0.1:  # the router moves it now and then
            conv.instance_id = rng.choice(self.instances)
        self._grow(
            conv, max(10, min(8000, int(rng.lognormvariate(5.5, 1.0))))
        )  # the user's message
        if conv.turn == 0:  # hintable once this, its first event, is acknowledged
            self._publish.append((conv.slot, conv.session_id))
            self._begun += 1
        conv.turn += 1
        conv.request_id = f"chatcmpl-{rng.getrandbits(128):032x}"
        common = {
            "session_id": conv.session_id,
            "request_id": conv.request_id,
            "instance_id": conv.instance_id,
        }
        self._emit(
            {
                "type": "request_routed",
                "ts": self._ts(),
                **common,
                "prompt_tokens": conv.tokens,
                "block_hashes": list(conv.blocks),
                "block_tokens": BLOCK_TOKENS,
            }
        )
        self._emit({"type": "request_started", "ts": self._ts(), **common})
        self.store(conv.instance_id, conv.blocks)  # the prefill computed what was missing
        self.running.append(conv)
        self.running_on[conv.instance_id] += 1

    def _finish_turn(self) -> None:
        rng = self.rng
        conv = self.running.popleft()
        self.running_on[conv.instance_id] -= 1
        output = max(1, min(4000, int(rng.lognormvariate(5.3, 0.9))))
        new = self._grow(conv, output)
        self._emit(
            {
                "type": "request_finished",
                "ts": self._ts(),
                "session_id": conv.session_id,
                "request_id": conv.request_id,
                "instance_id": conv.instance_id,
                "output_tokens": output,
                "context_tokens": conv.tokens,
                "block_hashes": list(conv.blocks),
                "block_tokens": BLOCK_TOKENS,
            }
        )
        if new:
            self.store(conv.instance_id, new)
        conv.turns_left -= 1
        if conv.turns_left > 0:
            self.idle.append(conv)
            return
        if rng.random() < self.close_share:
            self._emit({"type": "session_closed", "ts": self._ts(), "session_id": conv.session_id})
            self.sessions_closed += 1
        else:  # the user just never comes back
            self.sessions_abandoned += 1
        self._begun -= 1
        self._ended.append(self._last_ts)
        cutoff = self._last_ts - self.session_retention
        while self._ended[0] < cutoff:
            self._ended.popleft()
        self.idle.append(self._new_conv(conv.slot))

    def _status(self) -> None:
        rng = self.rng
        inst = rng.choice(self.instances)
        used = len(self.hbm[inst])
        running = self.running_on[inst]
        self._emit(
            {
                "type": "instance_status",
                "ts": self._ts(),
                "instance_id": inst,
                "free_kv_bytes": max(0, self.hbm_blocks - used) * BYTES_PER_BLOCK,
                "total_kv_bytes": self.hbm_blocks * BYTES_PER_BLOCK,
                "queue_depth": max(0, running - 64),
                "running_requests": min(running, 64),
            }
        )

    def step(self) -> None:
        if len(self.running) >= self.running_target or not self.idle:
            self._finish_turn()
        else:
            self._start_turn()
        if self.status_events and self.rng.random() < 0.05:
            self._status()

    def take(self) -> list[dict[str, Any]]:
        """The events made so far and not taken yet."""
        out, self._out = self._out, []
        return out

    def batch(self, size: int) -> tuple[bytes, int, list[tuple[int, str]], Held]:
        """The next `size` events as a POST /v1/events body; the sessions it makes known; what
        the store may hold once it has them (the events made past the batch, a step's at most,
        counted too)."""
        while len(self._out) < size:
            self.step()
        events, self._out = self._out[:size], self._out[size:]
        publish, self._publish = self._publish, []
        held = Held(
            self.sessions_within_retention, self.tombstones_alive, self.tombstones_held_at_most
        )
        return orjson.dumps({"events": events}), len(events), publish, held


def make_shards(
    *, connections: int, sessions: int, instances: int, hbm_blocks: int, seed: int, **kw: Any
) -> list[Shard]:
    shards = []
    for c in range(connections):
        ids = [f"vllm-decode-{n:02d}" for n in range(instances) if n % connections == c]
        shards.append(
            Shard(
                seed=seed * 1000 + c,
                sessions=max(1, sessions // connections),
                instance_ids=ids,
                hbm_blocks=hbm_blocks,
                **kw,
            )
        )
    return shards
