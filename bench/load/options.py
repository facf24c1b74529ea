"""`LoadOptions`: the settings of a `kvprefetch bench load` run, their defaults (the command's
too), their checks, and what follows from them: the service's environment, the `config` record
of the JSON, the mode."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LoadOptions:
    duration_seconds: float = 120.0
    warmup_seconds: float = 10.0
    sessions: int = 3000
    instances: int = 16
    hbm_blocks: int = 2000
    batch_size: int = 200
    event_connections: int = 2
    hint_connections: int = 2
    store: str = "memory"
    fsync: bool = True
    dedupe_max_ids: int | None = None
    # The bench's conversations come back about a second after each answer, where people take
    # minutes: an hour of retention at a human pace is about a minute at the bench's. With the
    # service's own 3600 s, every conversation of the run would be tracked to the end and the
    # sessions could not level off within minutes.
    session_retention_seconds: float = 60.0
    sample_seconds: float = 5.0
    ceiling_seconds: float = 10.0
    calibrate_sessions: int = 10_000
    token: str | None = None
    # Settings for the service process, over those the options make.
    service_env: Mapping[str, str] | None = None
    data_dir: Path | None = None
    seed: int = 0
    # None: closed-loop, at full speed.
    events_per_second: float | None = None
    hints_per_second: float | None = None

    def validate(self) -> None:
        """ValueError when the options cannot make a run."""
        if self.store not in ("memory", "redis"):
            raise ValueError("store must be memory or redis")
        if (
            min(self.duration_seconds, self.sample_seconds, self.session_retention_seconds) <= 0
            or self.warmup_seconds < 0
            or self.ceiling_seconds < 0
        ):
            raise ValueError("durations must be positive (warm-up and ceiling: zero or more)")
        if (
            min(
                self.sessions,
                self.instances,
                self.hbm_blocks,
                self.batch_size,
                self.event_connections,
            )
            < 1
            or self.hint_connections < 0
        ):
            raise ValueError(
                "sessions, instances, hbm blocks, batch size and event connections must be at "
                "least 1"
            )
        if (self.events_per_second is not None and self.events_per_second <= 0) or (
            self.hints_per_second is not None and self.hints_per_second <= 0
        ):
            raise ValueError("offered rates must be positive (or unset: closed-loop)")
        if self.hints_per_second is not None and self.hint_connections == 0:
            raise ValueError("an offered hint rate needs hint connections")
        if self.instances < self.event_connections:
            raise ValueError(
                "every event connection needs an instance of its own: "
                "instances >= event connections"
            )

    def service_environment(self, redis_url: str, redis_prefix: str) -> dict[str, str]:
        """The service process's KVP_ settings: the options', then `service_env` over them.
        ValueError when `service_env`'s KVP_DEDUPE_MAX_IDS is no integer."""
        extra = dict(self.service_env or {})
        dedupe_max_ids = self.dedupe_max_ids
        if dedupe_max_ids is None and "KVP_DEDUPE_MAX_IDS" in extra:
            dedupe_max_ids = int(extra["KVP_DEDUPE_MAX_IDS"])
        env = {
            "KVP_HOST": "127.0.0.1",
            "KVP_STORE": self.store,
            "KVP_LOG_FSYNC": "true" if self.fsync else "false",
            "KVP_REPLICA_ID": "bench-load",
            "KVP_SESSION_RETENTION_SECONDS": f"{self.session_retention_seconds:g}",
        }
        if self.store == "redis":
            env.update({"KVP_REDIS_URL": redis_url, "KVP_REDIS_PREFIX": redis_prefix})
        if dedupe_max_ids is not None:
            env["KVP_DEDUPE_MAX_IDS"] = str(dedupe_max_ids)
        env.update(extra)
        return env

    def record(self, env: Mapping[str, str], settings: Mapping[str, Any]) -> dict[str, Any]:
        """The JSON's `config`: the options (the token only as set or not), with the service's
        `env` and its `settings` (report.service_settings) in force."""
        return {
            "duration_seconds": self.duration_seconds,
            "warmup_seconds": self.warmup_seconds,
            "sessions": self.sessions,
            "instances": self.instances,
            "hbm_blocks": self.hbm_blocks,
            "batch_size": self.batch_size,
            "event_connections": self.event_connections,
            "hint_connections": self.hint_connections,
            "store": self.store,
            "fsync": self.fsync,
            "sample_seconds": self.sample_seconds,
            "ceiling_seconds": self.ceiling_seconds,
            "calibrate_sessions": self.calibrate_sessions,
            "token": "set" if self.token else None,
            "seed": self.seed,
            "mode": self.mode,
            "events_per_second_offered": self.events_per_second,
            "hints_per_second_offered": self.hints_per_second,
            # In force in the service, from --service-env, the options, or its defaults.
            "dedupe_max_ids": settings["dedupe_max_ids"],
            "session_retention_seconds": settings["session_retention_seconds"],
            "reorder_window_seconds": settings["reorder_window_seconds"],
            "service_env": {
                k: (v if "TOKEN" not in k.upper() else "set")
                for k, v in sorted(env.items())
                if k != "KVP_DATA_DIR"
            },
        }

    @property
    def mode(self) -> str:
        """Closed- or open-loop, in words."""
        if self.events_per_second is None and self.hints_per_second is None:
            return "closed-loop, full speed"
        parts = [
            f"{rate:g} {what}/s offered" if rate is not None else f"{what} closed-loop"
            for rate, what in ((self.events_per_second, "events"), (self.hints_per_second, "hints"))
        ]
        return "open-loop: " + ", ".join(parts) + "; latency from each call's scheduled start"
