"""The order vocabulary: prefetch, pin with TTL, demote; and its JSON form."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvprefetch_client.orders import Cancel, Order, from_json, order_id_for


def prefetch(**kw: object) -> Order:
    fields: dict[str, object] = dict(
        order_id="o1",
        kind="prefetch",
        instance_id="gpu-0",
        source_tier="pool",
        block_hashes=[1, 2],
        size_bytes=2048,
        created_ts=10.0,
        start_by_ts=11.0,
        needed_by_ts=12.0,
        priority=0.5,
        session_ids=["s1"],
    )
    fields.update(kw)
    return Order(**fields)  # type: ignore[arg-type]


def test_round_trip_through_json() -> None:
    order = prefetch()
    assert from_json(order.to_json()) == order
    cancel = Cancel(order_id="o1", reason="session closed")
    assert from_json(cancel.to_json()) == cancel


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"source_tier": None}, "a prefetch names its source_tier"),
        ({"kind": "pin", "ttl_seconds": None}, "a pin has a ttl_seconds"),
        (
            {"kind": "demote", "source_tier": None, "ttl_seconds": 5.0},
            "a demote has no ttl_seconds",
        ),
        ({"start_by_ts": 13.0}, "start_by_ts is after needed_by_ts"),
        ({"block_hashes": []}, "at least 1 item"),
        ({"size_bytes": -1}, "greater than or equal to 0"),
    ],
)
def test_orders_that_make_no_sense_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        prefetch(**fields)


def test_ids_are_deterministic_per_content_and_generation() -> None:
    a = order_id_for("prefetch", "gpu-0", "hbm", [1, 2, 3], 0)
    assert a == order_id_for("prefetch", "gpu-0", "hbm", [1, 2, 3], 0)
    assert a != order_id_for("prefetch", "gpu-0", "hbm", [1, 2, 3], 1)
    assert a != order_id_for("prefetch", "gpu-1", "hbm", [1, 2, 3], 0)
    assert a != order_id_for("prefetch", "gpu-0", "hbm", [12, 3], 0)
    assert a.startswith("prefetch-") and a.endswith("-0")
