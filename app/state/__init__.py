"""State stores: the live picture of sessions, instances and block residency."""

from app.core.config import Settings
from app.state.base import (
    InstanceView,
    LocationView,
    LogPosition,
    OrderView,
    RequestView,
    SessionContext,
    SessionCursor,
    SessionView,
    StateStore,
    cursor_of,
    location_name,
)
from app.state.memory import MemoryStore

__all__ = [
    "InstanceView",
    "LocationView",
    "LogPosition",
    "MemoryStore",
    "OrderView",
    "RequestView",
    "SessionContext",
    "SessionCursor",
    "SessionView",
    "StateStore",
    "build_store",
    "cursor_of",
    "location_name",
]


def build_store(settings: Settings) -> StateStore:
    """The store the settings ask for, bounded by their windows (the constructors' defaults keep
    everything, for offline replays of whole traces)."""
    if settings.store == "redis":
        from app.state.redis import RedisStore

        return RedisStore.from_url(
            settings.redis_url.get_secret_value(),
            prefix=settings.redis_prefix,
            bytes_per_token=settings.bytes_per_token,
            block_tokens=settings.block_tokens,
            dedupe_ttl_seconds=settings.dedupe_ttl_seconds,
            reorder_window_seconds=settings.reorder_window_seconds,
            session_retention_seconds=settings.session_retention_seconds,
            max_instances=settings.max_instances,
            instance_retention_seconds=settings.instance_retention_seconds,
            timeout_seconds=settings.redis_timeout_seconds,
        )
    return MemoryStore(
        bytes_per_token=settings.bytes_per_token,
        block_tokens=settings.block_tokens,
        dedupe_max_ids=settings.dedupe_max_ids,
        reorder_window_seconds=settings.reorder_window_seconds,
        session_retention_seconds=settings.session_retention_seconds,
        max_instances=settings.max_instances,
        instance_retention_seconds=settings.instance_retention_seconds,
    )
