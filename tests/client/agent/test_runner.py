"""The agent's loop, on a scripted source and an injected clock: times, cancels, pins, failures."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvprefetch_client.agent.buffer import HbmBuffer, PoolDir
from kvprefetch_client.agent.runner import Agent, progress_event_id
from kvprefetch_client.orders import Cancel
from tests.client.agent.fakes import T0, FakeClock, FakeReporter, FakeSource, order

BLOCK_BYTES = 1000
MARGIN = 0.05


class Rig:
    def __init__(
        self, tmp_path: Path, capacity_blocks: int = 8, pool_blocks: range = range(1, 11)
    ) -> None:
        self.clock = FakeClock()
        self.source = FakeSource(self.clock)
        self.reporter = FakeReporter()
        self.pool = PoolDir(tmp_path / "pool")
        for h in pool_blocks:
            self.pool.write(h, bytes([h % 256]) * BLOCK_BYTES)
        self.buffer = HbmBuffer(capacity_blocks * BLOCK_BYTES)
        self.agent = Agent(
            instance_id="gpu-0",
            source=self.source,
            pool=self.pool,
            buffer=self.buffer,
            reporter=self.reporter,
            clock=self.clock,
            start_margin_seconds=MARGIN,
            poll_seconds=0.5,
        )
        self.agent.start()

    def run_until(self, t: float) -> None:
        while self.clock.now < t:
            self.agent.run_once()

    def stored(self) -> list[object]:
        return [h for e in self.reporter.of_type("kv_blocks_stored") for h in e.block_hashes]

    def removed(self) -> list[object]:
        return [h for e in self.reporter.of_type("kv_blocks_removed") for h in e.block_hashes]


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


def test_a_prefetch_lands_real_bytes_and_reports_them(rig: Rig) -> None:
    token = rig.source.add(order("o1", [1, 2, 3]))
    rig.agent.run_once()
    assert [rig.buffer.get(h) for h in (1, 2, 3)] == [bytes([h]) * BLOCK_BYTES for h in (1, 2, 3)]
    assert rig.reporter.of_type("kv_blocks_cleared")[0].instance_id == "gpu-0"  # starts empty
    assert rig.reporter.progress() == [("o1", "accepted"), ("o1", "completed")]
    done = rig.reporter.of_type("order_progress")[-1]
    assert done.bytes == 3 * BLOCK_BYTES and done.seconds >= 0
    assert done.event_id == progress_event_id("o1", "completed")
    stored = rig.reporter.of_type("kv_blocks_stored")[0]
    assert (stored.tier, stored.instance_id, stored.block_hashes) == ("hbm", "gpu-0", [1, 2, 3])
    assert rig.source.acked == [token]
    assert rig.agent.status()["buffer_blocks"] == [1, 2, 3]


def test_blocks_already_there_are_not_moved_again(rig: Rig) -> None:
    rig.source.add(order("o1", [1, 2]))
    rig.source.add(order("o2", [2, 3]))
    rig.agent.run_once()
    assert rig.reporter.of_type("order_progress")[-1].bytes == BLOCK_BYTES
    assert rig.stored() == [1, 2, 3]


def test_an_early_order_waits_for_its_start_by(rig: Rig) -> None:
    rig.source.add(order("o1", [1], start_in=10.0))
    rig.run_until(T0 + 9.0)
    assert rig.clock.now < T0 + 10.0 - MARGIN
    assert rig.reporter.progress() == [] and 1 not in rig.buffer
    assert rig.agent.pending_order_ids() == ["o1"] and rig.source.acked == []
    rig.run_until(T0 + 11.0)
    accepted = rig.reporter.of_type("order_progress")[0]
    # It starts at start_by minus the margin, not a poll interval later.
    assert accepted.ts == pytest.approx(T0 + 10.0 - MARGIN)
    assert rig.reporter.progress("o1")[-1] == ("o1", "completed") and 1 in rig.buffer


def test_a_cancel_before_the_start_withdraws_the_order(rig: Rig) -> None:
    t_order = rig.source.add(order("o1", [1], start_in=10.0))
    t_cancel = rig.source.add(Cancel(order_id="o1", reason="session closed"), at=T0 + 5.0)
    rig.run_until(T0 + 20.0)
    assert rig.reporter.progress() == [] and 1 not in rig.buffer
    assert sorted(rig.source.acked) == sorted([t_order, t_cancel])
    assert rig.agent.stats.withdrawn == 1
    # Delivered again (a claim after a crash, a pull): still withdrawn, acked, not done.
    again = rig.source.add(order("o1", [1]))
    rig.agent.run_once()
    assert rig.reporter.progress() == [] and again in rig.source.acked


def test_a_cancel_that_arrives_before_its_order_still_withdraws_it(rig: Rig) -> None:
    rig.source.add(Cancel(order_id="o1"))
    rig.source.add(order("o1", [1]), at=T0 + 1.0)
    rig.run_until(T0 + 3.0)
    assert rig.reporter.progress() == [] and rig.agent.stats.withdrawn == 1
    assert len(rig.source.acked) == 2


def test_a_cancel_after_the_start_changes_nothing(rig: Rig) -> None:
    rig.source.add(order("o1", [1]))
    rig.source.add(Cancel(order_id="o1"), at=T0 + 1.0)
    rig.run_until(T0 + 3.0)
    assert rig.reporter.progress() == [("o1", "accepted"), ("o1", "completed")]
    assert 1 in rig.buffer and len(rig.source.acked) == 2


def test_pin_keeps_blocks_until_ttl_and_demote_sends_them_first(tmp_path: Path) -> None:
    rig = Rig(tmp_path, capacity_blocks=3)
    rig.source.add(order("fill", [1, 2, 3]))
    rig.source.add(order("pin", [1], kind="pin", ttl_seconds=100.0), at=T0 + 1)
    rig.source.add(order("more", [4]), at=T0 + 2)
    rig.run_until(T0 + 3)
    assert rig.removed() == [2]  # 1 was the oldest, but pinned
    pin_done = [e for e in rig.reporter.of_type("order_progress") if e.order_id == "pin"][-1]
    assert (pin_done.status, pin_done.bytes) == ("completed", BLOCK_BYTES)

    rig.source.add(order("demote", [4], kind="demote"), at=T0 + 4)
    rig.source.add(order("again", [5]), at=T0 + 5)
    rig.run_until(T0 + 6)
    assert rig.removed() == [2, 4]  # 3 was older; 4 was demoted
    rig.source.add(order("after-ttl", [6]), at=T0 + 102)
    rig.run_until(T0 + 103)
    assert rig.removed() == [2, 4, 1]  # the pin ran out
    assert sorted(rig.buffer.hashes()) == [3, 5, 6]


def test_pinning_blocks_that_are_not_there_fails_naming_them(rig: Rig) -> None:
    rig.source.add(order("pin", [7, 8], kind="pin", ttl_seconds=5.0))
    rig.agent.run_once()
    failed = rig.reporter.of_type("order_progress")[-1]
    assert failed.status == "failed" and "7" in failed.reason and "8" in failed.reason


def test_a_block_missing_from_the_pool_fails_the_order_naming_it(rig: Rig) -> None:
    token = rig.source.add(order("o1", [1, 404, 2]))
    rig.agent.run_once()
    assert rig.reporter.progress() == [("o1", "accepted"), ("o1", "failed")]
    failed = rig.reporter.of_type("order_progress")[-1]
    assert "block 404 not in the pool" in failed.reason and str(rig.pool.directory) in failed.reason
    assert rig.stored() == [] and len(rig.buffer) == 0
    assert rig.source.acked == [token]  # reported: not to be done again


def test_an_order_larger_than_the_buffer_fails_with_a_reason(tmp_path: Path) -> None:
    rig = Rig(tmp_path, capacity_blocks=2)
    rig.source.add(order("big", [1, 2, 3]))
    rig.agent.run_once()
    failed = rig.reporter.of_type("order_progress")[-1]
    assert failed.status == "failed" and "no room in hbm@gpu-0" in failed.reason
    # What did land is real, and reported.
    assert rig.stored() == [1, 2]


def test_orders_for_another_tier_or_source_fail(rig: Rig) -> None:
    rig.source.add(order("from-host", [1], source_tier="host"))
    rig.agent.run_once()
    assert "reads the pool, not host" in rig.reporter.of_type("order_progress")[-1].reason


def test_a_malformed_message_is_acked_and_the_agent_goes_on(rig: Rig) -> None:
    bad = [rig.source.add(b"not json"), rig.source.add(b'{"type": "order", "order_id": "x"}')]
    good = rig.source.add(order("o1", [1]))
    rig.agent.run_once()
    assert rig.agent.stats.malformed == 2
    assert sorted(rig.source.acked) == sorted([*bad, good])
    assert rig.reporter.progress("o1")[-1] == ("o1", "completed")


def test_a_redelivered_done_order_is_acked_and_not_done_again(rig: Rig) -> None:
    rig.source.add(order("o1", [1]))
    rig.agent.run_once()
    events = len(rig.reporter.events)
    again = rig.source.add(order("o1", [1]))
    rig.agent.run_once()
    assert len(rig.reporter.events) == events and again in rig.source.acked
    assert rig.agent.stats.repeats == 1


def test_a_repeat_of_a_waiting_order_is_done_once_and_both_deliveries_acked(rig: Rig) -> None:
    first = rig.source.add(order("o1", [1], start_in=2.0))
    second = rig.source.add(order("o1", [1], start_in=2.0), at=T0 + 1)
    rig.run_until(T0 + 3)
    assert rig.reporter.progress() == [("o1", "accepted"), ("o1", "completed")]
    assert sorted(rig.source.acked) == sorted([first, second])


def test_the_agent_binds_its_source_to_its_instance(rig: Rig) -> None:
    assert rig.source.bound == ["gpu-0"]


def test_a_misrouted_order_for_another_instance_is_acked_and_dropped(rig: Rig) -> None:
    # Each instance has its own stream: an order for gpu-9 in gpu-0's came from a writer that
    # bypassed the sink, and no gpu-9 agent reads this stream, so holding it would help no one.
    token = rig.source.add(order("o1", [1], instance_id="gpu-9"))
    rig.agent.run_once()
    assert rig.source.acked == [token]
    assert rig.reporter.progress() == [] and rig.agent.stats.foreign == 1
    assert rig.agent.pending_order_ids() == []


def test_nothing_is_acked_until_the_service_has_answered_for_the_reports(rig: Rig) -> None:
    rig.reporter.answering = False
    token = rig.source.add(order("o1", [1]))
    rig.agent.run_once()
    rig.agent.run_once()
    assert rig.reporter.progress("o1")[-1] == ("o1", "completed") and rig.source.acked == []
    rig.reporter.answering = True
    rig.agent.run_once()
    assert rig.source.acked == [token]


def test_among_due_orders_the_most_valuable_goes_first(rig: Rig) -> None:
    rig.source.add(order("low", [1], priority=1.0))
    rig.source.add(order("high", [2], priority=9.0))
    rig.agent.run_once()
    assert [o for o, s in rig.reporter.progress() if s == "accepted"] == ["high", "low"]


def test_progress_event_ids_fit_the_event_id_limit() -> None:
    assert progress_event_id("o1", "completed") == "order-o1-completed"
    long_id = "x" * 256
    assert len(progress_event_id(long_id, "completed")) <= 128
    assert progress_event_id(long_id, "failed") != progress_event_id("y" * 256, "failed")


def test_an_order_cancelled_through_another_agent_is_withdrawn_at_its_start(rig: Rig) -> None:
    token = rig.source.add(order("o1", [1], start_in=2.0))
    rig.agent.run_once()
    rig.source.cancelled_elsewhere.add("o1")  # the sink's cancel key, set after it arrived here
    rig.run_until(T0 + 3.0)
    assert rig.reporter.progress() == [] and 1 not in rig.buffer
    assert rig.source.acked == [token] and rig.agent.stats.withdrawn == 1


def test_the_loop_outlives_a_failing_source(rig: Rig) -> None:
    import threading

    from kvprefetch_client.agent.consumer import Delivery

    real_poll = rig.source.poll
    failures = [RuntimeError("redis is down")] * 3

    def flaky(max_wait_seconds: float) -> list[Delivery]:
        if failures:
            raise failures.pop()
        return real_poll(max_wait_seconds)

    rig.source.poll = flaky  # type: ignore[method-assign]
    rig.source.add(order("o1", [1]))
    stop = threading.Event()
    rig.agent._on_change = lambda status: stop.set() if status["completed"] else None
    rig.agent._poll = 0.001  # the real stop.wait between failures
    rig.agent.run(stop)
    assert rig.reporter.progress("o1")[-1] == ("o1", "completed") and not failures


def test_pulled_orders_repeated_by_their_lease_run_once(tmp_path: Path) -> None:
    import httpx
    import orjson

    from kvprefetch_client.agent.consumer import PullSource

    rig = Rig(tmp_path)
    o1, o2 = order("o1", [1], start_in=1.0), order("o2", [2], start_in=5.0)
    pulls = []

    def service(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/orders/renew":  # before a start: still ours
            ids = orjson.loads(request.content)["order_ids"]
            return httpx.Response(200, json={"renewed": ids, "lost": [], "lease_seconds": 30.0})
        pulls.append(rig.clock.now)
        # A lease runs out on every pull here: the same orders come back each time, until the
        # service sees them cancelled.
        cancelled = ["o2"] if len(pulls) == 3 else []
        orders = [o1] if len(pulls) >= 3 else [o1, o2]
        return httpx.Response(
            200,
            content=b'{"orders":['
            + b",".join(o.to_json() for o in orders)
            + b'],"cancelled":'
            + orjson.dumps(cancelled)
            + b"}",
        )

    def advance(seconds: float) -> None:
        rig.clock.now += seconds

    rig.agent.source = PullSource(
        "http://kvp", "gpu-0", transport=httpx.MockTransport(service), sleep=advance
    )
    for _ in range(12):
        rig.agent.run_once()
        rig.clock.now += 0.5  # the loop's own time (pulls that returned orders do not sleep)
    assert rig.reporter.progress() == [("o1", "accepted"), ("o1", "completed")]
    assert rig.agent.stats.withdrawn == 1 and rig.agent.stats.repeats >= 3
    assert 2 not in rig.buffer


def test_a_prefetch_with_a_ttl_holds_what_landed(rig: Rig) -> None:
    rig.source.add(order("o1", [1, 2], ttl_seconds=60.0))
    rig.agent.run_once()
    assert rig.buffer.pinned_bytes(rig.clock.now) == 2 * BLOCK_BYTES
    assert rig.buffer.pinned_bytes(rig.clock.now + 61.0) == 0


def test_a_pulled_order_behind_a_transfer_that_outlasts_its_lease_is_not_handed_to_a_second_agent(
    tmp_path: Path,
) -> None:
    """Real time, a real PullQueue behind the HTTP seam: agent A pulls two orders with a 1 s lease
    and runs the first for 3.5 s; its lease renewal (a thread) keeps the second, so agent B's pull
    in the middle of the transfer gets nothing, and A runs each order once."""
    import threading
    import time

    import httpx
    import orjson

    from app.deliver import PullQueue
    from kvprefetch_client.agent.consumer import PullSource
    from kvprefetch_client.events import OrderProgress
    from kvprefetch_client.orders import Order

    lease, transfer_seconds = 1.0, 3.5
    queue = PullQueue(lease_seconds=lease)
    lock = threading.Lock()

    def service(request: httpx.Request) -> httpx.Response:
        with lock:
            if request.url.path == "/v1/orders":
                p = request.url.params
                got = queue.lease(
                    p["instance_id"], int(p["limit"]), time.monotonic(), p.get("agent")
                )
                return httpx.Response(200, content=got.to_json())
            body = orjson.loads(request.content)
            renewed, lost = queue.renew(
                body["instance_id"], body["agent"], body["order_ids"], time.monotonic()
            )
            return httpx.Response(
                200, json={"renewed": renewed, "lost": lost, "lease_seconds": lease}
            )

    class Reporter(FakeReporter):
        def send(self, event: object) -> None:
            super().send(event)  # type: ignore[arg-type]
            if isinstance(event, OrderProgress):
                with lock:
                    queue.observe([event])  # the service hears of it at once

    b_got: list[list[str]] = []
    b = PullSource("http://kvp", "gpu-0", transport=httpx.MockTransport(service), agent="B")

    class SlowPool(PoolDir):
        def read(self, h: object) -> bytes:
            if h == 1:  # the first order's block: a transfer three leases long
                time.sleep(transfer_seconds)
                b_got.append([d.message.order_id for d in b.poll(0) if d.message is not None])
            return super().read(h)  # type: ignore[arg-type]

    pool = SlowPool(tmp_path / "pool")
    for h in (1, 2):
        pool.write(h, bytes([h]) * BLOCK_BYTES)
    now = time.monotonic()
    queue.submit_nowait(
        [
            Order(
                order_id=f"o{h}",
                kind="prefetch",
                instance_id="gpu-0",
                source_tier="pool",
                block_hashes=[h],
                size_bytes=BLOCK_BYTES,
                created_ts=now,
                start_by_ts=now,
                needed_by_ts=now + 60.0,
                priority=2.0 - h,
            )
            for h in (1, 2)
        ]
    )
    reporter = Reporter()
    a = Agent(
        instance_id="gpu-0",
        source=PullSource("http://kvp", "gpu-0", transport=httpx.MockTransport(service), agent="A"),
        pool=pool,
        buffer=HbmBuffer(8 * BLOCK_BYTES),
        reporter=reporter,
        clock=time.monotonic,
        start_margin_seconds=MARGIN,
        poll_seconds=0.01,
    )
    try:
        a.run_once()
    finally:
        a.source.close()
        b.close()
    print(
        f"\nB pulled {b_got} {transfer_seconds} s into A's transfer (lease {lease} s); "
        f"A renewed {queue.stats['renewed']} times"
    )
    assert b_got == [[]]
    assert reporter.progress() == [
        ("o1", "accepted"),
        ("o1", "completed"),
        ("o2", "accepted"),
        ("o2", "completed"),
    ]
    assert queue.stats["lost"] == 0 and queue.stats["leased"] == 2


def test_a_cancel_of_a_pin_or_demote_done_undoes_it(tmp_path: Path) -> None:
    """The LRU guard turned the instance's advice off: the service cancels the pins and demotes
    it carried out there."""
    rig = Rig(tmp_path, capacity_blocks=4)
    rig.source.add(order("fill", [1, 2, 3, 4]))
    rig.source.add(order("pin", [1], kind="pin", ttl_seconds=100.0), at=T0 + 1)
    rig.source.add(order("demote", [3], kind="demote"), at=T0 + 1)
    rig.run_until(T0 + 2)
    assert rig.buffer.hashes() == [3, 1, 2, 4] and rig.buffer.is_pinned(1, rig.clock.now)
    rig.source.add(Cancel(order_id="pin"), at=T0 + 3)
    rig.source.add(Cancel(order_id="demote"), at=T0 + 3)
    rig.run_until(T0 + 4)
    assert not rig.buffer.is_pinned(1, rig.clock.now)
    assert rig.buffer.hashes() == [1, 2, 3, 4]  # LRU order again
    assert rig.agent.stats.undone == 2 and rig.reporter.progress("pin") == [
        ("pin", "accepted"),
        ("pin", "completed"),
    ]
    rig.source.add(order("more", [5]), at=T0 + 5)
    rig.run_until(T0 + 6)
    assert rig.removed() == [1]  # no longer pinned: the oldest goes
