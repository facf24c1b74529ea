"""What a publisher sends never stops the service's vLLM intake (issue 26, points 1 and 2).

Each test runs the service as a real process (`python -m kvprefetch_cli serve`, service.py)
subscribed to two real ZMQ publishers: a good one, and one that sends an attack. After the attack
the good publisher's batches must still be taken, and the attacker's own later ones too; the
metrics must name what happened; SIGTERM must stop the intake's thread, not leave it behind.
Memory and /healthz latency are printed (run with -s), never asserted.
"""

from __future__ import annotations

import signal
import statistics
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from tests.integrations.vllm.publisher import FramePublisher, Frames
from tests.integrations.vllm.service import Service, wait_for

pytestmark = pytest.mark.slow
MAX_MESSAGE_BYTES = 1 << 20
enc = msgspec.msgpack.encode


def seq_bytes(n: int) -> bytes:
    return n.to_bytes(8, "big")


def batch(seq: int, hashes: list[int]) -> Frames:
    """A valid batch (vLLM's tagged encoding) storing `hashes` on the GPU, stamped now."""
    stored = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
              "token_ids": [], "block_size": 16, "lora_id": None, "medium": "GPU"}  # fmt: skip
    return [b"", seq_bytes(seq), enc([time.time(), [stored], 0])]


def hbm_blocks(service: Service, instance: str) -> int:
    doc = httpx.get(f"{service.url}/v1/locations", timeout=10).json()
    return sum(loc["blocks"] for loc in doc["locations"] if loc["location"] == f"hbm@{instance}")


def holds(service: Service, instance: str, n: int) -> bool:
    return hbm_blocks(service, instance) >= n


def healthz_ms(service: Service, n: int = 5) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        assert httpx.get(f"{service.url}/healthz", timeout=30).status_code == 200
        out.append((time.perf_counter() - t0) * 1000)
    return out


DEEP = b"\x91" * 100_000 + b"\xc0"  # [[[...[nil]...]]]: 100,000 arrays deep, 100 KB
# (name, messages the attacker sends after its seq 0, bad_input reasons then expected at least
# once, batches the attacker sends after them that must be taken)
ATTACKS: dict[str, list[Frames]] = {
    "deep": [
        [b"", seq_bytes(1), DEEP],
        [b"", seq_bytes(2), b"\x93" + enc(1.7e9) + b"\x91" + DEEP + enc(0)],  # one deep event
    ],
    "malformed": [
        [b"", seq_bytes(1)],  # 2 frames
        [b"", seq_bytes(1), b"x", b"y"],  # 4 frames
        [b"", b"\x00" * 7, b"x"],  # a sequence of 7 bytes
        [b"", seq_bytes(1), enc({"ts": 1.7e9, "events": []})],  # msgpack, not a batch
        [b"", seq_bytes(2), enc(5)],
        [b"", seq_bytes(3), enc([1.7e9, [{"type": "BlockTeleported", "block_hashes": [1]}], 0])],
        [b"", seq_bytes(4), enc([1.7e9, [["BlockStored"]], 0])],  # an array event, fields short
        [b"", seq_bytes(5), enc([1.7e9, [{"type": "BlockStored", "block_hashes": [[[1]]]}], 0])],
        [b"", seq_bytes(6), enc([float("nan"), [], 0])],
    ],
    "seq_jump": [batch(2**63, [2_001])],
    "seq_back": [batch(2**64 - 1, [2_001]), batch(2**64 - 2, [2_002])],
    "oversized": [batch(1, list(range(2**40, 2**40 + 150_000)))],  # 1.35 MB > the 1 MiB cap
    # 60,000 64-bit hashes (540 KB): within the cap and MAX_BLOCKS_PER_EVENT, valid: taken
    "huge_blocks": [batch(1, list(range(2**40, 2**40 + 60_000)))],
    # a flood of messages that are not msgpack: counted each, logged once
    "flood": [[b"", seq_bytes(n), b"\xc1"] for n in range(1, 5_001)],
}
REASONS = {
    "deep": {"nesting"},
    "malformed": {"frames", "shape", "event_type", "hash"},
    "seq_jump": set(),
    "seq_back": set(),
    "oversized": set(),
    "huge_blocks": set(),
    "flood": {"msgpack"},
}
# The attacker's own next batch, and how many of its blocks then are in HBM.
AFTER = {
    "deep": (batch(3, [3_001]), 2),
    "malformed": (batch(7, [3_001]), 2),
    "seq_jump": (batch(2**63 + 1, [3_001]), 3),
    "seq_back": (batch(2**64 - 2 + 1, [3_001]), 4),
    "oversized": (batch(2, [3_001]), 2),
    "huge_blocks": (batch(2, [3_001]), 60_002),
    "flood": (batch(5_001, [3_001]), 2),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_an_attack_from_one_publisher_leaves_the_intake_taking_batches(
    tmp_path: Path, attack: str
) -> None:
    good, bad = FramePublisher(), FramePublisher()
    service = Service(
        tmp_path,
        {
            "KVP_VLLM_KV_ENDPOINTS": f"{good.spec('gpu-good')} {bad.spec('gpu-bad')}",
            "KVP_VLLM_MAX_MESSAGE_BYTES": str(MAX_MESSAGE_BYTES),
            "KVP_VLLM_REPLAY_TIMEOUT_SECONDS": "1",
            "KVP_VLLM_REPLAY_RETRY_SECONDS": "2",
        },
    )
    try:
        service.wait_ready("/readyz")
        time.sleep(0.5)  # both SUBs connected (a batch sent before would be replayed anyway)
        good.publish(batch(0, [1]))
        bad.publish(batch(0, [1_001]))
        wait_for(lambda: holds(service, "gpu-good", 1) and holds(service, "gpu-bad", 1), "seq 0")
        rss_before = service.rss_bytes()
        before_ms = healthz_ms(service)

        for frames in ATTACKS[attack]:
            bad.publish(frames)
        if attack == "oversized":
            # ZMQ dropped the connection; the next batch is sent once it is made again (and
            # the catch-up on connecting, which the big batch in the buffer spoils, is done).
            wait_for(lambda: "no catch-up from its replay socket" in service.log(), "reconnect")
        during_ms = healthz_ms(service)
        good.publish(batch(1, [2]))
        after, bad_blocks = AFTER[attack]
        bad.publish(after)
        # The good publisher's batch, and the attacker's own next one, are taken.
        wait_for(lambda: holds(service, "gpu-good", 2), "the good publisher's next batch")
        wait_for(lambda: holds(service, "gpu-bad", bad_blocks), "the attacker's next batch")
        good.publish(batch(2, [3]))
        wait_for(lambda: holds(service, "gpu-good", 3), "the good publisher goes on")

        rss_after = service.rss_bytes()
        print(
            f"\n{attack}: RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB; /healthz "
            f"median {statistics.median(before_ms):.1f} ms before, "
            f"{statistics.median(during_ms):.1f} ms (max {max(during_ms):.1f}) during"
        )
        for reason in REASONS[attack]:
            got = service.metric("kvprefetch_vllm_bad_input_total", f'{{reason="{reason}"}}')
            assert got >= 1, (reason, service.log()[-3000:])
        lost = service.metric("kvprefetch_vllm_batches_lost_total")
        restarts = service.metric("kvprefetch_vllm_publisher_restarts_total")
        if attack == "seq_jump":
            assert lost >= 2**63 - 1  # counted at once, by arithmetic
        if attack == "seq_back":
            assert restarts >= 1 and lost >= 2**64 - 3
        if attack == "oversized":
            # Cut off by ZMQ before it was held: none of its blocks taken, the batch lost.
            assert hbm_blocks(service, "gpu-bad") == 2 and lost >= 1
        if attack == "flood":
            assert service.log().count("message refused (msgpack)") == 1
        assert service.metric("kvprefetch_vllm_intake_deaths_total") == 0
        ready = httpx.get(f"{service.url}/readyz", timeout=30)
        assert ready.status_code == 200 and ready.json()["vllm_intake"] == "running"

        took = service.terminate()
        print(f"{attack}: SIGTERM to exit {took:.2f} s")
        # uvicorn shuts down, then re-raises the signal: a clean stop by SIGTERM
        assert service.proc.returncode in (0, -signal.SIGTERM), service.log()[-3000:]
        log = service.log()
        assert "the vLLM intake of gpu-bad stopped" in log, log[-3000:]
        assert "did not stop" not in log, log[-3000:]
    finally:
        service.kill()
        good.close()
        bad.close()


def test_sigterm_stops_the_intake_while_it_waits_on_a_replay_that_never_answers(
    tmp_path: Path,
) -> None:
    pub = FramePublisher(answer_requests=1)  # the catch-up on connecting, then none
    service = Service(
        tmp_path,
        {
            "KVP_VLLM_KV_ENDPOINTS": pub.spec("gpu-0"),
            "KVP_VLLM_REPLAY_TIMEOUT_SECONDS": "3600",  # one replay waited on for an hour
            "KVP_VLLM_REPLAY_RETRY_SECONDS": "3600",
        },
    )
    try:
        service.wait_ready("/readyz")
        time.sleep(0.5)
        pub.publish(batch(0, [1]))
        wait_for(lambda: holds(service, "gpu-0", 1), "batch 0")
        pub.publish(batch(1, [2]), drop=True)
        pub.publish(batch(2, [3]))  # a gap: the intake waits on the replay socket
        wait_for(lambda: "skipped from sequence 1 to 2" in service.log(), "the replay asked")
        took = service.terminate()
        print(f"\nSIGTERM to exit while a replay hangs: {took:.2f} s")
        assert service.proc.returncode in (0, -signal.SIGTERM), service.log()[-3000:]
        log = service.log()
        assert "the vLLM intake of gpu-0 stopped" in log, log[-3000:]
        assert "did not stop" not in log, log[-3000:]
    finally:
        service.kill()
        pub.close()
