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


ANY_PORT = "tcp://127.0.0.1:*"


def _bind(sock: zmq.Socket, endpoint: str, *, wait: bool = True) -> str:  # type: ignore[type-arg]
    """Bind and return the endpoint bound (a `*` port read back). With `wait`, wait while a closed
    predecessor's port is released (ZMQ closes asynchronously: a restarted engine on the same
    port); without, "address in use" is raised at once."""
    deadline = time.monotonic() + 30.0
    while True:
        try:
            sock.bind(endpoint)
            return sock.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[no-any-return]
        except zmq.ZMQError as exc:
            if not wait or exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


class FramePublisher:
    """One publisher. Its endpoints default to a port of the system's choosing, read back into
    `endpoint` and `replay_endpoint`; given ones (an engine restarted on its ports) are bound,
    waiting while the old sockets release them unless `wait=False`."""

    def __init__(
        self,
        endpoint: str = ANY_PORT,
        replay_endpoint: str | None = ANY_PORT,
        *,
        buffer_steps: int = 10_000,
        omit_topic: bool = False,
        wait: bool = True,
        ignore_requests: int = 0,
        answer_requests: int | None = None,
    ) -> None:
        self.omit_topic = omit_topic
        # Replay requests left unanswered: the first `ignore_requests`, and any past the first
        # `answer_requests` (a replay socket that hangs).
        self.ignore_requests = ignore_requests
        self.answer_requests = answer_requests
        self.requests = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._router: zmq.Socket | None = None  # type: ignore[type-arg]
        self._thread: threading.Thread | None = None
        try:
            self.endpoint = _bind(self._pub, endpoint, wait=wait)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _bind(self._router, replay_endpoint, wait=wait)
        except BaseException:
            self._pub.close(linger=0)
            if self._router is not None:
                self._router.close(linger=0)
            raise
        self._buffer: deque[Frames] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if self._router is not None:
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def spec(self, instance_id: str) -> str:
        """This publisher as a KVP_VLLM_KV_ENDPOINTS entry."""
        replay = f",replay={self.replay_endpoint}" if self.replay_endpoint else ""
        return f"{instance_id}={self.endpoint}{replay}"

    def publish(self, frames: Frames, *, drop: bool = False) -> None:
        """Send one message's frames as they are; buffered for replay when it has a sequence."""
        if len(frames) == 3 and len(frames[1]) == 8:
            with self._lock:
                self._buffer.append(frames)
        if not drop:
            self._pub.send_multipart(frames)

    def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        try:
            while not self._stop.is_set():
                if not router.poll(50):
                    continue
                frame = router.recv_multipart()
                if len(frame) != 3:
                    continue
                client_id, _, start_bytes = frame
                self.requests += 1
                if self.requests <= self.ignore_requests or (
                    self.answer_requests is not None and self.requests > self.answer_requests
                ):
                    continue
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


def rank_publishers(ranks: int) -> list[FramePublisher]:
    """One publisher per data-parallel rank, rank r on both of rank 0's ports + r (vLLM's rule):
    rank 0 on ports of the system's choosing, the others tried next to them, all again elsewhere
    while one of those is in use."""
    for _ in range(100):
        pubs = [FramePublisher(wait=False)]
        base, replay_base = port_of(pubs[0].endpoint), port_of(pubs[0].replay_endpoint or "")
        try:
            for r in range(1, ranks):
                pubs.append(
                    FramePublisher(
                        f"tcp://127.0.0.1:{base + r}",
                        f"tcp://127.0.0.1:{replay_base + r}",
                        wait=False,
                    )
                )
            return pubs
        except zmq.ZMQError as exc:
            for pub in pubs:
                pub.close()
            if exc.errno != zmq.EADDRINUSE:
                raise
    raise RuntimeError("no run of free ports for the ranks")
