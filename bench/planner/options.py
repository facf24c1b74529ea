"""`PlannerOptions`: the settings of a `kvprefetch bench planner` run, their defaults (the
command's too), their checks, and the replicas' environment."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PlannerOptions:
    rounds: int = 1
    replicas: int = 3
    connections: int = 3
    duration_seconds: float = 15.0
    warmup_seconds: float = 3.0
    sample_seconds: float = 1.0
    feed_events: int = 200_000
    catch_up_seconds: float = 60.0
    sessions: int = 3000
    instances: int = 12
    hbm_blocks: int = 2000
    batch_size: int = 200
    fsync: bool = True
    lease_seconds: float = 30.0
    session_retention_seconds: float = 60.0
    seed: int = 0
    data_dir: Path | None = None
    service_env: dict[str, str] | None = None

    def validate(self) -> None:
        if self.replicas < 2:
            raise ValueError("replicas must be at least 2 (one is always measured)")
        if self.connections < self.replicas:
            raise ValueError("every replica needs a connection of its own: connections >= replicas")
        if self.instances < self.connections:
            raise ValueError("every connection needs an instance of its own")
        if min(self.rounds, self.feed_events, self.sessions, self.hbm_blocks, self.batch_size) < 1:
            raise ValueError("rounds, feed events, sessions, hbm blocks and batch size: at least 1")
        if min(self.duration_seconds, self.sample_seconds, self.catch_up_seconds) <= 0 or (
            self.warmup_seconds < 0
        ):
            raise ValueError("durations must be positive (warm-up: zero or more)")
        if self.lease_seconds <= 0:
            raise ValueError("the lease must be positive")

    def env(self, redis_url: str, prefix: str, replica: str, data_dir: Path) -> dict[str, str]:
        env = {
            "KVP_HOST": "127.0.0.1",
            "KVP_STORE": "redis",
            "KVP_REDIS_URL": redis_url,
            "KVP_REDIS_PREFIX": prefix,
            "KVP_REPLICA_ID": replica,
            "KVP_PLANNING_LEASE_SECONDS": f"{self.lease_seconds:g}",
            "KVP_ORDER_SINK": "redis",
            "KVP_LOG_FSYNC": "true" if self.fsync else "false",
            # As bench load: an hour of retention at a human pace is about a minute at this pace.
            "KVP_SESSION_RETENTION_SECONDS": f"{self.session_retention_seconds:g}",
            "KVP_DATA_DIR": str(data_dir),
        }
        env.update(self.service_env or {})
        return env
