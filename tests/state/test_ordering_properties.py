"""Properties of event order (app/state/base.py), on every store found (test_store_contract.py's
BACKENDS): any arrival order and any batching of a stream give the same views, and applying it
again (a retry) changes nothing.

The streams keep to what the rules make order-free (docs/decisions.md, 1): at most
RECENT_REQUESTS requests per session, distinct timestamps among the events that write one
last-writer-wins register (a session's request events, an instance's status reports, an order's
reports of one status) and one block_tokens per location. Everything else ties freely on a small
grid of timestamps: stores, removals and clears of a block, a close and a request, a completed
and a failed report.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.state import StateStore, cursor_of
from app.state.rules import RECENT_REQUESTS
from kvprefetch_client.events import Event, event_adapter
from tests.state.test_store_contract import BACKENDS, backend_of

BPT = 327_680
BLOCK = 512
LOCATION_BLOCK_TOKENS = 16

SESSIONS = ["s0", "s1", "s:2"]
INSTANCES = ["gpu-0", "gpu-1"]
ORDERS = ["o0", "o1"]
# 5 and "5" are different blocks; a hash past 63 bits as vLLM may send one.
BLOCKS: list[Any] = [1, 2, 3, 5, "5", "ab", 2**64 - 1]
LOCATIONS: list[tuple[str, str | None]] = [
    ("hbm", "gpu-0"),
    ("hbm", "gpu-1"),
    ("host", "gpu-0"),
    ("pool", None),
]

# Quarter seconds, so several sessions share a whole second (the memory store's index), and two
# values not exact in binary. Residency stays within these seconds, inside any lateness horizon
# a store may forget a removal after; the other events also take a time needing all 17 digits.
KV_TS = st.sampled_from([i / 4 for i in range(49)] + [0.1, 0.30000000000000004])
TS = st.one_of(KV_TS, st.just(1_700_000_000.123456))


def _distinct_ts(n: int) -> st.SearchStrategy[list[float]]:
    return st.lists(TS, min_size=n, max_size=n, unique=True)


_BLOCK_LISTS = st.lists(st.sampled_from(BLOCKS), min_size=1, max_size=4)


@st.composite
def _session_events(draw: st.DrawFn, session_id: str) -> list[dict[str, Any]]:
    # Which events each request gets; a request may be routed twice (a re-route).
    kinds: list[tuple[str, str]] = []
    for r in range(draw(st.integers(0, RECENT_REQUESTS))):
        mine = draw(
            st.lists(
                st.sampled_from(["routed", "routed", "started", "finished"]), min_size=1, max_size=4
            )
        )
        kinds += [(f"r{r}", kind) for kind in mine]
    out = []
    for (request_id, kind), ts in zip(kinds, draw(_distinct_ts(len(kinds)))):
        e: dict[str, Any] = {
            "type": f"request_{kind}",
            "ts": ts,
            "session_id": session_id,
            "request_id": request_id,
            "instance_id": draw(st.sampled_from(INSTANCES)),
        }
        if kind == "routed":
            e["prompt_tokens"] = draw(st.integers(0, 5000))
        if kind == "finished":
            e["output_tokens"] = draw(st.integers(0, 500))
            e["context_tokens"] = draw(st.none() | st.integers(0, 6000))
        if kind != "started" and draw(st.booleans()):
            e["block_hashes"] = draw(st.lists(st.sampled_from(BLOCKS), max_size=5))
            e["block_tokens"] = draw(st.sampled_from([None, 16, 1024]))
        out.append(e)
    for ts in draw(st.lists(TS, max_size=2)):
        out.append({"type": "session_closed", "ts": ts, "session_id": session_id})
    # Signals tie freely (the whole signal orders them), and more than RECENT_SIGNALS come.
    for ts in draw(st.lists(TS, max_size=10)):
        e = {"type": "session_signal", "ts": ts, "session_id": session_id}
        e["kind"] = draw(st.sampled_from(["opened", "typing", "x.y"]))
        for name, values in (
            ("tool", ["bash", "Bash", "é"]),
            ("instance_id", INSTANCES),
            ("expected_in_seconds", [0.0, 2.5, 0.1]),
            ("expected_prompt_tokens", [0, 900]),
        ):
            if draw(st.booleans()):
                e[name] = draw(st.sampled_from(values))
        out.append(e)
    return out


@st.composite
def _residency_event(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["stored", "stored", "removed", "cleared", "vllm"]))
    ts = draw(KV_TS)
    if kind == "vllm":
        subs = draw(
            st.lists(
                st.one_of(
                    st.builds(
                        lambda b, m: {
                            "type": "BlockStored",
                            "block_hashes": b,
                            "medium": m,
                            "block_size": LOCATION_BLOCK_TOKENS,
                        },
                        _BLOCK_LISTS,
                        st.sampled_from([None, "GPU", "CPU"]),
                    ),
                    st.builds(
                        lambda b, m: {"type": "BlockRemoved", "block_hashes": b, "medium": m},
                        _BLOCK_LISTS,
                        st.sampled_from([None, "CPU"]),
                    ),
                    st.just({"type": "AllBlocksCleared"}),
                ),
                min_size=1,
                max_size=3,
            )
        )
        return {
            "type": "vllm_kv_events",
            "ts": ts,
            "instance_id": draw(st.sampled_from(INSTANCES)),
            "events": subs,
        }
    tier, instance_id = draw(st.sampled_from(LOCATIONS))
    e = {"type": f"kv_blocks_{kind}", "ts": ts, "tier": tier, "instance_id": instance_id}
    if kind != "cleared":
        e["block_hashes"] = draw(_BLOCK_LISTS)
    if kind == "stored":
        e["block_tokens"] = draw(st.sampled_from([None, LOCATION_BLOCK_TOKENS]))
    return e


@st.composite
def _status_events(draw: st.DrawFn, instance_id: str) -> list[dict[str, Any]]:
    out = []
    for ts in draw(st.integers(0, 2).flatmap(_distinct_ts)):
        total = draw(st.none() | st.integers(0, 2**40))
        out.append(
            {
                "type": "instance_status",
                "ts": ts,
                "instance_id": instance_id,
                "free_kv_bytes": draw(st.integers(0, total if total is not None else 2**40)),
                "total_kv_bytes": total,
                "queue_depth": draw(st.integers(0, 9)),
                "running_requests": draw(st.integers(0, 9)),
            }
        )
    return out


@st.composite
def _order_events(draw: st.DrawFn, order_id: str) -> list[dict[str, Any]]:
    out = []
    for status in ("accepted", "completed", "failed"):
        for ts in draw(st.integers(0, 2).flatmap(_distinct_ts)):
            e: dict[str, Any] = {
                "type": "order_progress",
                "ts": ts,
                "order_id": order_id,
                "status": status,
            }
            if status == "completed":
                e.update(bytes=draw(st.integers(0, 2**40)), seconds=draw(st.floats(0, 30)))
            if status == "failed":
                e["reason"] = draw(st.sampled_from(["link down", "no space"]))
            out.append(e)
    return out


@st.composite
def streams(draw: st.DrawFn) -> list[Event]:
    """A valid stream of distinct events, in no particular order."""
    raw: list[dict[str, Any]] = []
    for session_id in SESSIONS:
        raw += draw(_session_events(session_id))
    raw += draw(st.lists(_residency_event(), max_size=8))
    for instance_id in INSTANCES:
        raw += draw(_status_events(instance_id))
    for order_id in ORDERS:
        raw += draw(_order_events(order_id))
    ids = itertools.count()
    return [event_adapter.validate_python({**e, "event_id": f"e{next(ids)}"}) for e in raw]


@st.composite
def arrivals(draw: st.DrawFn, events: list[Event]) -> list[list[Event]]:
    """`events` as they might arrive: some sent twice (retries), in any order, in batches."""
    resent = draw(st.lists(st.sampled_from(events), max_size=5)) if events else []
    order = draw(st.permutations(events + resent))
    cuts = sorted(draw(st.sets(st.integers(1, max(len(order) - 1, 1)), max_size=4)))
    return [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(order)]) if order[a:b]]


def assert_same_views(got: StateStore, want: StateStore) -> None:
    seen, expected = views(got), views(want)
    for part in expected:
        assert seen[part] == expected[part], part


def views(store: StateStore) -> dict[str, Any]:
    """Everything a store shows."""
    pages, cursor = [], None
    while page := store.live_sessions(2, before=cursor):
        pages.append(page)
        cursor = cursor_of(page[-1])
    return {
        "sessions": {s: store.session(s) for s in [*SESSIONS, "never-seen"]},
        "live": store.live_sessions(len(SESSIONS) + 1),
        "live_pages": pages,
        "live_since": store.live_sessions(len(SESSIONS), active_since_ts=6.0),
        "instances": store.instances(),
        "locations": store.locations(),
        "holds": {
            (tier, i): store.holds(tier, i, BLOCKS)  # type: ignore[arg-type]
            for tier, i in LOCATIONS
        },
        "present": {
            (tier, i): store.present(tier, i, BLOCKS)  # type: ignore[arg-type]
            for tier, i in LOCATIONS
        },
        "orders": {o: store.order(o) for o in [*ORDERS, "never-seen"]},
        "stats": store.stats(),
    }


@dataclass(frozen=True)
class Backend:
    examples: int
    # An empty store, emptied and closed after use; each Redis one under a key prefix of its own.
    new_store: Callable[[], AbstractContextManager[StateStore]]

    def bounded(self) -> settings:
        # Reproducible in CI: the same examples every run, nothing carried over from a database.
        return settings(
            max_examples=self.examples,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        )


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    store_backend = backend_of(request)
    numbers = itertools.count()

    @contextmanager
    def new_store() -> Iterator[StateStore]:
        s = store_backend.build(
            request, name=str(next(numbers)), bytes_per_token=BPT, block_tokens=BLOCK
        )
        try:
            yield s
        finally:
            s.clear()
            s.close()

    return Backend(store_backend.examples, new_store)


def test_any_arrival_order_and_batching_gives_the_same_views(backend: Backend) -> None:
    @backend.bounded()
    @given(st.data())
    def check(data: st.DataObject) -> None:
        events = data.draw(streams(), label="events")
        batches = data.draw(arrivals(events), label="arrival")
        with backend.new_store() as in_order, backend.new_store() as arrived:
            assert in_order.apply(events) == [True] * len(events)
            for batch in batches:
                arrived.apply(batch)
            assert_same_views(arrived, in_order)

    check()


def test_applying_a_stream_again_changes_nothing(backend: Backend) -> None:
    @backend.bounded()
    @given(st.data())
    def check(data: st.DataObject) -> None:
        events = data.draw(streams(), label="events")
        with backend.new_store() as store:
            store.apply(events)
            before = views(store)
            for batch in data.draw(arrivals(events), label="retry"):
                assert store.apply(batch) == [False] * len(batch)
            assert views(store) == before

    check()
