"""Per-client token buckets kept in Redis, shared by every replica (KVP_RATE_LIMIT_SCOPE=fleet):
a client spreading its posts over N replicas gets its rate once, not N times (decisions.md, 23).

    <prefix>:ratelimit:<what>:<client>   a hash: tokens, at (Redis's TIME, so replicas' clocks
                                         do not matter); expires once it would be full again

The same bucket as `RateLimiter` (app/core/ratelimit.py), taken in one script call. A Redis that
does not answer lets the request through (logged, once per outage): a rate limit protects the
service from a client, and refusing every client because Redis is away is the worse failure.
"""

from __future__ import annotations

import logging

import redis
import redis.asyncio as aredis

log = logging.getLogger(__name__)

# KEYS[1] the bucket; ARGV: rate a second, capacity, cost, expiry ms. Returns the wait in
# seconds as a string (0 when allowed); a refused take spends nothing.
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, cap, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local b = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(b[1])
if tokens == nil then
  tokens = cap
else
  tokens = math.min(cap, tokens + math.max(0, now - tonumber(b[2])) * rate)
end
local needed = math.min(cost, cap)
local wait = 0
if tokens >= needed then tokens = tokens - cost else wait = (needed - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return tostring(wait)
"""


class FleetRateLimiter:
    def __init__(
        self,
        client: aredis.Redis,
        prefix: str,
        what: str,
        rate_per_second: float,
        burst_seconds: float,
        *,
        owns_client: bool = True,
    ) -> None:
        self.client = client
        self.prefix = f"{prefix}:ratelimit:{what}:"
        self.rate = rate_per_second
        self.capacity = max(1.0, rate_per_second * burst_seconds)
        # A bucket left alone this long is full again: forgetting it changes nothing.
        self._expiry_ms = int(1000 * (self.capacity / rate_per_second + 1)) if self.enabled else 0
        self._take = client.register_script(_TAKE)
        self._owns_client = owns_client
        self._failing = False

    @classmethod
    def from_url(
        cls,
        url: str,
        prefix: str,
        what: str,
        rate_per_second: float,
        burst_seconds: float,
        *,
        timeout_seconds: float,
    ) -> FleetRateLimiter:
        client = aredis.Redis.from_url(
            url, socket_timeout=timeout_seconds, socket_connect_timeout=timeout_seconds
        )
        return cls(client, prefix, what, rate_per_second, burst_seconds)

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    async def spend(self, client: str, cost: float = 1.0) -> float:
        """As `RateLimiter.take`, fleet-wide: 0 when allowed, else the seconds to wait."""
        if not self.enabled:
            return 0.0
        try:
            wait = float(
                await self._take(
                    keys=[self.prefix + client],
                    args=[self.rate, self.capacity, cost, self._expiry_ms],
                )
            )
        except redis.RedisError as exc:
            if not self._failing:
                log.warning("fleet rate limit not checked (let through): %s", exc)
                self._failing = True
            return 0.0
        self._failing = False
        return wait

    async def close(self) -> None:
        if self._owns_client:
            await self.client.aclose()
