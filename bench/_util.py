"""What the benchmarks share: realistic traffic, medians, processes, ports, stderr progress."""

from __future__ import annotations

import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from app.core.errors import KvpError

REPO = Path(__file__).resolve().parent.parent

# Token bucket of a block: the Mooncake traces' unit (app.core.config.MOONCAKE_BLOCK_TOKENS).
BLOCK_TOKENS = 512
START_TS = 1_732_900_000.0  # a realistic unix time, in seconds


class BenchError(KvpError):
    """A bench's server did not start, died or answered wrong (the message holds its log)."""


def check_redis(url: str) -> None:
    """Raises BenchError, saying what to do, when no Redis answers at `url`."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise BenchError(
            f"--store redis: no Redis answers at {redact_url(url)} ({exc}); start one there or "
            "point KVP_REDIS_URL at one"
        ) from None
    finally:
        client.close()


def redact_url(url: str) -> str:
    """The URL without its password, for messages."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not sep or not at:
        return url
    user = creds.partition(":")[0]
    return f"{scheme}://{user + ':***' if user else '***'}@{host}"


def info(msg: str) -> None:
    """Progress and info go to stderr; stdout is kept for the one JSON object."""
    print(msg, file=sys.stderr, flush=True)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(terse=True),
    }


def listening_socket() -> socket.socket:
    """A loopback socket on a port of the kernel's choosing, listening and inheritable: a server
    started on it (`--fd`) never binds, so no other process can take the port meanwhile."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _local_port_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def quiet_port(rng: random.Random | None = None) -> int:
    """A port outside the kernel's range of local ports (which it gives to outgoing connections
    and port-0 binds) that can be bound now: for a server that binds the port it is told, where
    only another process doing the same can take it before it does."""
    low, high = _local_port_range()
    # The larger of the spans below and above the local range, clear of the well-known ports.
    spans = [(10000, low - 1), (high + 1, 65535)]
    start, stop = max(spans, key=lambda span: span[1] - span[0])
    draw = rng or random.SystemRandom()
    for _ in range(200):
        port = draw.randint(start, stop)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}-{stop}")


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment for a child process: no inherited KVP_* knobs, the repo importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


class ServerProcess:
    """A server process on a socket of ours (`cmd_tail` with `--fd N` added), its output in a log
    file; `error` is what its failures raise."""

    error: type[Exception] = RuntimeError

    def __init__(
        self, name: str, cmd_tail: list[str], *, workdir: Path, env: dict[str, str]
    ) -> None:
        self.name = name
        self._sock = listening_socket()
        self.port = int(self._sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        fd = self._sock.fileno()
        # cwd is the workdir so that no .env of the caller's directory leaks into Settings.
        self.proc = subprocess.Popen(
            [sys.executable, *cmd_tail, "--fd", str(fd)],
            pass_fds=[fd],
            cwd=workdir,
            env=child_env(env),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(
        self, path: str = "/healthz", headers: dict[str, str] | None = None, timeout: float = 90.0
    ) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self.error(
                    f"the {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                r = httpx.get(self.url + path, headers=headers, timeout=2.0)
                if r.status_code == 200:
                    return
                last = f"{path} answered {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.05)
        raise self.error(
            f"the {self.name} was not ready within {timeout:.0f} s ({last}):\n{self.log_tail()}"
        )

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT: uvicorn shuts down gracefully (closes the log)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self._sock.close()


class Server(ServerProcess):
    """One uvicorn process (one worker) started with `python -m bench._server WHICH`."""

    def __init__(self, which: str, *, workdir: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(
            f"{which} server", ["-m", "bench._server", which], workdir=workdir, env=env or {}
        )


def _uuidish(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


class _Session:
    __slots__ = ("blocks", "instance_id", "session_id", "turn", "turns_left")

    def __init__(self, session_id: str, instance_id: str, turns: int, blocks: list[int]) -> None:
        self.session_id = session_id
        self.instance_id = instance_id
        self.turns_left = turns
        self.turn = 0
        self.blocks = blocks


class Traffic:
    """Event dicts shaped like a router's and engines' real traffic, every event id unique.

    Sessions of 2-4 turns (Mooncake conversations) run interleaved, `active` at a time. A turn is
    request_routed (with the prompt's block hashes), request_started, request_finished (with the
    context's block hashes: the prompt plus the output's full blocks); the next turn's prompt
    extends that context by the user's new message. Engines report the turn's new blocks with
    kv_blocks_stored (`kv_share` of turns) and instances report load with instance_status
    (`status_share` of turns). Block hash ids are prefix-chained ints in the millions, the first
    one shared by many sessions (a system prompt), like the Mooncake trace's hash_ids.
    Ids look like real ones: uuid-shaped event and session ids, `chatcmpl-...` request ids.
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        active: int = 2_000,
        turns: tuple[int, int] = (2, 4),
        first_blocks: tuple[int, int] = (6, 20),
        blocks_per_turn: tuple[int, int] = (1, 3),
        max_blocks: int = 64,
        kv_share: float = 0.35,
        status_share: float = 0.2,
        instances: int = 32,
        hash_base: int = 1_000_000,
    ) -> None:
        self.rng = random.Random(seed)
        # Unique per run (not per seed), so that two runs against one log never collide.
        self._id_prefix = str(uuid.uuid4())[:23]
        self._next_id = 0
        self._next_hash = hash_base
        self._system_prompts = [hash_base // 2 + i for i in range(50)]
        self.active_target = active
        self.turns = turns
        self.first_blocks = first_blocks
        self.blocks_per_turn = blocks_per_turn
        self.max_blocks = max_blocks
        self.kv_share = kv_share
        self.status_share = status_share
        self.instances = [f"vllm-decode-{i:02d}" for i in range(instances)]
        self.ts = START_TS
        self._active: list[_Session] = []
        self._carry: list[dict[str, Any]] = []  # events generated past the last full batch
        self.sessions_started = 0

    # -- ids -----------------------------------------------------------------------------------

    def _event_id(self) -> str:
        self._next_id += 1
        return f"{self._id_prefix}-{self._next_id:012x}"

    def _hashes(self, n: int) -> list[int]:
        start = self._next_hash
        self._next_hash += n
        return list(range(start, start + n))

    # -- sessions ------------------------------------------------------------------------------

    def _new_session(self) -> _Session:
        rng = self.rng
        self.sessions_started += 1
        first = rng.randint(*self.first_blocks)
        blocks = [rng.choice(self._system_prompts), *self._hashes(first - 1)]
        return _Session(_uuidish(rng), rng.choice(self.instances), rng.randint(*self.turns), blocks)

    def _turn(self, s: _Session, *, extras: bool) -> list[dict[str, Any]]:
        rng = self.rng
        if s.turn > 0:  # the user's new message extends the context
            s.blocks = (s.blocks + self._hashes(rng.randint(*self.blocks_per_turn)))[
                : self.max_blocks
            ]
        s.turn += 1
        s.turns_left -= 1
        if rng.random() < 0.1:  # the router moves the session now and then
            s.instance_id = rng.choice(self.instances)
        self.ts += rng.uniform(0.0, 0.004)
        routed_ts = round(self.ts, 6)
        started_ts = round(routed_ts + rng.uniform(0.01, 0.5), 6)
        finished_ts = round(started_ts + rng.uniform(0.5, 20.0), 6)
        request_id = f"chatcmpl-{rng.getrandbits(128):032x}"
        prompt_tokens = len(s.blocks) * BLOCK_TOKENS - rng.randint(0, BLOCK_TOKENS - 1)
        output_tokens = rng.randint(5, 900)
        context_tokens = prompt_tokens + output_tokens
        prompt_blocks = list(s.blocks)
        full_blocks = context_tokens // BLOCK_TOKENS
        if full_blocks > len(s.blocks):
            s.blocks = (s.blocks + self._hashes(full_blocks - len(s.blocks)))[: self.max_blocks]
        common = {
            "session_id": s.session_id,
            "request_id": request_id,
            "instance_id": s.instance_id,
        }
        out: list[dict[str, Any]] = [
            {
                "event_id": self._event_id(),
                "ts": routed_ts,
                "type": "request_routed",
                **common,
                "prompt_tokens": prompt_tokens,
                "block_hashes": prompt_blocks,
                "block_tokens": BLOCK_TOKENS,
            },
            {"event_id": self._event_id(), "ts": started_ts, "type": "request_started", **common},
        ]
        if extras and rng.random() < self.kv_share:
            new = rng.randint(1, min(4, len(prompt_blocks)))
            parent = prompt_blocks[-new - 1] if len(prompt_blocks) > new else None
            out.append(
                {
                    "event_id": self._event_id(),
                    "ts": round(started_ts + 0.05, 6),
                    "type": "kv_blocks_stored",
                    "tier": "hbm",
                    "instance_id": s.instance_id,
                    "block_hashes": prompt_blocks[-new:],
                    "parent_block_hash": parent,
                    "block_tokens": BLOCK_TOKENS,
                }
            )
        out.append(
            {
                "event_id": self._event_id(),
                "ts": finished_ts,
                "type": "request_finished",
                **common,
                "output_tokens": output_tokens,
                "context_tokens": context_tokens,
                "block_hashes": list(s.blocks),
                "block_tokens": BLOCK_TOKENS,
            }
        )
        if extras and rng.random() < self.status_share:
            total = 80 * 2**30
            out.append(
                {
                    "event_id": self._event_id(),
                    "ts": routed_ts,
                    "type": "instance_status",
                    "instance_id": rng.choice(self.instances),
                    "free_kv_bytes": rng.randint(0, total),
                    "total_kv_bytes": total,
                    "queue_depth": rng.randint(0, 40),
                    "running_requests": rng.randint(0, 256),
                }
            )
        return out

    def _step(self, *, new_sessions: bool, extras: bool) -> list[dict[str, Any]] | None:
        """One turn of a random active session; None when nothing is left to run."""
        active = self._active
        while new_sessions and len(active) < self.active_target:
            active.append(self._new_session())
        if not active:
            return None
        i = self.rng.randrange(len(active))
        s = active[i]
        events = self._turn(s, extras=extras)
        if s.turns_left <= 0:
            active[i] = active[-1]
            active.pop()
        return events

    # -- what the benchmarks call -------------------------------------------------------------

    def batches(self, n_batches: int, batch_size: int) -> list[bytes]:
        """n pre-serialised POST /v1/events bodies of batch_size events each."""
        bodies = []
        carry = self._carry
        for _ in range(n_batches):
            events = carry
            while len(events) < batch_size:
                step = self._step(new_sessions=True, extras=True)
                assert step is not None
                events.extend(step)
            carry = events[batch_size:]
            bodies.append(orjson.dumps({"events": events[:batch_size]}))
        self._carry = carry
        return bodies

    def session_chunks(
        self, sessions: int, chunk_events: int = 1_000
    ) -> Iterator[list[dict[str, Any]]]:
        """Exactly `sessions` whole sessions (routed, started, finished per turn), in chunks."""
        chunk: list[dict[str, Any]] = []
        while True:
            allow_new = self.sessions_started < sessions
            # Start sessions one at a time so that exactly `sessions` are started.
            if allow_new and len(self._active) < self.active_target:
                self._active.append(self._new_session())
                continue
            step = self._step(new_sessions=False, extras=False)
            if step is None:
                break
            chunk.extend(step)
            if len(chunk) >= chunk_events:
                yield chunk
                chunk = []
        if chunk:
            yield chunk
