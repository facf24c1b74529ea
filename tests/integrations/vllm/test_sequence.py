"""The subscriber's bookkeeping alone: gap arithmetic, backoff, a replay asked again after a
timeout, a batch whose delivery fails for itself, and the supervised thread."""

from __future__ import annotations

import time

import pytest
import zmq

from app.core.errors import StoreUnavailable
from app.ingest.vllm.subscriber import (
    REPLAY_BACKOFF_CAP_SECONDS,
    REPLAY_BACKOFF_SECONDS,
    VllmSubscriber,
    backoff_seconds,
    count_missing,
    gap_to_ask,
)
from app.ingest.vllm.wire import VllmEndpoint, decode_batch, split_live
from kvprefetch_client.events import VllmKvEvents
from tests.integrations.vllm.publisher import FramePublisher, stream

EP = VllmEndpoint("gpu-0", 0, "tcp://unused:1")


def test_a_gap_of_any_size_is_counted_by_arithmetic() -> None:
    t0 = time.perf_counter()
    assert count_missing(1, 2**63, {5, 2**63 - 1, 2**63, 0, 7}) == 2**63 - 1 - 3
    assert count_missing(0, 2**64 - 1, set()) == 2**64 - 1
    assert count_missing(3, 3, {3}) == 0 and count_missing(5, 2, set()) == 0
    assert count_missing(1, 4, [1, 2, 3]) == 0
    print(f"\ncounting 2^64 numbers took {(time.perf_counter() - t0) * 1e6:.0f} us")


def test_only_what_the_replay_buffer_can_hold_is_asked() -> None:
    assert gap_to_ask(1, 2**63, 10_000) == 2**63 - 10_000
    assert gap_to_ask(0, 2**64 - 2, 64) == 2**64 - 66
    assert gap_to_ask(5, 9, 10_000) == 5  # a short gap: all of it


def test_backoff_doubles_up_to_its_cap() -> None:
    first, cap = REPLAY_BACKOFF_SECONDS, REPLAY_BACKOFF_CAP_SECONDS
    pauses = [backoff_seconds(n, first, cap) for n in range(1, 12)]
    assert pauses[:3] == [first, 2 * first, 4 * first]
    assert pauses == sorted(pauses) and max(pauses) == cap
    assert backoff_seconds(10**9, first, cap) == cap  # no overflow however many tries
    assert backoff_seconds(0, first, cap) == first


def ids(batches: list[VllmKvEvents]) -> list[str]:
    return [b.event_id for b in batches]


def run_until(sub: VllmSubscriber, got: list[VllmKvEvents], n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"{len(got)} of {n} batches: {sub.totals}"
        time.sleep(0.02)


def test_a_replay_that_times_out_is_asked_again_while_the_gap_is_open() -> None:
    frames = stream("tagged_int")
    pub = FramePublisher(ignore_requests=2)  # the catch-up on connecting and the first ask
    got: list[VllmKvEvents] = []
    sub = VllmSubscriber(
        [VllmEndpoint("gpu-0", 0, pub.endpoint, pub.replay_endpoint)],
        got.extend,
        replay_timeout_seconds=0.3,
        replay_retry_seconds=60.0,
    )
    sub.start()
    try:
        deadline = time.monotonic() + 60
        while sub.totals.connects == 0 or pub.requests < 1:  # connected, catch-up asked
            assert time.monotonic() < deadline
            time.sleep(0.02)
        pub.publish(frames[0])
        run_until(sub, got, 1)
        pub.publish(frames[1], drop=True)
        pub.publish(frames[2], drop=True)
        pub.publish(frames[3])
        run_until(sub, got, 4)
    finally:
        sub.stop()
        pub.close()
    want = [decode_batch(EP, *split_live(f)).event_id for f in frames[:4]]
    assert ids(got) == want  # recovered, in order: batch 3 waited for the gap
    assert (sub.totals.recovered, sub.totals.lost) == (2, 0)
    assert pub.requests >= 3


def test_a_replay_that_never_answers_is_lost_once_the_gap_is_given_up() -> None:
    frames = stream("tagged_int")
    pub = FramePublisher(ignore_requests=10**6)
    got: list[VllmKvEvents] = []
    sub = VllmSubscriber(
        [VllmEndpoint("gpu-0", 0, pub.endpoint, pub.replay_endpoint)],
        got.extend,
        replay_timeout_seconds=0.2,
        replay_retry_seconds=1.0,
    )
    sub.start()
    try:
        time.sleep(0.5)
        pub.publish(frames[0])
        run_until(sub, got, 1)
        pub.publish(frames[1], drop=True)
        pub.publish(frames[2])
        run_until(sub, got, 2)
    finally:
        sub.stop()
        pub.close()
    assert sub.totals.lost == 1
    assert pub.requests >= 3  # the catch-up, then the gap asked more than once


def test_a_batch_whose_delivery_fails_for_itself_is_refused_and_the_rest_delivered() -> None:
    batches = [decode_batch(EP, *split_live(f)) for f in stream("tagged_int")[:4]]
    poison = batches[2].event_id
    delivered: list[str] = []
    calls = {"transient": 0}

    def deliver(bs: list[VllmKvEvents]) -> None:
        if calls["transient"] < 2:  # the store down twice: retried, nothing refused
            calls["transient"] += 1
            raise StoreUnavailable("redis down")
        if any(b.event_id == poison for b in bs):
            raise ValueError("this batch breaks the ingest")
        delivered.extend(b.event_id for b in bs)

    sub = VllmSubscriber([EP], deliver)
    sub._hand_on(batches)
    assert delivered == [b.event_id for b in batches if b.event_id != poison]
    assert sub.totals.bad_input == {"apply": 1}
    assert sub.totals.batches == 3 and calls["transient"] == 2


def test_a_dead_intake_is_counted_and_started_again(monkeypatch: pytest.MonkeyPatch) -> None:
    pub = FramePublisher()
    got: list[VllmKvEvents] = []
    sub = VllmSubscriber([VllmEndpoint("gpu-0", 0, pub.endpoint, pub.replay_endpoint)], got.extend)
    real_open = sub._open
    failures = {"left": 2}

    def flaky_open(ep: VllmEndpoint) -> object:
        if failures["left"]:
            failures["left"] -= 1
            raise zmq.ZMQError(zmq.EMFILE)
        return real_open(ep)

    monkeypatch.setattr(sub, "_open", flaky_open)
    sub.start()
    try:
        deadline = time.monotonic() + 60
        while not sub.alive:
            assert time.monotonic() < deadline, sub.totals
            time.sleep(0.02)
        assert sub.totals.deaths == 2
        time.sleep(0.3)
        pub.publish(stream("tagged_int")[0])
        run_until(sub, got, 1)
    finally:
        sub.stop()
        pub.close()
    assert not sub.alive


def test_a_gap_is_given_up_once_a_receive_queue_of_messages_waits_behind_it() -> None:
    frames = stream("tagged_int")
    pub = FramePublisher(ignore_requests=10**6)
    got: list[VllmKvEvents] = []
    sub = VllmSubscriber(
        [VllmEndpoint("gpu-0", 0, pub.endpoint, pub.replay_endpoint)],
        got.extend,
        replay_timeout_seconds=0.2,
        replay_retry_seconds=3600.0,  # never given up for time within this test
        receive_queue=3,
    )
    sub.start()
    try:
        time.sleep(0.5)
        pub.publish(frames[0])
        run_until(sub, got, 1)
        pub.publish(frames[1], drop=True)
        for f in frames[2:]:  # 6 wait behind the gap: more than the queue of 3
            pub.publish(f)
        run_until(sub, got, len(frames) - 1)
    finally:
        sub.stop()
        pub.close()
    assert sub.totals.lost == 1
    assert [b.event_id for b in got] == [
        decode_batch(EP, *split_live(f)).event_id for f in [frames[0], *frames[2:]]
    ]


def test_a_flood_logs_a_line_a_minute_per_publisher_and_kind(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from app.ingest.vllm import subscriber
    from app.ingest.vllm.wire import BadInput

    now = [1000.0]
    monkeypatch.setattr(subscriber.time, "monotonic", lambda: now[0])
    sub = VllmSubscriber([EP], lambda _: None)
    with caplog.at_level("WARNING", logger="app.ingest.vllm.subscriber"):
        for seq in range(1000):
            sub._bad(EP, seq, BadInput("nesting", "too deep"))
            sub._lost(EP, 1, seq, seq, None)
        now[0] += 61
        sub._bad(EP, 1000, BadInput("nesting", "too deep"))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert lines[2].endswith("(999 more such lines not logged in the last minute)")
    assert sub.totals.bad_input == {"nesting": 1001} and sub.totals.lost == 1000


def test_a_publisher_whose_replay_hangs_holds_no_other_publisher_back() -> None:
    frames = stream("tagged_int")
    hung = FramePublisher(answer_requests=1)  # the catch-up on connecting, then never again
    good = FramePublisher()
    got: list[VllmKvEvents] = []
    sub = VllmSubscriber(
        [
            VllmEndpoint("gpu-hung", 0, hung.endpoint, hung.replay_endpoint),
            VllmEndpoint("gpu-good", 0, good.endpoint, good.replay_endpoint),
        ],
        got.extend,
        replay_timeout_seconds=3600.0,  # a replay waited on for an hour
        replay_retry_seconds=3600.0,
    )
    sub.start()
    try:
        deadline = time.monotonic() + 60
        while not (sub.alive and sub.totals.connects >= 2 and hung.requests >= 1):
            assert time.monotonic() < deadline, sub.totals
            time.sleep(0.02)
        hung.publish(frames[0])
        run_until(sub, got, 1)
        hung.publish(frames[1], drop=True)
        hung.publish(frames[2])  # a gap: its thread waits on the replay socket
        while hung.requests < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for f in frames:
            good.publish(f)
        run_until(sub, got, 1 + len(frames))
    finally:
        sub.stop()
        hung.close()
        good.close()
    assert sum(b.instance_id == "gpu-good" for b in got) == len(frames)
    assert sub.totals.lost == 1  # given up at the stop


def test_a_bad_message_waiting_for_a_gap_is_refused_once_however_many_tries() -> None:
    frames = stream("tagged_int")
    pub = FramePublisher(ignore_requests=3)  # the catch-up on connecting and two tries
    got: list[VllmKvEvents] = []
    sub = VllmSubscriber(
        [VllmEndpoint("gpu-0", 0, pub.endpoint, pub.replay_endpoint)],
        got.extend,
        replay_timeout_seconds=0.3,
        replay_retry_seconds=60.0,
    )
    sub.start()
    try:
        deadline = time.monotonic() + 60
        while sub.totals.connects == 0 or pub.requests < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        pub.publish(frames[0])
        run_until(sub, got, 1)
        pub.publish(frames[1], drop=True)
        pub.publish([b"", (2).to_bytes(8, "big"), b"\xc1"])  # not msgpack, after the gap
        pub.publish(frames[3])
        run_until(sub, got, 3)
    finally:
        sub.stop()
        pub.close()
    assert ids(got) == [decode_batch(EP, *split_live(frames[i])).event_id for i in (0, 1, 3)]
    assert pub.requests >= 4 and sub.totals.bad_input == {"msgpack": 1}
