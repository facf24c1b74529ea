"""The handler's memory of tools started and not finished is bounded: run in .venv-agents by
test_langgraph.py. Calls the handler's LangChain hooks directly for MAX_OPEN_TOOLS + 1 tool
runs, then ends the first (forgotten: nothing sent) and the last; prints what was queued.

    python langchain_open_tools.py URL
"""

from __future__ import annotations

import json
import sys
import uuid

from kvprefetch_client.client import KvpClient
from kvprefetch_client.integrations.langchain import MAX_OPEN_TOOLS, KvpCallbackHandler

client = KvpClient(sys.argv[1], max_queue_events=4 * MAX_OPEN_TOOLS)
handler = KvpCallbackHandler(client)
runs = [uuid.uuid4() for _ in range(MAX_OPEN_TOOLS + 1)]
for run_id in runs:
    handler.on_tool_start({"name": "bash"}, "", run_id=run_id, metadata={"session_id": "s1"})
handler.on_tool_end("", run_id=runs[0])
handler.on_tool_end("", run_id=runs[-1])
print(json.dumps({"max_open_tools": MAX_OPEN_TOOLS, "queued": client.stats.queued}))
client.close(0)
