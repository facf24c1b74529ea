"""InProcessSink: what the simulator reads back with drain()."""

from __future__ import annotations

from app.deliver import InProcessSink
from kvprefetch_client.orders import Cancel
from tests.deliver.conftest import order


class Ticks:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_drain_gives_orders_and_cancels_interleaved_as_they_came_then_empties() -> None:
    sink = InProcessSink()
    sink.submit_nowait([order("a"), order("b")])
    sink.cancel_nowait([Cancel(order_id="a")])
    sink.submit_nowait([order("c")])
    assert sink.pending == 4
    assert [(m.type, m.order_id) for m in sink.drain()] == [
        ("order", "a"),
        ("order", "b"),
        ("cancel", "a"),
        ("order", "c"),
    ]
    assert sink.drain() == [] and sink.pending == 0


def test_an_id_is_delivered_again_only_after_the_window() -> None:
    clock = Ticks()
    sink = InProcessSink(dedupe_seconds=60, clock=clock)
    assert sink.submit_nowait([order("a")]) == ["a"]
    clock.now = 59.0
    assert sink.submit_nowait([order("a")]) == []
    clock.now = 60.0
    assert sink.submit_nowait([order("a")]) == ["a"]
    assert [m.order_id for m in sink.drain()] == ["a", "a"]
