"""`make demo-litellm`: a LiteLLM proxy (from .venv-litellm) with the kvprefetch plug-in, in front
of two OpenAI-compatible stubs, reporting to a kvprefetch service; three sessions talk through
it, then one whose context sits on stub-b is steered there by the route hint. Prints what the
service saw. Everything runs locally and stops at the end. Run from the repository root:

    make demo-litellm
    # or: bash .ci/ensure-litellm && PYTHONPATH=. .venv/bin/python deploy/litellm_demo.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvprefetch_client.client import KvpClient
from tests.e2e.conftest import ServiceProcess
from tests.integrations.litellm.proxy import LiteLLMProxy
from tests.integrations.openai_stub import OpenAIStub


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="kvp-litellm-demo-"))
    a, b = OpenAIStub("stub-a").start(), OpenAIStub("stub-b").start()
    service = ServiceProcess(work / "data", work)
    service.start()
    config = {
        "model_list": [
            {
                "model_name": "tiny",
                "litellm_params": {"model": "openai/tiny", "api_base": s.url, "api_key": "x"},
                "model_info": {"kvprefetch_instance_id": name},
            }
            for s, name in ((a, "gpu-a"), (b, "gpu-b"))
        ],
        "litellm_settings": {"callbacks": "kvprefetch_client.integrations.litellm.kvprefetch"},
    }
    proxy = LiteLLMProxy(work, config, {"KVPREFETCH_URL": service.url})
    try:
        print(f"kvprefetch at {service.url}; starting the LiteLLM proxy ...")
        started = time.monotonic()
        proxy.start()
        print(f"proxy at {proxy.url} (ready in {time.monotonic() - started:.1f} s)\n")
        sessions = {
            "chat-header": {"headers": {"x-session-id": "chat-header"}},
            "chat-metadata": {"metadata": {"session_id": "chat-metadata"}},
            "chat-user": {"user": "chat-user"},
        }
        for turn in range(2):
            for sid, how in sessions.items():
                r = proxy.chat(f"{sid}: turn {turn}", **how)  # type: ignore[arg-type]
                served = r.json()["choices"][0]["message"]["content"]
                print(f"{sid:14} turn {turn}: answered by {served}")
        # chat-steer's context is in gpu-b's HBM, as an engine's KV events would say.
        blocks = [f"demo-{i}" for i in range(8)]
        with KvpClient(service.url) as kvp:
            kvp.request_routed(
                session_id="chat-steer",
                request_id="seed",
                instance_id="gpu-b",
                prompt_tokens=128,
                block_hashes=blocks,
                block_tokens=16,
            )
            kvp.send(
                {
                    "type": "kv_blocks_stored",
                    "event_id": "seed-blocks",
                    "ts": time.time(),
                    "tier": "hbm",
                    "instance_id": "gpu-b",
                    "block_hashes": blocks,
                    "block_tokens": 16,
                }
            )
            kvp.flush(10)
        picks = [
            proxy.chat(f"steer {i}", user="chat-steer").json()["choices"][0]["message"]["content"]
            for i in range(6)
        ]
        print(f"\nchat-steer (context on gpu-b), 6 requests answered by: {', '.join(picks)}")
        time.sleep(0.5)  # the plug-in posts in batches every 50 ms
        print("\nwhat kvprefetch saw (GET /v1/sessions/{id}):")
        for sid in [*sessions, "chat-steer"]:
            v = httpx.get(f"{service.url}/v1/sessions/{sid}", timeout=5).json()
            print(
                f"  {sid:14} turns={v['turns']} instance={v['instance_id']} "
                f"context_tokens={v['context_tokens']}"
            )
    finally:
        proxy.stop()
        service.kill()
        a.stop()
        b.stop()


if __name__ == "__main__":
    main()
