"""The planning lease: one replica of a fleet on one Redis plans at a time (decisions.md, 23).

    <prefix>:planner          "<replica_id>|<token>", PX <KVP_PLANNING_LEASE_SECONDS>: the holder
    <prefix>:planner-token    INCR'd by each replica that takes the lease: its fencing token
    <prefix>:planner-state    a hash the holder keeps its scheduler's hand-over state in
                              (`Scheduler.handover_state`), written only while it holds the lease

A replica tries to take the lease (SET NX PX) or renew it (PEXPIRE if it is still its value)
every third of the lease. It counts itself the holder only until its last successful call's
start plus the lease, less a margin for clock drift between it and Redis; so a holder cut off
from Redis stops planning before another can take over. The token names each term: the
scheduler's order ids carry it (their generation), and the writes of the hand-over state and of
the Redis stream sink check the lease's value in the same script (fencing): a holder that paused
past its lease writes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import redis
import redis.asyncio as aredis

log = logging.getLogger(__name__)

# Of the lease: a holder stops counting itself the holder this much before its lease runs out in
# Redis (clock rates differ by far less; a loop late by this much is late anyway).
DRIFT_SHARE = 0.1

# KEYS[1] the lease, KEYS[2] the token counter; ARGV[1] the replica id, ARGV[2] the lease in ms.
# Returns the new token when the lease was free, else 0.
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local token = redis.call('INCR', KEYS[2])
  redis.call('SET', KEYS[1], ARGV[1] .. '|' .. token, 'PX', ARGV[2])
  return token
end
return 0
"""

# KEYS[1] the lease; ARGV[1] its value while we hold it, ARGV[2] the lease in ms.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS[1] the lease, KEYS[2] the state hash; ARGV[1] the lease's value while we hold it,
# ARGV[2] how many fields to set, then field, value pairs, then the fields to delete.
_WRITE_STATE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local sets = tonumber(ARGV[2])
for i = 0, sets - 1 do
  redis.call('HSET', KEYS[2], ARGV[3 + 2 * i], ARGV[4 + 2 * i])
end
for i = 3 + 2 * sets, #ARGV do
  redis.call('HDEL', KEYS[2], ARGV[i])
end
return 1
"""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def lease_key(prefix: str) -> str:
    return f"{prefix}:planner"


class PlanningLease:
    """This replica's side of the lease, on redis.asyncio (the service's event loop).
    `on_gain(token, state)` is awaited when it takes the lease (with the hand-over state the last
    holder wrote); `on_loss()` when it no longer holds it."""

    def __init__(
        self,
        client: aredis.Redis,
        prefix: str,
        replica_id: str,
        lease_seconds: float,
        *,
        owns_client: bool = True,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.key = lease_key(prefix)
        self.token_key = f"{prefix}:planner-token"
        self.state_key = f"{prefix}:planner-state"
        self.replica_id = replica_id
        self.lease_seconds = lease_seconds
        self._ms = max(1, int(lease_seconds * 1000))
        self._owns_client = owns_client
        self._now = monotonic
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._write = client.register_script(_WRITE_STATE)
        self.token = 0
        self.value: str | None = None  # the lease's value while this replica holds it
        self._valid_until = 0.0
        self._written: dict[str, str] = {}  # the hand-over state as last written
        self.terms = 0  # terms won by this replica
        # Between a term's on_gain and its on_loss: what makes on_loss run once per term, even
        # when `held` lapsed by the clock before this replica noticed (a pause, an outage).
        self.leading = False
        self.on_gain: Callable[[int, dict[str, str]], Awaitable[None]] | None = None
        self.on_loss: Callable[[], Awaitable[None]] | None = None

    @classmethod
    def from_url(
        cls, url: str, prefix: str, replica_id: str, lease_seconds: float, *, timeout_seconds: float
    ) -> PlanningLease:
        # A call never waits longer than a third of the lease: a renewal that hangs must not
        # outlive the lease it renews.
        wait = min(timeout_seconds, lease_seconds / 3)
        client = aredis.Redis.from_url(url, socket_timeout=wait, socket_connect_timeout=wait)
        return cls(client, prefix, replica_id, lease_seconds)

    @property
    def held(self) -> bool:
        """Whether this replica may plan now: its lease has not run out by its own clock."""
        return self.value is not None and self._now() < self._valid_until

    async def step(self) -> bool:
        """Take or renew the lease once; whether this replica holds it afterwards."""
        started = self._now()
        if self.value is not None and not self.held:
            # Lapsed while this replica was paused or cut off: another may plan already. Step
            # down before anything else, whatever Redis now says; a term begun afresh is new.
            log.warning("planning lease lapsed (%s): stepping down", self.value)
            await self.release()
            await self._step_down()
        try:
            if self.value is not None:
                kept = bool(await self._renew(keys=[self.key], args=[self.value, self._ms]))
                if not kept:
                    log.warning("planning lease lost (%s): another replica plans", self.value)
                    self.value = None
                    await self._step_down()
            if self.value is None:
                token = int(
                    await self._acquire(
                        keys=[self.key, self.token_key], args=[self.replica_id, self._ms]
                    )
                )
                if token:
                    state = await self.client.hgetall(self.state_key)
                    self.token, self.value = token, f"{self.replica_id}|{token}"
                    self._valid_until = started + self.lease_seconds * (1 - DRIFT_SHARE)
                    self._written = {_text(k): _text(v) for k, v in state.items()}
                    self.terms += 1
                    log.info("planning lease taken: term %d", token)
                    if self.on_gain is not None:
                        try:
                            await self.on_gain(token, dict(self._written))
                        except Exception:
                            # Not ready to plan this term (its state not loaded): let another.
                            log.exception("planning term %d not begun: lease given up", token)
                            await self.release()
                            return False
                    self.leading = True
                    return True
            else:
                self._valid_until = started + self.lease_seconds * (1 - DRIFT_SHARE)
        except redis.RedisError as exc:
            log.warning("planning lease not renewed: %s", exc)
        if not self.held:
            await self._step_down()
        return self.held

    async def _step_down(self) -> None:
        """End this replica's term, once: `on_loss` hands its open orders over."""
        if self.leading:
            self.leading = False
            if self.on_loss is not None:
                await self.on_loss()

    async def write_state(self, state: Mapping[str, str]) -> bool:
        """Write what changed in the hand-over state since the last write, only while this
        replica holds the lease in Redis; False when it does not (nothing written)."""
        if self.value is None:
            return False
        sets = [(k, v) for k, v in state.items() if self._written.get(k) != v]
        gone = [k for k in self._written if k not in state]
        if not sets and not gone:
            return True
        args: list[Any] = [self.value, len(sets)]
        for k, v in sets:
            args += [k, v]
        args += gone
        try:
            if not await self._write(keys=[self.key, self.state_key], args=args):
                return False
        except redis.RedisError as exc:
            log.warning("planning hand-over state not written: %s", exc)
            return False
        self._written = dict(state)
        return True

    async def run(self) -> None:
        """Step every third of the lease until cancelled."""
        while True:
            try:
                await self.step()
            except Exception:  # one bad step must not end the lease for the life of the process
                log.exception("planning lease step failed")
            await asyncio.sleep(self.lease_seconds / 3)

    async def release(self) -> None:
        """Give the lease up now (a clean shutdown): another replica takes over at its next
        step rather than when the lease runs out."""
        if self.value is not None:
            value, self.value = self.value, None
            try:
                await self.client.eval(
                    "if redis.call('GET', KEYS[1]) == ARGV[1] then "
                    "return redis.call('DEL', KEYS[1]) end return 0",
                    1,
                    self.key,
                    value,
                )
            except redis.RedisError as exc:
                log.warning("planning lease not released (it runs out by itself): %s", exc)

    async def close(self) -> None:
        await self.release()
        if self._owns_client:
            await self.client.aclose()
