"""A tiny OpenAI-compatible server for the router plug-ins' tests: POST /v1/chat/completions
answers with its own name as the content and a usage it computes, so a test can tell which
server a router picked and what the finish should report. A message "FAIL" gets a 500.

It serves on a listening socket the test holds (tests/ports.py): no port can change hands.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.ports import listener, port_of

COMPLETION_TOKENS = 3


def prompt_tokens_of(messages: list[dict[str, Any]]) -> int:
    return 10 + len(messages)


class OpenAIStub:
    def __init__(self, name: str) -> None:
        self.name = name
        self.sock = listener()
        self.port = port_of(self.sock)
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with stub._lock:
                    stub.requests.append(body)
                messages = body.get("messages") or []
                if any(m.get("content") == "FAIL" for m in messages):
                    self._answer(500, {"error": {"message": "stub failure", "type": "server"}})
                    return
                usage = {"prompt_tokens": prompt_tokens_of(messages)}
                usage["completion_tokens"] = COMPLETION_TOKENS
                usage["total_tokens"] = usage["prompt_tokens"] + COMPLETION_TOKENS
                self._answer(
                    200,
                    {
                        "id": "cmpl-stub",
                        "object": "chat.completion",
                        "created": 1,
                        "model": body.get("model", "stub"),
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": stub.name},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": usage,
                    },
                )

            def _answer(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler, False)
        self.server.socket.close()
        self.server.socket = self.sock
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> OpenAIStub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
