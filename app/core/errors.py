"""The one exception tree. Callers catch KvpError; the API answers those it knows (api/errors.py).

The root, `KvpError`, is the light client's (kvprefetch_client/errors.py), so that the client and
the agent raise into the same tree without importing the service. The service's errors:

    KvpError                     kvprefetch_client.errors
    +-- BufferFull               kvprefetch_client.agent.buffer: no room without evicting pins
    +-- ConfigError              bad settings or scenario files
    +-- EventLogError            the durable log cannot be written or read (API: 503)
    |   +-- CorruptLogError      a log line that is not a valid event (file and line named)
    +-- StoreError               the state store failed (API: 503)
    |   +-- StoreUnavailable     the store cannot be reached (Redis down): retry later
    +-- ModelError               app.predict.predictors: a model that cannot serve
    |   +-- ModelDirRefused      app.predict.registry: a model directory outside the allowed ones
    +-- SinkError                app.deliver.base: an order sink failed
    |   +-- SinkUnavailable, SinkRejected, SinkClosed
    +-- UnknownTokens            app.deliver.token_index: an order's blocks whose tokens are unknown
    +-- BadInput                 app.ingest.vllm.wire: a vLLM frame or event that does not decode
    +-- HttpError                app.api.errors: answered with its own status and field
    |   +-- Refused              app.api.auth: 401, 403, 429
    |   +-- BatchError           app.api.batch: a POST /v1/events body unusable as a whole
    +-- TraceError               sim.traces: a trace file that does not read
    +-- RemoteEngineError        sim.remote: a replay through a running service failed
    |   +-- ServiceUnreachable, EventsRejected
    +-- MissingExtraError        app.core.extras: an optional dependency is not installed
    +-- BenchError               bench._util: a bench's server did not start or died
"""

from __future__ import annotations

from kvprefetch_client.errors import KvpError

__all__ = [
    "ConfigError",
    "CorruptLogError",
    "EventLogError",
    "KvpError",
    "MissingExtraError",
    "StoreError",
    "StoreUnavailable",
]


class ConfigError(KvpError):
    pass


class MissingExtraError(KvpError):
    """An optional dependency is not installed; the message names the extra that brings it."""


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
