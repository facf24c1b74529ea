"""The one exception tree. Callers catch KvpError; the API maps subclasses to status codes.

    KvpError
    +-- ConfigError          bad settings or scenario files
    +-- EventLogError        the durable log cannot be written or read
    |   +-- CorruptLogError  a log line that is not a valid event (file and line named)
    +-- StoreError           the state store failed
        +-- StoreUnavailable the store cannot be reached (Redis down): retry later
"""

from __future__ import annotations


class KvpError(Exception):
    """Base of every error kvprefetch raises on purpose."""


class ConfigError(KvpError):
    pass


class EventLogError(KvpError):
    pass


class CorruptLogError(EventLogError):
    def __init__(self, path: str, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path = path
        self.line = line


class StoreError(KvpError):
    pass


class StoreUnavailable(StoreError):
    pass
