"""A plug-in's own failures, counted and logged at most once a minute: kvprefetch must never
flood a router's log, nor raise into it."""

from __future__ import annotations

import logging
import time

LOG_INTERVAL_SECONDS = 60.0


class FailureLog:
    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self.count = 0
        self._last_logged = -LOG_INTERVAL_SECONDS

    def note(self, what: str, exc: BaseException) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._last_logged >= LOG_INTERVAL_SECONDS:
            self._last_logged = now
            self._logger.warning(
                "kvprefetch: %s failed (%s: %s); the request goes on unchanged "
                "(%d such failures so far; logged at most once a minute)",
                what,
                type(exc).__name__,
                exc,
                self.count,
            )
