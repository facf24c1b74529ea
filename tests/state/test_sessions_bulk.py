"""`StateStore.sessions(ids)`: each id's `session()`, in order, in one read, on every store found
(tests/state/test_store_contract.py's BACKENDS)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from app.state.base import StateStore
from kvprefetch_client.events import Event, event_adapter
from tests.state.test_store_contract import BACKENDS, open_store


def ev(n: int, type_: str, ts: float, **fields: object) -> Event:
    return event_adapter.validate_python({"type": type_, "event_id": f"b{n}", "ts": ts, **fields})


def events() -> list[Event]:
    out = []
    for i in range(6):
        sid = f"s{i}"
        out.append(
            ev(
                10 * i,
                "request_routed",
                100.0 + i,
                session_id=sid,
                request_id=f"r{i}",
                instance_id="gpu-0",
                prompt_tokens=1000,
                block_hashes=[i, i + 1, 99],
            )
        )
        if i % 2:
            out.append(
                ev(
                    10 * i + 1,
                    "request_finished",
                    110.0 + i,
                    session_id=sid,
                    request_id=f"r{i}",
                    instance_id="gpu-0",
                    output_tokens=20,
                )
            )
    out.append(ev(900, "session_closed", 120.0, session_id="s3"))
    out.append(ev(901, "session_signal", 121.0, session_id="s5", kind="typing"))
    out.append(
        ev(902, "kv_blocks_stored", 122.0, tier="hbm", instance_id="gpu-0", block_hashes=[99, 1])
    )
    return out


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest) -> Iterator[StateStore]:
    yield from open_store(request, bytes_per_token=2, block_tokens=16)


def test_sessions_reads_each_session_as_session_does(store: StateStore) -> None:
    store.apply(events())
    ids = ["s5", "nobody", "s0", "s3", "s1", "s5"]
    views = store.sessions(ids)
    assert views == [store.session(s) for s in ids]
    assert views[1] is None and views[3] is not None and views[3].state == "closed"
    assert views[0] is not None and views[0].signals and views[0].resident_blocks
    assert store.sessions([]) == []


def test_sessions_without_residency_is_the_same_view_less_resident_blocks(
    store: StateStore,
) -> None:
    store.apply(events())
    ids = ["s5", "nobody", "s0", "s3"]
    full = store.sessions(ids)
    bare = store.sessions(ids, resident=False)
    assert [v is None for v in bare] == [v is None for v in full]
    assert any(v is not None and v.resident_blocks for v in full)
    for f, b in zip(full, bare):
        if f is not None:
            assert b is not None and b.resident_blocks == {}
            assert b == f.model_copy(update={"resident_blocks": {}})
