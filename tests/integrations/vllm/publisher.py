"""A vLLM KV-event publisher for tests: real ZMQ PUB and ROUTER sockets sending frames captured
from vLLM 0.33.0's own ZmqEventPublisher (fixtures/, made by capture.py), byte for byte.

The replay side answers as vLLM's `_service_replay` does: each buffered batch from the asked
sequence number as (identity, "", topic, seq, payload), then (identity, "", "", -1, ""); with
`omit_topic`, without the topic frame, as some main-branch builds do. The buffer keeps the last
`buffer_steps` batches, as vLLM's deque does. `publish(..., drop=True)` buffers a batch without
sending it: what a PUB socket past its high-water mark does.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import deque
from functools import cache
from pathlib import Path
from typing import Any

import zmq

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "vllm-0.33.0-frames.json"
END_SEQ = (-1).to_bytes(8, "big", signed=True)

Frames = list[bytes]


@cache
def _fixture() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())  # type: ignore[no-any-return]


def stream(name: str) -> list[Frames]:
    """A captured stream's live messages: [topic, seq, payload] each."""
    return [[bytes.fromhex(f) for f in m] for m in _fixture()["streams"][name]["frames"]]


def replay_answer(name: str) -> list[Frames]:
    """What vLLM's replay socket answered, asked from 0 (a DEALER's view: "" first)."""
    return [[bytes.fromhex(f) for f in m] for m in _fixture()["streams"][name]["replay_from_0"]]


def free_ports(n: int) -> list[int]:
    """n consecutive free ports on loopback (data-parallel ranks publish on port + rank)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n > 65535:
            continue
        held = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", p))
            return list(range(base, base + n))
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError("no run of free ports")


def _bind(sock: zmq.Socket, endpoint: str) -> None:  # type: ignore[type-arg]
    """Bind, waiting while a closed predecessor's port is released (ZMQ closes asynchronously:
    a restarted engine on the same port)."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class FramePublisher:
    def __init__(
        self,
        port: int,
        replay_port: int | None,
        *,
        buffer_steps: int = 10_000,
        omit_topic: bool = False,
    ) -> None:
        self.port, self.replay_port = port, replay_port
        self.omit_topic = omit_topic
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.replay_endpoint = None if replay_port is None else f"tcp://127.0.0.1:{replay_port}"
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        _bind(self._pub, self.endpoint)
        self._buffer: deque[Frames] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay_port is not None:
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def publish(self, frames: Frames, *, drop: bool = False) -> None:
        """Send one message's frames as they are; buffered for replay when it has a sequence."""
        if len(frames) == 3 and len(frames[1]) == 8:
            with self._lock:
                self._buffer.append(frames)
        if not drop:
            self._pub.send_multipart(frames)

    def _serve_replay(self) -> None:
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        _bind(router, self.replay_endpoint)  # type: ignore[arg-type]
        try:
            while not self._stop.is_set():
                if not router.poll(50):
                    continue
                frame = router.recv_multipart()
                if len(frame) != 3:
                    continue
                client_id, _, start_bytes = frame
                start = int.from_bytes(start_bytes, "big")
                with self._lock:
                    buffered = list(self._buffer)
                for topic, seq, payload in buffered:
                    if int.from_bytes(seq, "big") >= start:
                        head = [client_id, b""] if self.omit_topic else [client_id, b"", topic]
                        router.send_multipart([*head, seq, payload])
                router.send_multipart([client_id, b"", b"", END_SEQ, b""])
        finally:
            router.close(linger=0)

    def close(self) -> None:
        """The engine is gone: both sockets closed (a SUB sees the disconnect)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._pub.close(linger=0)
