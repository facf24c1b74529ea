"""Mooncake Store as the agent's tier: orders become replica copies, soft pins and replica clears.

The instance's HBM side is one Mooncake segment (by default the one this agent's own store client
mounts; `target_segment` names another, e.g. the engine's). The pool is every other segment.

- prefetch: `create_copy_task(key, [segment])` per block missing there, all at once, then
  `query_task` until each is SUCCESS or FAILED. A copy, not a move: the pool keeps its replica,
  so a later demote can drop the HBM-side one without losing the block. Not a `get`: a get lands
  bytes in this process, where no engine reads them and the master does not know they are.
  Time to last byte: from the first task created to the poll that saw the last one succeed.
- pin: the block's bytes re-put (`upsert`) with a soft pin for the order's TTL (the wheel sets
  pins only on a put). It needs a replica on the segment, as a pin of the buffer tier does.
- demote: `create_move_task(key, segment, source)` for each block this agent copied there, back
  onto the segment the copy came from, which holds a replica already: the HBM side's replica
  goes, the pool's stays. (`batch_replica_clear` would be one call, but the master lets only the
  client that put a key clear its replicas.)

An unreachable master (a health check that says so, an RPC error) is retried `attempts` times,
`retry_seconds` apart, then the order fails with the reason; `status()` counts it. Nothing else
stops: the next order tries again, and the store client reconnects by itself when the master is
back.

Keys: see `store_key`. docs/integrations/mooncake.md says more, with measurements.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote

from kvprefetch_client.agent.tier import Done, Tier, name_blocks
from kvprefetch_client.errors import KvpError
from kvprefetch_client.events import BlockHash
from kvprefetch_client.orders import Order

log = logging.getLogger("kvprefetch.agent.mooncake")

T = TypeVar("T")

# Mooncake's ErrorCode values (mooncake-store types.h); the Python binding returns plain ints.
OBJECT_NOT_FOUND = -704
OBJECT_HAS_REPLICATION_TASK = -708
REPLICA_ALREADY_EXISTS = -711
RPC_FAIL = -900
RPC_TIMEOUT = -901
_UNREACHABLE_CODES = frozenset({RPC_FAIL, RPC_TIMEOUT})
# A task that failed so is worth creating again: another task held the object (one a dead agent
# left), or the master gave up waiting on it.
_RETRIED_TASK_FAILURES = re.compile(r"OBJECT_HAS_REPLICATION_TASK|timeout", re.IGNORECASE)
_HEALTH_MASTER_UNREACHABLE = 2  # MooncakeDistributedStore.health_check()
# Segment names remembered as landed, for the status file.
_LANDED_KEPT = 10_000


def store_key(namespace: str, block_hash: BlockHash) -> str:
    """`kvp/<namespace>/i/<decimal>` for an int hash, `kvp/<namespace>/s/<percent-encoded>` for
    a string one: ints and strings never meet (46 and "46" are different blocks), and percent
    encoding (of everything but letters, digits and `_.-~`) is one-to-one, so no two hashes share
    a key and no key holds a '/' of the hash's own."""
    if isinstance(block_hash, int):
        return f"kvp/{namespace}/i/{block_hash}"
    return f"kvp/{namespace}/s/{quote(block_hash, safe='')}"


@dataclass(frozen=True, slots=True)
class MooncakeSettings:
    """Where the store is and how this agent joins it; `from_environ` reads KVP_MOONCAKE_*."""

    master_address: str = "127.0.0.1:50051"
    metadata_url: str = "http://127.0.0.1:8080/metadata"
    local_host: str = "127.0.0.1"  # this client's name in the cluster; host or host:port
    segment_bytes: int = 1 << 30  # the segment this client mounts (the HBM side by default)
    buffer_bytes: int = 64 << 20  # the client's local transfer buffer
    protocol: str = "tcp"
    device: str = ""  # RDMA devices; empty picks them (RDMA) or needs none (TCP)
    namespace: str = "default"  # the model or deployment: part of every key
    target_segment: str = ""  # the HBM-side segment, when it is not this client's own
    task_timeout_seconds: float = 30.0
    poll_seconds: float = 0.005
    attempts: int = 3
    retry_seconds: float = 0.5

    def __post_init__(self) -> None:
        if not self.namespace or "/" in self.namespace:
            raise ValueError(f"mooncake namespace {self.namespace!r}: non-empty, without '/'")
        if self.attempts < 1:
            raise ValueError("mooncake attempts: at least 1")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> MooncakeSettings:
        """KVP_MOONCAKE_MASTER, _METADATA_URL, _LOCAL_HOST, _SEGMENT_BYTES, _BUFFER_BYTES,
        _PROTOCOL, _DEVICE, _NAMESPACE, _TARGET_SEGMENT, _TASK_TIMEOUT_SECONDS, _ATTEMPTS,
        _RETRY_SECONDS; the defaults above where unset."""
        env = os.environ if environ is None else environ
        d = cls()

        def get(name: str, default: T, kind: Callable[[str], T]) -> T:
            text = env.get(f"KVP_MOONCAKE_{name}")
            return default if text is None or text == "" else kind(text)

        return cls(
            master_address=get("MASTER", d.master_address, str),
            metadata_url=get("METADATA_URL", d.metadata_url, str),
            local_host=get("LOCAL_HOST", d.local_host, str),
            segment_bytes=get("SEGMENT_BYTES", d.segment_bytes, int),
            buffer_bytes=get("BUFFER_BYTES", d.buffer_bytes, int),
            protocol=get("PROTOCOL", d.protocol, str),
            device=get("DEVICE", d.device, str),
            namespace=get("NAMESPACE", d.namespace, str),
            target_segment=get("TARGET_SEGMENT", d.target_segment, str),
            task_timeout_seconds=get("TASK_TIMEOUT_SECONDS", d.task_timeout_seconds, float),
            attempts=get("ATTEMPTS", d.attempts, int),
            retry_seconds=get("RETRY_SECONDS", d.retry_seconds, float),
        )


class MooncakeError(KvpError):
    """The store cannot be used (the wheel missing, its setup refused)."""


class _Unreachable(KvpError):
    """The master did not answer this time; worth another try."""


class MooncakeTier(Tier):
    """A Tier (kvprefetch_client.agent.tier) over a Mooncake Store client.

    The client is set up on first use, so an agent whose master is away starts, and its orders
    fail with the reason until the master answers.
    """

    def __init__(
        self,
        instance_id: str,
        settings: MooncakeSettings,
        *,
        timer: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        try:
            import mooncake.store  # noqa: F401  (fail at start, not at the first order)
        except ImportError as exc:
            raise MooncakeError(
                "--tier mooncake needs the Mooncake wheel: pip install "
                "'kvprefetch-client[mooncake]' (and Debian's libibverbs1): "
                f"{exc}"
            ) from exc
        self.instance_id = instance_id
        self.settings = settings
        self._timer = timer
        self._sleep = sleep
        self._store: Any = None
        self.segment = settings.target_segment
        self.where = f"hbm@{instance_id} (mooncake segment {self.segment or '(its own)'})"
        # What this agent copied onto the segment: hash -> (bytes, the segment it came from).
        self._landed: OrderedDict[BlockHash, tuple[int, str]] = OrderedDict()
        self._hash_of: dict[str, BlockHash] = {}
        self.master_unreachable_failures = 0  # orders failed for it, after their retries
        self.rpc_errors = 0  # tries that found the master away
        self.last_error: str | None = None

    # -- the store client ---------------------------------------------------------------------

    def _client(self) -> Any:
        if self._store is not None:
            return self._store
        from mooncake.store import MooncakeDistributedStore

        s = self.settings
        store = MooncakeDistributedStore()
        rc = store.setup(
            s.local_host,
            s.metadata_url,
            s.segment_bytes,
            s.buffer_bytes,
            s.protocol,
            s.device,
            s.master_address,
        )
        if rc != 0:
            raise _Unreachable(f"store setup returned {rc}")
        self._store = store
        if not s.target_segment:
            self.segment = store.get_hostname()
            self.where = f"hbm@{self.instance_id} (mooncake segment {self.segment})"
        log.info(
            "mooncake client %s joined master %s; HBM side is segment %s",
            store.get_hostname(),
            s.master_address,
            self.segment,
        )
        return store

    def _retrying(self, what: str, step: Callable[[Any], T]) -> T:
        """`step(store)`, tried again while the master is away; _Unreachable after the last."""
        last = ""
        for attempt in range(1, self.settings.attempts + 1):
            try:
                store = self._client()
                if store.health_check() == _HEALTH_MASTER_UNREACHABLE:
                    raise _Unreachable("health_check: master unreachable")
                return step(store)
            except _Unreachable as exc:
                self.rpc_errors += 1
                last = str(exc)
                if attempt < self.settings.attempts:
                    self._sleep(self.settings.retry_seconds)
        reason = (
            f"mooncake master {self.settings.master_address} unreachable after "
            f"{self.settings.attempts} tries ({what}: {last})"
        )
        raise _Unreachable(reason)

    def _fail_unreachable(self, exc: _Unreachable) -> Done:
        self.master_unreachable_failures += 1
        self.last_error = str(exc)
        return Done(failure=str(exc))

    def _keys(self, hashes: Sequence[BlockHash]) -> list[str]:
        return [store_key(self.settings.namespace, h) for h in hashes]

    def _replicas(self, store: Any, keys: list[str]) -> dict[str, list[tuple[str, int]]]:
        """Each key's complete memory replicas as (segment, bytes)."""
        from mooncake.store import ReplicaStatus

        out: dict[str, list[tuple[str, int]]] = {}
        for key, descs in store.batch_get_replica_desc(keys).items():
            out[key] = [
                (
                    d.get_memory_descriptor().buffer_descriptor.transport_endpoint,
                    d.get_memory_descriptor().buffer_descriptor.size,
                )
                for d in descs
                if d.is_memory_replica() and d.status == ReplicaStatus.COMPLETE
            ]
        return out

    def _present(self, hashes: list[BlockHash]) -> tuple[list[BlockHash], dict[str, Any]]:
        """(the hashes the store lacks, each present key's replicas); retried."""
        keys = self._keys(hashes)

        def look(store: Any) -> tuple[list[BlockHash], dict[str, Any]]:
            exist = store.batch_is_exist(keys)
            if any(e < 0 for e in exist):
                raise _Unreachable("batch_is_exist answered an error")
            absent = [h for h, e in zip(hashes, exist, strict=True) if e == 0]
            present = [k for k, e in zip(keys, exist, strict=True) if e == 1]
            return absent, self._replicas(store, present)

        return self._retrying("looking the blocks up", look)

    # -- orders -------------------------------------------------------------------------------

    def prefetch(self, order: Order, now: float) -> Done:
        wanted = list(dict.fromkeys(order.block_hashes))
        try:
            absent, replicas = self._present(wanted)
        except _Unreachable as exc:
            return self._fail_unreachable(exc)
        if absent:
            return Done(failure=f"block {name_blocks(absent)} not in the mooncake store")
        sizes: dict[BlockHash, int] = {}
        sources: dict[BlockHash, str] = {}
        for h, key in zip(wanted, self._keys(wanted), strict=True):
            held = replicas.get(key, [])
            sizes[h] = held[0][1] if held else 0
            if not any(seg == self.segment for seg, _ in held):
                sources[h] = held[0][0] if held else ""
        try:
            landed, seconds, failure = self._run_tasks(
                "copy", list(sources), lambda st, key: st.create_copy_task(key, [self.segment])
            )
        except _Unreachable as exc:
            return self._fail_unreachable(exc)
        landed.sort(key=wanted.index)
        for h in landed:
            self._remember(h, sizes[h], sources[h])
        if failure is None and order.ttl_seconds is not None:
            failure = self.pin(order, now).failure
        return Done(sum(sizes[h] for h in landed), seconds, failure, landed)

    def _run_tasks(
        self,
        kind: str,
        hashes: list[BlockHash],
        create: Callable[[Any, str], tuple[Any, int]],
    ) -> tuple[list[BlockHash], float, str | None]:
        """Create a task per block (all at once: the master runs them side by side), then query
        them until each ends: (the blocks done, seconds from the first created to the last seen
        done, a failure or None).

        A block with another replication task under way (one a dead agent left, until the
        master times it out) is tried again every `retry_seconds`, until `task_timeout_seconds`.
        """
        t0 = self._timer()
        last_done = t0
        deadline = t0 + self.settings.task_timeout_seconds
        done: list[BlockHash] = []
        tasks: dict[BlockHash, Any] = {}
        to_create: dict[BlockHash, float] = dict.fromkeys(hashes, t0)  # hash -> when to try
        busy: dict[BlockHash, str] = {}
        while to_create or tasks:
            now = self._timer()
            for h, when in list(to_create.items()):
                if when > now:
                    continue
                del to_create[h]
                key = store_key(self.settings.namespace, h)

                def make(store: Any, key: str = key) -> tuple[Any, int]:
                    task, err = create(store, key)
                    if err in _UNREACHABLE_CODES:
                        raise _Unreachable(f"create {kind} task: error {err}")
                    return task, err

                task, err = self._retrying(f"creating a {kind} task", make)
                if err == REPLICA_ALREADY_EXISTS:
                    done.append(h)  # someone did it meanwhile
                elif err == OBJECT_HAS_REPLICATION_TASK:
                    busy[h] = f"error {err}"
                    to_create[h] = now + self.settings.retry_seconds
                elif err != 0:
                    return done, 0.0, f"{kind} of block {h!r} ({key}) refused: error {err}"
                else:
                    tasks[h] = task
            for h, task in list(tasks.items()):
                state, message = self._task_state(self._store, task)
                if state == "SUCCESS":
                    del tasks[h]
                    done.append(h)
                    last_done = self._timer()
                elif state == "FAILED" and _RETRIED_TASK_FAILURES.search(message):
                    log.info("%s of block %r: %s; trying again", kind, h, message)
                    del tasks[h]
                    busy[h] = message
                    to_create[h] = self._timer() + self.settings.retry_seconds
                elif state == "FAILED":
                    return done, last_done - t0, f"{kind} of block {h!r} failed: {message}"
            if to_create or tasks:
                if self._timer() > deadline:
                    left = list(tasks) + list(to_create)
                    why = "; another replication task holds it" if set(left) & set(busy) else ""
                    return (
                        done,
                        last_done - t0,
                        f"{kind} of block {name_blocks(left)} not done after "
                        f"{self.settings.task_timeout_seconds:g} s{why}",
                    )
                self._sleep(self.settings.poll_seconds)
        return done, last_done - t0, None

    def _task_state(self, store: Any, task: Any) -> tuple[str, str]:
        """("PENDING" | "PROCESSING" | "SUCCESS" | "FAILED", message); an unanswered query is
        PENDING (the deadline bounds it)."""
        response, err = store.query_task(task)
        if err != 0 or response is None:
            self.rpc_errors += err in _UNREACHABLE_CODES
            return "PENDING", f"query_task: error {err}"
        return response.status.name, response.message

    def pin(self, order: Order, now: float) -> Done:
        from mooncake.store import ReplicateConfig, SoftPinAction

        assert order.ttl_seconds is not None  # the Order model requires it for a pin
        wanted = list(dict.fromkeys(order.block_hashes))
        try:
            absent, replicas = self._present(wanted)
        except _Unreachable as exc:
            return self._fail_unreachable(exc)
        keys = self._keys(wanted)
        missing = absent + [
            h
            for h, k in zip(wanted, keys, strict=True)
            if h not in absent and not any(seg == self.segment for seg, _ in replicas.get(k, []))
        ]
        if missing:
            return Done(failure=f"cannot pin: block {name_blocks(missing)} not in {self.where}")
        config = ReplicateConfig()
        config.soft_pin_action = SoftPinAction.ENABLE
        config.soft_pin_ttl_ms = max(1, round(order.ttl_seconds * 1000))
        config.preferred_segment = self.segment
        t0 = self._timer()
        pinned = 0
        for h, key in zip(wanted, keys, strict=True):

            def repin(store: Any, key: str = key) -> int:
                data = store.get(key)
                if not data:
                    return OBJECT_NOT_FOUND
                rc = int(store.upsert(key, data, config))
                if rc in _UNREACHABLE_CODES:
                    raise _Unreachable(f"upsert: error {rc}")
                return len(data) if rc == 0 else rc

            try:
                result = self._retrying("pinning", repin)
            except _Unreachable as exc:
                return self._fail_unreachable(exc)
            if result < 0:
                return Done(failure=f"cannot pin block {h!r} ({key}): error {result}")
            pinned += result
        return Done(pinned, self._timer() - t0)

    def demote(self, order: Order, now: float) -> Done:
        # Only what this agent copied here, moved back onto the segment it came from: a move
        # onto a segment that holds a replica already leaves that one alone, so the block stays
        # in the pool and this segment's replica goes. (batch_replica_clear would do it in one
        # call, but the master lets only the client that put a key clear its replicas.)
        mine = [h for h in dict.fromkeys(order.block_hashes) if h in self._landed]
        if not mine:
            return Done()
        try:
            removed, seconds, failure = self._run_tasks(
                "move",
                mine,
                lambda st, key: st.create_move_task(
                    key, self.segment, self._landed[self._hash_of[key]][1]
                ),
            )
        except _Unreachable as exc:
            return self._fail_unreachable(exc)
        moved = sum(self._landed.pop(h)[0] for h in removed)
        return Done(moved, seconds, failure, removed=removed)

    def withdraw(self, order: Order, now: float) -> None:
        """Nothing to undo here: a soft pin runs its TTL (the wheel lifts one only with a new
        put), and a demote's replica was moved away."""

    # -- the rest -----------------------------------------------------------------------------

    def _remember(self, block_hash: BlockHash, size: int, source: str) -> None:
        self._landed[block_hash] = (size, source)
        self._landed.move_to_end(block_hash)
        self._hash_of[store_key(self.settings.namespace, block_hash)] = block_hash
        while len(self._landed) > _LANDED_KEPT:
            gone, _ = self._landed.popitem(last=False)
            self._hash_of.pop(store_key(self.settings.namespace, gone), None)

    def status(self) -> dict[str, Any]:
        healthy = None
        if self._store is not None:
            healthy = self._store.health_check() == 0
        return {
            "tier": "mooncake",
            "mooncake_master": self.settings.master_address,
            "mooncake_segment": self.segment,
            "mooncake_healthy": healthy,
            "mooncake_rpc_errors": self.rpc_errors,
            "mooncake_master_unreachable_failures": self.master_unreachable_failures,
            "mooncake_last_error": self.last_error,
            "buffer_blocks": list(self._landed),
            "buffer_bytes": sum(size for size, _ in self._landed.values()),
        }

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
