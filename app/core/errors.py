"""The one exception tree. Callers catch KvpError; the API answers those it knows (api/errors.py).

The root, `KvpError`, is the light client's (kvprefetch_client/errors.py), so that the client and
the agent raise into the same tree without importing the service. The whole tree, each class
beside the module that defines it (tests/docs/test_error_tree.py holds it to the classes):

    KvpError                  kvprefetch_client.errors: the root, every error raised on purpose
    +-- BufferFull            kvprefetch_client.agent.buffer: no room without evicting pins
    +-- MooncakeError         kvprefetch_client.agent.mooncake: no wheel, or setup refused
    +-- _Unreachable          kvprefetch_client.agent.mooncake: the master did not answer
    +-- ConfigError           app.core.errors: bad settings or scenario files
    +-- EventLogError         app.core.errors: the durable log cannot be written or read (503)
    |   +-- CorruptLogError   app.core.errors: a log line not a valid event (file, line named)
    +-- StoreError            app.core.errors: the state store failed (API: 503)
    |   +-- StoreUnavailable  app.core.errors: the store cannot be reached (Redis down)
    +-- ModelError            app.predict.predictors: a model that cannot serve
    |   +-- ModelDirRefused   app.predict.slots: a model directory outside the allowed ones
    +-- SinkError             app.deliver.base: an order sink failed
    |   +-- SinkUnavailable, SinkRejected, SinkClosed, SinkFenced  app.deliver.base
    +-- _Failed               app.deliver.lmcache: an order that did not complete, and why
    +-- UnknownTokens         app.deliver.token_index: an order's blocks of unknown tokens
    +-- BadInput              app.ingest.vllm.wire: a vLLM frame or event that does not decode
    +-- HttpError             app.api.errors: answered with its own status and field
    |   +-- Refused           app.api.auth: 401, 403, 429
    |   +-- BatchError        app.api.batch: a POST /v1/events body unusable as a whole
    +-- TraceError            sim.traces: a trace file that does not read
    +-- RemoteServiceError     sim.remote: a replay through a running service failed
    |   +-- ServiceUnreachable, EventsRejected  sim.remote
    +-- MissingExtraError     app.core.errors: an optional dependency missing (its extra named)
    +-- BenchError            bench._util: a bench's server did not start or died

SinkFenced: not sent, the planning lease this replica held has lapsed. The private two never
leave their module: _Failed becomes the order's reported failure, _Unreachable a retry.
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
