"""Capture the frames of vLLM's own KV-event publisher as test fixtures (run by hand).

    PYTHONPATH=.:client python -m tests.integrations.vllm.capture PATH/TO/kv_events.py [OUT]

`kv_events.py` comes from the released wheel (`pip download vllm==0.33.0 --no-deps`, then unzip
`vllm/distributed/kv_events.py`; vLLM is Apache-2.0). Importing `vllm` needs torch; this module
does not: its four vllm imports are stubbed below, and the publisher class runs as released, on
loopback sockets. Every frame it sends, and its replay socket's answer, are written to
fixtures/vllm-0.33.0-frames.json (hex), which tests/integrations/vllm/publisher.py sends byte for
byte. The pre-#42892 positional encoding is produced by the same publisher from structs declared
`array_like=True`, as vLLM declared them before that change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import sys
import time
import types
from pathlib import Path
from typing import Any

import msgspec
import zmq

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "vllm-0.33.0-frames.json"
T0 = 1_764_670_000.0  # 2025-12-02: fixed stamps, so the fixture does not change between runs


def _stub_vllm() -> None:
    """The modules kv_events.py imports, reduced to what it uses."""

    def module(name: str, **attrs: Any) -> None:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m

    @dataclasses.dataclass
    class KVEventsConfig:
        enable_kv_cache_events: bool = False
        publisher: str | None = None
        endpoint: str = "tcp://*:5557"
        replay_endpoint: str | None = None
        buffer_steps: int = 10_000
        hwm: int = 100_000
        max_queue_size: int = 100_000
        topic: str = ""

    for name in ("vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core"):
        module(name)
    module("vllm.config.kv_events", KVEventsConfig=KVEventsConfig)
    module("vllm.logger", init_logger=logging.getLogger)
    module(
        "vllm.utils.network_utils",
        get_ip=lambda: "127.0.0.1",
        get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
        is_valid_ipv6_address=lambda ip: False,
        split_zmq_path=lambda path: tuple(path.rsplit(":", 2)),
    )
    module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)


def load_kv_events(path: Path) -> Any:
    _stub_vllm()
    spec = importlib.util.spec_from_file_location("vllm.distributed.kv_events", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vllm.distributed.kv_events"] = mod
    spec.loader.exec_module(mod)
    return mod


def int_hash(text: str) -> int:
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: the low 64 bits of a sha256.
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[-8:], "big")


def bytes_hash(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def _old_structs() -> tuple[Any, Any, Any]:
    """BlockStored, BlockRemoved, AllBlocksCleared as vLLM declared them before PR #42892."""

    class Old(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
        pass

    class BlockStored(Old):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class BlockRemoved(Old):
        block_hashes: list[int | bytes]
        medium: str | None

    class AllBlocksCleared(Old):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared


def _script(kv: Any, hash_of: Any, old: bool, n: int, t0: float, tag: str) -> list[Any]:
    """n batches of one engine's steps: stores (with session ids), a removal, a clear."""
    stored, removed, cleared = (
        _old_structs() if old else (kv.BlockStored, kv.BlockRemoved, kv.AllBlocksCleared)
    )
    batches = []
    parent = None
    for i in range(n):
        hashes = [hash_of(f"{tag}-{i}-{j}") for j in range(2)]
        tokens = list(range(i * 32, i * 32 + 32))
        if old:
            events = [stored(hashes, parent, tokens, 16, None, "GPU")]
        else:
            events = [
                stored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    token_ids=tokens,
                    block_size=16,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    group_idx=0,
                    session_id=f"{tag}-session-{i % 2}",
                )
            ]
        parent = hashes[-1]
        if i % 3 == 2:
            gone = [hash_of(f"{tag}-{i - 2}-0")]
            events.append(removed(gone, "GPU") if old else removed(block_hashes=gone, medium="GPU"))
        if i % 4 == 3:
            # offloaded to the CPU tier
            cpu = [hash_of(f"{tag}-{i}-0")]
            events.append(
                stored(cpu, None, tokens[:16], 16, None, "CPU")
                if old
                else stored(
                    block_hashes=cpu,
                    parent_block_hash=None,
                    token_ids=tokens[:16],
                    block_size=16,
                    lora_id=None,
                    medium="CPU",
                    lora_name=None,
                )
            )
        if i == n - 1 and not old:
            events.append(cleared())
        batches.append(kv.KVEventBatch(ts=t0 + i * 0.5, events=events))
    return batches


def path_of(kv: Any) -> str:
    return str(getattr(kv, "__file__", "kv_events.py"))


def capture(kv: Any, batches: list[Any], rank: int) -> dict[str, Any]:
    """Run the publisher, subscribe, publish `batches`, ask a replay from 0; every frame, hex."""
    # Port 0: the publisher binds where the system says and reports it (its node IP is the
    # stub's 127.0.0.1), so no port is picked before it is bound.
    pub = kv.ZmqEventPublisher(
        data_parallel_rank=rank,
        endpoint="tcp://*:0",
        replay_endpoint="tcp://*:0",
        buffer_steps=64,
    )
    bound = pub.get_publisher_config()
    if bound.endpoint.endswith(":0") or str(bound.replay_endpoint).endswith(":0"):
        pub.shutdown()
        raise SystemExit(f"{path_of(kv)}: this publisher does not report the port it bound")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(bound.endpoint)
    time.sleep(0.5)
    for b in batches:
        pub.publish(b)
    live = [sub.recv_multipart() for _ in batches]
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(bound.replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replay = []
    while True:
        frames = dealer.recv_multipart()
        replay.append(frames)
        if frames[2] == pub.END_SEQ:
            break
    pub.shutdown()
    sub.close(linger=0)
    dealer.close(linger=0)
    return {
        "data_parallel_rank": rank,
        "frames": [[f.hex() for f in m] for m in live],
        "replay_from_0": [[f.hex() for f in m] for m in replay],
    }


def main(path: str, out: Path = FIXTURE) -> None:
    kv = load_kv_events(Path(path))
    streams = {
        "tagged_int": capture(kv, _script(kv, int_hash, False, 8, T0, "a"), 0),
        "tagged_int_restarted": capture(kv, _script(kv, int_hash, False, 4, T0 + 60, "b"), 0),
        "tagged_bytes": capture(kv, _script(kv, bytes_hash, False, 4, T0, "c"), 0),
        "array_int": capture(kv, _script(kv, int_hash, True, 4, T0, "d"), 0),
        "tagged_int_dp1": capture(kv, _script(kv, int_hash, False, 4, T0, "e"), 1),
    }
    out.write_text(
        json.dumps(
            {
                "source": "vllm 0.33.0 wheel, vllm/distributed/kv_events.py ZmqEventPublisher "
                "(Apache-2.0), captured by tests/integrations/vllm/capture.py",
                "streams": streams,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1], *(Path(a) for a in sys.argv[2:3]))
