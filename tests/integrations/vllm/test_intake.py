"""vLLM intake end to end, without mocks: real ZMQ publishers sending vLLM 0.33.0's own frames
(tests/integrations/vllm/publisher.py) into an Engine subscribed by KVP_VLLM_KV_ENDPOINTS; what
reached the event log and the store is read back. Every batch must be logged exactly once."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import pytest
import zmq

from app.core.config import Settings
from app.engine import Engine
from app.ingest.eventlog import iter_log
from app.ingest.vllm.wire import END_SEQ, VllmEndpoint, decode_batch, split_live
from tests.integrations.vllm.publisher import (
    FramePublisher,
    Frames,
    port_of,
    rank_publishers,
    replay_answer,
    stream,
)

WAIT_SECONDS = 20.0


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def store_kw(request: pytest.FixtureRequest) -> dict[str, object]:
    """The memory store, or Redis on a clean prefix: there the ingest runs on the store thread."""
    if request.param == "memory":
        return {}
    return {
        "store": "redis",
        "redis_url": request.getfixturevalue("redis_url"),
        "redis_prefix": request.getfixturevalue("clean_redis"),
    }


def build(tmp_path: Path, endpoints: str, **kw: object) -> Engine:
    settings = Settings(
        data_dir=tmp_path,
        log_fsync=False,
        replica_id="test-vllm",
        score_interval_seconds=0,
        plan_interval_seconds=0,
        dashboard_sample_seconds=0,
        model_dir=tmp_path / "no-model",
        vllm_kv_endpoints=endpoints,
        vllm_replay_timeout_seconds=2.0,
        **kw,
    )  # type: ignore[arg-type]
    return Engine(settings)


def logged_ids(engine: Engine) -> list[str]:
    return [e.event_id for _, e in iter_log(Path(engine.event_log.directory))]


def ids_of(instance: str, rank: int, frames: list[Frames]) -> list[str]:
    ep = VllmEndpoint(instance, rank, "tcp://unused:1")
    return [decode_batch(ep, *split_live(f)).event_id for f in frames]


async def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_SECONDS} s: {what}")
        await asyncio.sleep(0.02)


def run(coro: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(coro())  # type: ignore[arg-type]


def test_both_encodings_both_hash_kinds_and_two_ranks_are_taken_once(tmp_path: Path) -> None:
    d0, d1 = rank_publishers(2)
    pubs = {
        "tagged_int": FramePublisher(),
        "tagged_bytes": FramePublisher(),
        "array_int": FramePublisher(),
        "tagged_int@0": d0,
        "tagged_int_dp1": d1,
    }
    endpoints = (
        f"{pubs['tagged_int'].spec('gpu-a')} {pubs['tagged_bytes'].spec('gpu-b')};"
        f"{pubs['array_int'].spec('gpu-c')}\n{d0.spec('gpu-d')},dp=2"
    )
    engine = build(tmp_path, endpoints)
    names = {"tagged_int": "gpu-a", "tagged_bytes": "gpu-b", "array_int": "gpu-c"}
    expected = (
        ids_of("gpu-a", 0, stream("tagged_int"))
        + ids_of("gpu-b", 0, stream("tagged_bytes"))
        + ids_of("gpu-c", 0, stream("array_int"))
        + ids_of("gpu-d", 0, stream("tagged_int"))
        + ids_of("gpu-d", 1, stream("tagged_int_dp1"))
    )

    async def scenario() -> None:
        await engine.start()
        await asyncio.sleep(0.3)
        for key, pub in pubs.items():
            for frames in stream(key.split("@")[0]):
                pub.publish(frames)
        await until(lambda: len(set(logged_ids(engine))) == len(expected), "every batch logged")
        await asyncio.sleep(0.3)  # anything sent twice would be here by now
        await engine.close()

    try:
        run(scenario)
    finally:
        for pub in pubs.values():
            pub.close()
    ids = logged_ids(engine)
    assert sorted(ids) == sorted(expected)  # each once: nothing lost, nothing twice
    assert len(set(ids)) == len(ids)
    # The rank is in every id, so the two ranks' identical sequence numbers do not collide.
    assert any(":gpu-d:1:" in i for i in ids) and any(":gpu-d:0:" in i for i in ids)
    # What the blocks became: the int, bytes (hex) and positional streams' first stores live on;
    # the tagged streams end with AllBlocksCleared, so their HBM is empty and CPU copies stay.
    store = engine.store
    for key, instance in names.items():
        first = decode_batch(VllmEndpoint(instance, 0, "x"), *split_live(stream(key)[0]))
        hashes = first.events[0].block_hashes  # type: ignore[union-attr]
        held = store.holds("hbm", instance, hashes)
        # the first block removed two batches later; the tagged streams' HBM then cleared
        assert held == ([False, False] if key != "array_int" else [False, True]), key
    last_cpu = decode_batch(VllmEndpoint("gpu-b", 0, "x"), *split_live(stream("tagged_bytes")[3]))
    cpu_hashes = last_cpu.events[1].block_hashes  # type: ignore[union-attr]
    assert isinstance(cpu_hashes[0], str) and len(cpu_hashes[0]) == 64  # sha256 bytes, as hex
    assert store.holds("host", "gpu-b", cpu_hashes) == [True]
    assert engine.metrics.vllm_lost._value.get() == 0
    # vLLM's session_id is logged with its blocks (the event log keeps the batch as validated).
    logged = [e for _, e in iter_log(Path(engine.event_log.directory))]
    first_a = next(e for e in logged if e.event_id == expected[0])
    assert first_a.events[0].session_id == "a-session-0"  # type: ignore[attr-defined]


@pytest.mark.parametrize("omit_topic", [False, True], ids=["with-topic", "without-topic"])
def test_a_gap_is_recovered_through_the_replay_socket(
    tmp_path: Path, omit_topic: bool, store_kw: dict[str, object]
) -> None:
    pub = FramePublisher(omit_topic=omit_topic)
    engine = build(tmp_path, pub.spec("gpu-0"), **store_kw)
    frames = stream("tagged_int")
    expected = ids_of("gpu-0", 0, frames)

    async def scenario() -> None:
        await engine.start()
        await asyncio.sleep(0.3)
        pub.publish(frames[0])
        await until(lambda: len(logged_ids(engine)) == 1, "the first batch")
        for i in (1, 2, 3):  # buffered, never sent: the PUB socket dropped them
            pub.publish(frames[i], drop=True)
        for f in frames[4:]:
            pub.publish(f)
        await until(lambda: len(logged_ids(engine)) == len(expected), "the gap filled")
        await asyncio.sleep(0.3)
        await engine.close()

    try:
        run(scenario)
    finally:
        pub.close()
    assert logged_ids(engine) == expected  # in order, once each
    assert engine.vllm is not None
    totals = engine.vllm.totals
    assert (totals.recovered, totals.lost) == (3, 0)
    assert engine.metrics.vllm_recovered._value.get() == 3


def test_a_gap_the_buffer_no_longer_holds_is_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pub = FramePublisher(buffer_steps=3)
    engine = build(tmp_path, pub.spec("gpu-0"))
    frames = stream("tagged_int")
    ids = ids_of("gpu-0", 0, frames)

    async def scenario() -> None:
        await engine.start()
        await asyncio.sleep(0.3)
        pub.publish(frames[0])
        await until(lambda: len(logged_ids(engine)) == 1, "the first batch")
        for i in range(1, 6):  # 1..5 dropped; with 6 the buffer of 3 keeps 4, 5 and 6
            pub.publish(frames[i], drop=True)
        pub.publish(frames[6])
        await until(lambda: len(logged_ids(engine)) == 4, "what could be had")
        pub.publish(frames[7])
        await until(lambda: len(logged_ids(engine)) == 5, "the stream goes on")
        await asyncio.sleep(0.3)
        await engine.close()

    with caplog.at_level(logging.WARNING, logger="app.ingest.vllm.subscriber"):
        try:
            run(scenario)
        finally:
            pub.close()
    assert logged_ids(engine) == [ids[0], ids[4], ids[5], ids[6], ids[7]]
    assert engine.metrics.vllm_lost._value.get() == 3  # 1, 2 and 3: reported, not hidden
    assert engine.metrics.vllm_recovered._value.get() == 2
    lost = [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
    assert lost == [
        "vLLM publisher gpu-0: 3 batches between sequence 1 and 5 are lost "
        "(the replay buffer no longer holds them)"
    ]


# 5 taken before: the new engine's 4 batches reuse sequence numbers already passed; 2 taken
# before: the new engine is past them by the time the subscriber hears it again.
@pytest.mark.parametrize("taken_before", [5, 2])
def test_a_killed_and_restarted_engine_is_followed_into_its_new_epoch(
    tmp_path: Path, store_kw: dict[str, object], taken_before: int
) -> None:
    first = FramePublisher()
    port, replay = first.endpoint, first.replay_endpoint
    engine = build(tmp_path, first.spec("gpu-0"), **store_kw)
    before, after = stream("tagged_int"), stream("tagged_int_restarted")
    expected = ids_of("gpu-0", 0, before[:taken_before]) + ids_of("gpu-0", 0, after)
    pubs: list[FramePublisher] = []

    async def scenario() -> None:
        await engine.start()
        pubs.append(first)
        await asyncio.sleep(0.3)
        for f in before[:taken_before]:
            pubs[0].publish(f)
        await until(lambda: len(logged_ids(engine)) == taken_before, "the first epoch")
        pubs[0].close()  # killed mid-stream: batches 5..7 of its epoch never come
        await asyncio.sleep(0.3)
        pubs.append(FramePublisher(port, replay))  # the engine is back: sequence from 0
        for f in after:  # at once: the subscriber may not have reconnected for the first ones
            pubs[1].publish(f)
        await until(lambda: len(logged_ids(engine)) == len(expected), "the new epoch")
        await asyncio.sleep(0.3)
        await engine.close()

    try:
        run(scenario)
    finally:
        for pub in pubs:
            pub.close()
    # The new epoch's batches 0..3 share sequence numbers with the old one's: not duplicates.
    assert logged_ids(engine) == expected
    assert engine.vllm is not None and engine.vllm.totals.restarts == 1
    assert engine.metrics.vllm_restarts._value.get() == 1
    assert engine.metrics.vllm_lost._value.get() == 0


def test_a_new_engine_whose_numbers_look_like_the_next_ones_is_told_apart(tmp_path: Path) -> None:
    """The old engine sent 0 and 1; the new one's 0 and 1 were dropped, and its 2 arrives where
    the old one's 2 was expected. Its buffer shows a new epoch: its 0 and 1 are fetched."""
    first = FramePublisher()
    port, replay = first.endpoint, first.replay_endpoint
    engine = build(tmp_path, first.spec("gpu-0"))
    before, after = stream("tagged_int"), stream("tagged_int_restarted")
    expected = ids_of("gpu-0", 0, before[:2]) + ids_of("gpu-0", 0, after[:3])
    pubs: list[FramePublisher] = []

    async def scenario() -> None:
        await engine.start()
        pubs.append(first)
        await asyncio.sleep(0.3)
        for f in before[:2]:
            pubs[0].publish(f)
        await until(lambda: len(logged_ids(engine)) == 2, "the first epoch")
        pubs[0].close()
        pubs.append(FramePublisher(port, replay))
        await asyncio.sleep(1.0)  # reconnected, its buffer empty then
        pubs[1].publish(after[0], drop=True)
        pubs[1].publish(after[1], drop=True)
        pubs[1].publish(after[2])
        await until(lambda: len(logged_ids(engine)) == len(expected), "the new epoch")
        await asyncio.sleep(0.3)
        await engine.close()

    try:
        run(scenario)
    finally:
        for pub in pubs:
            pub.close()
    assert logged_ids(engine) == expected
    assert engine.vllm is not None
    assert (engine.vllm.totals.restarts, engine.vllm.totals.lost) == (1, 0)


def test_bad_input_is_counted_and_logged_and_the_stream_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pub = FramePublisher()
    port = port_of(pub.endpoint)
    engine = build(tmp_path, pub.spec("gpu-0"))
    good = stream("tagged_int")
    enc = msgspec.msgpack.encode

    def seq(n: int) -> bytes:
        return n.to_bytes(8, "big")

    def stored(hashes: list[object]) -> dict[str, object]:
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                "token_ids": [], "block_size": 16, "lora_id": None, "medium": "GPU"}  # fmt: skip

    bad: list[tuple[str, Frames]] = [
        ("msgpack", [b"", seq(1), b"\xc1not msgpack"]),
        ("event_type", [b"", seq(2), enc([1.7e9, [{"type": "BlockMoved"}], 0])]),
        ("event_type", [b"", seq(3), enc([1.7e9, [["BlockMoved", [1]]], 0])]),
        ("hash", [b"", seq(4), enc([1.7e9, [stored([1.5])], 0])]),
        ("hash", [b"", seq(5), enc([1.7e9, [stored(["a-string"])], 0])]),
        ("shape", [b"", seq(6), enc({"ts": 1.7e9})]),
        ("shape", [b"", seq(7), enc([1.7e9, [42], 0])]),
        ("field", [b"", seq(8), enc([1.7e9, [stored([1]) | {"block_size": 0}], 0])]),
        ("frames", [b"", seq(9)]),
        ("frames", [b"", b"\x00\x09", b"x"]),
    ]
    # The good batches after the bad ones take the sequence on from 9; the last one's session id
    # is no session id: dropped and counted, its blocks taken.
    tail = [[b"", seq(9 + i), f[2]] for i, f in enumerate(good[1:4])]
    tail.append([b"", seq(12), enc([1.7e9, [stored([7]) | {"session_id": "a/b"}], 0])])
    ep = VllmEndpoint("gpu-0", 0, "x")
    expected = [
        decode_batch(ep, *split_live(good[0])).event_id,
        *(decode_batch(ep, *split_live(f)).event_id for f in tail),
    ]

    async def scenario() -> None:
        await engine.start()
        await asyncio.sleep(0.3)
        pub.publish(good[0])
        await until(lambda: len(logged_ids(engine)) == 1, "the first batch")
        for _, frames in bad:
            pub.publish(frames)
        for frames in tail:
            pub.publish(frames)
        await until(lambda: len(logged_ids(engine)) == len(expected), "the good ones after")
        await asyncio.sleep(0.3)
        await engine.close()

    with caplog.at_level(logging.WARNING, logger="app.ingest.vllm.subscriber"):
        try:
            run(scenario)
        finally:
            pub.close()
    assert logged_ids(engine) == expected
    assert engine.store.holds("hbm", "gpu-0", [7]) == [True]
    reasons = Counter(reason for reason, _ in bad) + Counter(["session_id"])
    assert engine.vllm is not None
    assert engine.vllm.totals.bad_input == dict(reasons)
    for reason, n in reasons.items():
        assert engine.metrics.vllm_bad_input.labels(reason)._value.get() == n
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == len(reasons)  # a line per reason a minute: a flood logs little
    assert any(
        m.startswith(f"vLLM publisher gpu-0 (tcp://127.0.0.1:{port}), sequence 1: message refused "
                     "(msgpack)")
        for m in refused
    )  # fmt: skip
    assert engine.metrics.vllm_lost._value.get() == 0  # a bad batch is no gap


def test_the_helper_replays_exactly_what_vllm_replayed() -> None:
    """The fixture publisher's replay socket answers byte for byte as vLLM's did."""
    pub = FramePublisher()
    for frames in stream("tagged_int"):
        pub.publish(frames, drop=True)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()
            got.append(frames)
            if frames[2] == END_SEQ:
                break
    finally:
        dealer.close(linger=0)
        pub.close()
    assert got == replay_answer("tagged_int")


def test_a_batch_from_a_clock_far_ahead_is_refused_as_posted_ones_are(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pub = FramePublisher()
    engine = build(tmp_path, pub.spec("gpu-0"))
    good = stream("tagged_int")
    ahead = msgspec.msgpack.decode(good[1][2])
    ahead[0] = time.time() + 10_000  # an engine host's clock hours ahead
    frames = [good[0], [b"", good[1][1], msgspec.msgpack.encode(ahead)], good[2]]

    async def scenario() -> None:
        await engine.start()
        await asyncio.sleep(0.3)
        for f in frames:
            pub.publish(f)
        await until(lambda: len(logged_ids(engine)) == 2, "the two on time")
        await asyncio.sleep(0.3)
        await engine.close()

    with caplog.at_level(logging.WARNING, logger="app.engine"):
        try:
            run(scenario)
        finally:
            pub.close()
    assert logged_ids(engine) == ids_of("gpu-0", 0, [good[0], good[2]])
    assert engine.metrics.events_refused_by_time.labels("clock_skew")._value.get() == 1
    assert any("vLLM batches refused: ts" in r.getMessage() for r in caplog.records)


def test_a_block_stored_for_a_router_session_joins_its_context(tmp_path: Path) -> None:
    """vLLM's session_id is the router's: the first batch's blocks (no parent) start
    a-session-0's context; a-session-1's blocks name a parent its context does not hold (the
    captured engine chained them after a-session-0's), so they join nothing."""
    from kvprefetch_client.events import RequestRouted

    pub = FramePublisher()
    engine = build(tmp_path, pub.spec("gpu-a"))
    frames = stream("tagged_int")
    first = decode_batch(VllmEndpoint("gpu-a", 0, "x"), *split_live(frames[0]))
    t0 = first.ts - 1.0
    engine.ingest(
        [
            RequestRouted(event_id=f"route-{s}", ts=t0, session_id=s, request_id=f"{s}-r1",
                          instance_id="gpu-a", prompt_tokens=32)
            for s in ("a-session-0", "a-session-1")
        ]
    )  # fmt: skip

    async def scenario() -> None:
        await engine.start()
        await asyncio.sleep(0.3)
        for f in frames:
            pub.publish(f)
        want = len(ids_of("gpu-a", 0, frames)) + 2
        await until(lambda: len(set(logged_ids(engine))) == want, "every batch logged")
        await engine.close()

    try:
        run(scenario)
    finally:
        pub.close()
    assert engine.store.session("a-session-0").block_hashes == first.events[0].block_hashes  # type: ignore[union-attr]
    assert engine.store.session("a-session-1").block_hashes == []
