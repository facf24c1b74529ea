"""What routers, engines and transfer agents import to talk to kvprefetch.

The event and order models (`kvprefetch_client.events`, `kvprefetch_client.orders`), the
clients that post events without ever blocking a request path (`KvpClient`, `AsyncKvpClient`)
and the reference transfer agent (`kvprefetch_client.agent`). It needs pydantic, httpx and
orjson, never the service's own dependencies; the agent's Redis Streams source needs the
`redis` extra.
"""

from kvprefetch_client._version import __version__
from kvprefetch_client.client import Answer, AnswerCallback, AsyncKvpClient, ClientStats, KvpClient
from kvprefetch_client.errors import KvpError

__all__ = [
    "Answer",
    "AnswerCallback",
    "AsyncKvpClient",
    "ClientStats",
    "KvpClient",
    "KvpError",
    "__version__",
]
