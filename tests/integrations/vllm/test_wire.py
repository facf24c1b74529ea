"""vLLM's wire format, message by message: endpoints setting, frames, both encodings, hashes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from app.core.config import Settings
from app.engine import Engine
from app.ingest.vllm.wire import (
    END_SEQ,
    BadInput,
    VllmEndpoint,
    decode_batch,
    event_id,
    parse_endpoints,
    split_live,
    split_replayed,
)
from kvprefetch_client.events import KvBlocksStored, VllmBlockStored, event_adapter
from tests.integrations.vllm.publisher import FIXTURE, replay_answer, stream

EP = VllmEndpoint("gpu-0", 0, "tcp://127.0.0.1:5557")


def test_endpoints_parse_with_replay_ranks_and_topic() -> None:
    eps = parse_endpoints(
        "gpu-0=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5600,dp=2;gpu-1=tcp://h:7,topic=kv\n"
    )
    assert eps == [
        VllmEndpoint("gpu-0", 0, "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5600"),
        # vLLM's rule: rank r publishes on port + r, replay too
        VllmEndpoint("gpu-0", 1, "tcp://10.0.0.5:5558", "tcp://10.0.0.5:5601"),
        VllmEndpoint("gpu-1", 0, "tcp://h:7", None, "kv"),
    ]
    assert eps[1].name == "gpu-0/dp1"
    assert parse_endpoints("  ") == []


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("gpu-0", "instance_id=tcp://host:port"),
        ("gpu-0=http://h:1", "is not tcp://host:port"),
        ("gpu-0=tcp://h:1,dp=0", "dp must be"),
        ("gpu-0=tcp://h:1,speed=9", "unknown option 'speed'"),
        ("gpu-0=tcp://h:1 gpu-0=tcp://h:2", "listed twice"),
        ("gpu/0=tcp://h:1", "instance_id=tcp://host:port"),
    ],
)
def test_a_bad_endpoint_entry_stops_the_engine_named(
    text: str, names: str, tmp_path: object
) -> None:
    with pytest.raises(ValueError, match=names):
        parse_endpoints(text)
    with pytest.raises(ValueError, match=names):
        Engine(Settings(data_dir=tmp_path, vllm_kv_endpoints=text))  # type: ignore[call-arg]


def test_captured_frames_decode_in_both_encodings_and_both_hash_kinds() -> None:
    tagged = decode_batch(EP, *split_live(stream("tagged_int")[0]))
    old = decode_batch(EP, *split_live(stream("array_int")[0]))
    raw = decode_batch(EP, *split_live(stream("tagged_bytes")[0]))
    for batch in (tagged, old, raw):
        stored = batch.events[0]
        assert isinstance(stored, VllmBlockStored)
        assert stored.block_size == 16 and stored.medium == "GPU" and len(stored.token_ids) == 32
    assert all(isinstance(h, int) for h in tagged.events[0].block_hashes)  # type: ignore[union-attr]
    # Bytes hashes (32-byte sha256) become their hex: a stable BlockHash string.
    hexed = raw.events[0].block_hashes  # type: ignore[union-attr]
    assert all(isinstance(h, str) and len(h) == 64 for h in hexed)
    assert tagged.events[0].session_id == "a-session-0"  # type: ignore[union-attr]
    assert old.events[0].session_id is None  # type: ignore[union-attr]
    assert tagged.event_id == "vllm:gpu-0:0:0:1764670000.0" == event_id("gpu-0", 0, 0, 1764670000.0)
    (sub,) = [e for e in tagged.expand() if isinstance(e, KvBlocksStored)]
    assert (sub.tier, sub.instance_id, sub.block_tokens) == ("hbm", "gpu-0", 16)


def test_the_rank_in_the_payload_must_be_the_publishers() -> None:
    rank1 = stream("tagged_int_dp1")[0]
    assert decode_batch(VllmEndpoint("gpu-0", 1, "x"), *split_live(rank1)).data_parallel_rank == 1
    with pytest.raises(BadInput) as exc:
        decode_batch(EP, *split_live(rank1))
    assert exc.value.reason == "field"


def test_replay_answers_with_and_without_the_topic_frame() -> None:
    answers = replay_answer("tagged_int")
    assert split_replayed(answers[-1]) is None  # vLLM's end marker
    assert answers[-1][2] == END_SEQ
    seq, payload = split_replayed(answers[2])  # type: ignore[misc]
    assert seq == 2
    no_topic = [answers[2][0], answers[2][2], answers[2][3]]
    assert split_replayed(no_topic) == (2, payload)
    assert split_replayed([b"", END_SEQ, b""]) is None
    with pytest.raises(BadInput):
        split_replayed([b"", b"\x00", b"x"])


def test_a_batch_too_many_fields_long_or_with_a_huge_bytes_hash_is_refused() -> None:
    enc = msgspec.msgpack.encode
    huge = [1.7e9, [["BlockStored", [b"x" * 65], None, [], 16, None, "GPU"]], 0]
    with pytest.raises(BadInput) as exc:
        decode_batch(EP, 0, enc(huge))
    assert exc.value.reason == "hash"  # 130 hex characters: over BlockHash's 128
    too_long = [1.7e9, [["BlockRemoved", [1], "GPU", 0, None, None, "extra"]], 0]
    with pytest.raises(BadInput) as exc:
        decode_batch(EP, 0, enc(too_long))
    assert exc.value.reason == "field"


def test_the_json_http_form_still_takes_vllm_events_with_a_session_id() -> None:
    e = event_adapter.validate_json(
        b'{"type": "vllm_kv_events", "event_id": "v1", "ts": 1.0, "instance_id": "gpu-0",'
        b' "events": [{"type": "BlockStored", "block_hashes": [1, "ab"], "parent_block_hash": null,'
        b' "token_ids": [], "block_size": 16, "medium": "STORAGE", "session_id": "s-1"},'
        b' ["BlockRemoved", [1], "GPU"]]}'
    )
    stored, removed = e.expand()  # type: ignore[union-attr]
    assert e.events[0].session_id == "s-1"  # type: ignore[union-attr]
    assert stored.tier == "disk" and removed.tier == "hbm"


def test_a_batch_is_expanded_once_and_its_expansion_is_no_part_of_the_event() -> None:
    """The store, the outcomes and the feedback each read a vLLM batch's expansion: built once.
    Cached outside the fields, it changes neither equality nor what is logged."""
    body = (
        b'{"type": "vllm_kv_events", "event_id": "v1", "ts": 1.0, "instance_id": "gpu-0",'
        b' "events": [["BlockStored", [1, 2], null, [], 16, null, "GPU"]]}'
    )
    e, fresh = event_adapter.validate_json(body), event_adapter.validate_json(body)
    first = e.expand()  # type: ignore[union-attr]
    assert e.expand() is first  # type: ignore[union-attr]
    assert [s.block_hashes for s in first] == [[1, 2]]  # type: ignore[union-attr]
    assert e == fresh
    assert e.model_dump_json() == fresh.model_dump_json()


def test_a_session_id_that_is_no_session_id_is_dropped_and_the_blocks_kept() -> None:
    enc = msgspec.msgpack.encode
    stored = {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None,
              "token_ids": [], "block_size": 16, "lora_id": None, "medium": "GPU"}  # fmt: skip
    dropped: list[str] = []
    batch = decode_batch(
        EP,
        0,
        enc([1.7e9, [stored | {"session_id": "x/y"}, stored | {"session_id": "ok"}]]),
        dropped,
    )
    assert dropped == ["'x/y'"]
    assert [e.session_id for e in batch.events] == [None, "ok"]  # type: ignore[union-attr]
    assert batch.data_parallel_rank == 0  # a payload without the rank: the publisher's


VENDORED = Path(__file__).resolve().parent / "vendor" / "vllm_0_33_0" / "kv_events.py"


def test_the_fixture_is_what_vllms_own_publisher_sends(tmp_path: Path) -> None:
    """Captures again with vLLM's publisher (fixed stamps, fixed hashes): the same bytes. The
    publisher is the released 0.33.0 file (vendor/), or the one KVP_TEST_VLLM_KV_EVENTS names."""
    out = tmp_path / "frames.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.integrations.vllm.capture",
         os.environ.get("KVP_TEST_VLLM_KV_EVENTS", str(VENDORED)), str(out)],
        cwd=Path(__file__).resolve().parents[3],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert out.read_bytes() == FIXTURE.read_bytes()
