"""Report events to kvprefetch from a router, an engine or a transfer agent, never waiting on it.

A router's request path must not slow down because kvprefetch is slow or down, so `send()` only
enqueues and a background sender posts batches to POST /v1/events. An event keeps its `event_id`
across retries and the service acknowledges a resend as a duplicate, so a retry after a lost
answer never counts a turn twice. While the service stays away the queue is bounded: the oldest
events go first (recent state matters more than old) and are counted in `stats.dropped`.

Usage::

    from kvprefetch_client.client import AsyncKvpClient, KvpClient

    with KvpClient("http://kvprefetch:8000") as kvp:       # a thread sends in the background
        kvp.request_routed(session_id="s1", request_id="r1", instance_id="gpu-0",
                           prompt_tokens=1200)
        kvp.send({"type": "instance_status", "event_id": "st-1", "ts": time.time(),
                  "instance_id": "gpu-0", "free_kv_bytes": 8 << 30})   # or any event model
    # leaving the block flushes what is queued (for at most close()'s timeout)

    async with AsyncKvpClient("http://kvprefetch:8000") as kvp:   # an asyncio task sends
        kvp.request_finished(session_id="s1", request_id="r1", instance_id="gpu-0",
                             output_tokens=300)
        await kvp.flush()
        print(kvp.stats)

An agent loop wraps each tool run in `with kvp.tool_call(run_id, tool="bash"):` (or `async
with`): `tool_started` and `tool_finished` are queued around it, and nothing kvprefetch does
ever raises into the loop (`ToolCall`).

`on_answer=callback` tells the caller which events the service acknowledged: it is called with
an `Answer` (the event ids accepted, duplicates and rejected) once per batch the service answered
for, in order, whatever the retries; once flush() returns True it has been called for every event
flush() waited for. Events dropped, or left queued at close(), get no answer. It runs on the
sender (thread or task), so it must be quick and must not call flush() or close().

Both clients share `_Pipeline` (the queue, the batching, the backoff and what each answer
means) and `_judge_response`; they differ only in how they wait and how they post.
"""

from kvprefetch_client.client._async import AsyncKvpClient
from kvprefetch_client.client._pipeline import Answer, AnswerCallback, ClientStats
from kvprefetch_client.client._sync import KvpClient
from kvprefetch_client.client._tool_call import ToolCall

__all__ = ["Answer", "AnswerCallback", "AsyncKvpClient", "ClientStats", "KvpClient", "ToolCall"]
