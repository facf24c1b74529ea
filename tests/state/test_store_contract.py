"""One contract suite, run against every store backend found (tests/implementations.py: every
class under app/ or client/ that declares `StateStore`): memory, and Redis on the real server.

The session rules live in app/state/rules.py, which MemoryStore applies; RedisStore applies them
through its Lua copy (app/state/redis_apply.lua): every case here runs on both, so a rule that
differs between the two fails one of them. A new backend needs a factory in FACTORIES below
(test_every_state_store_has_a_factory says so).
"""

from __future__ import annotations

import importlib
import itertools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import app.state.memory
from app.state import LogPosition, MemoryStore, StateStore, cursor_of
from app.state.base import SignalView
from app.state.redis import RedisStore
from app.state.rules import RECENT_REQUESTS, RECENT_SIGNALS
from kvprefetch_client.events import Event, event_adapter
from tests.implementations import factory_of, here, missing_factories, params

BPT = 327_680
BLOCK = 512


@dataclass(frozen=True)
class Backend:
    """How the state suites build a backend and look inside it.

    `build(request, name="", **keywords)`: a new empty store, its constructor's keywords given
    (bytes_per_token, block_tokens, the bounds); `name` sets a second store in the same test
    apart from the first. `signals_held`: how many signal entries it holds for a session (its
    own count, not the view's). `examples`: how many examples its speed affords each property of
    tests/state/test_ordering_properties.py; `marks`: its tests' marks."""

    build: Callable[..., StateStore]
    signals_held: Callable[[Any, str], int]
    examples: int
    marks: tuple[pytest.MarkDecorator, ...] = ()


def _memory_store(request: pytest.FixtureRequest, name: str = "", **keywords: Any) -> StateStore:
    return MemoryStore(**keywords)


def _redis_store(request: pytest.FixtureRequest, name: str = "", **keywords: Any) -> StateStore:
    url = request.getfixturevalue("redis_url")
    prefix = request.getfixturevalue("clean_redis")  # deletes every key under it afterwards
    return RedisStore.from_url(url, prefix=f"{prefix}:{name}" if name else prefix, **keywords)


def _redis_signals_held(store: RedisStore, session_id: str) -> int:
    raw = store._r.hget(f"{store.prefix}:s:{session_id}", "g")
    return len(json.loads(raw)) if raw else 0


# One per implementation found (test_every_state_store_has_a_factory checks); the other state
# suites (test_ordering_properties.py, test_sessions_bulk.py) build theirs from these too.
FACTORIES: dict[type, Backend] = {
    MemoryStore: Backend(
        _memory_store,
        lambda store, session_id: len(store._sessions[session_id].signals),
        examples=300,
    ),
    RedisStore: Backend(_redis_store, _redis_signals_held, examples=40, marks=(pytest.mark.redis,)),
}
BACKENDS = params(StateStore, {cls: b.marks for cls, b in FACTORIES.items()})


def test_every_state_store_has_a_factory() -> None:
    missing = missing_factories(StateStore, FACTORIES, here(__file__))
    assert not missing, "\n".join(missing)


def backend_of(request: pytest.FixtureRequest) -> Backend:
    """The Backend of the implementation a fixture parametrized by BACKENDS is at."""
    return factory_of(StateStore, FACTORIES, request.param, request)


def open_store(request: pytest.FixtureRequest, **keywords: Any) -> Iterator[StateStore]:
    """A fixture's body: a new store of the implementation the fixture is at, closed after."""
    s = backend_of(request).build(request, **keywords)
    yield s
    s.close()


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest) -> Iterator[StateStore]:
    yield from open_store(request, bytes_per_token=BPT, block_tokens=BLOCK)


_ids = itertools.count()


def ev(type_: str, ts: float, **fields: Any) -> Event:
    fields.setdefault("event_id", f"e{next(_ids)}")
    return event_adapter.validate_python({"type": type_, "ts": ts, **fields})


def routed(
    session: str, request: str, ts: float, instance: str = "gpu-0", prompt: int = 1000, **kw: Any
) -> Event:
    return ev(
        "request_routed",
        ts,
        session_id=session,
        request_id=request,
        instance_id=instance,
        prompt_tokens=prompt,
        **kw,
    )


def started(session: str, request: str, ts: float, instance: str = "gpu-0") -> Event:
    return ev("request_started", ts, session_id=session, request_id=request, instance_id=instance)


def finished(
    session: str, request: str, ts: float, instance: str = "gpu-0", output: int = 100, **kw: Any
) -> Event:
    return ev(
        "request_finished",
        ts,
        session_id=session,
        request_id=request,
        instance_id=instance,
        output_tokens=output,
        **kw,
    )


def stored(
    blocks: list[Any], ts: float, instance: str | None = "gpu-0", tier: str = "hbm", **kw: Any
) -> Event:
    return ev("kv_blocks_stored", ts, instance_id=instance, tier=tier, block_hashes=blocks, **kw)


def removed(
    blocks: list[Any], ts: float, instance: str | None = "gpu-0", tier: str = "hbm"
) -> Event:
    return ev("kv_blocks_removed", ts, instance_id=instance, tier=tier, block_hashes=blocks)


def cleared(ts: float, instance: str | None = "gpu-0", tier: str = "hbm") -> Event:
    return ev("kv_blocks_cleared", ts, instance_id=instance, tier=tier)


# -- idempotency ----------------------------------------------------------------------------


def test_apply_reports_duplicates_and_seen(store: StateStore) -> None:
    a = routed("s", "r1", 1.0)
    assert store.seen([a.event_id, "never"]) == [False, False]
    assert store.apply([a]) == [True]
    assert store.seen([a.event_id, "never"]) == [True, False]
    assert store.apply([a]) == [False]
    assert store.session("s").turns == 1


def test_a_repeat_inside_one_apply_counts_once(store: StateStore) -> None:
    a = routed("s", "r1", 1.0)
    assert store.apply([a, a]) == [True, False]
    assert store.session("s").turns == 1


# -- sessions -------------------------------------------------------------------------------


def test_unknown_session_is_none(store: StateStore) -> None:
    assert store.session("nobody") is None


def test_session_lifecycle(store: StateStore) -> None:
    store.apply([routed("s", "r1", 10.0, prompt=7000, block_hashes=[1, 2, 3])])
    v = store.session("s")
    assert (v.state, v.turns, v.instance_id, v.context_tokens) == ("queued", 1, "gpu-0", 7000)
    assert v.context_bytes == 7000 * BPT
    assert v.block_hashes == [1, 2, 3] and v.block_tokens == BLOCK
    store.apply([started("s", "r1", 11.0)])
    assert store.session("s").state == "running"
    store.apply([finished("s", "r1", 15.0, output=500, context_tokens=7500)])
    v = store.session("s")
    assert (v.state, v.context_tokens, v.last_activity_ts, v.first_seen_ts) == (
        "idle",
        7500,
        15.0,
        10.0,
    )
    assert v.last_request.request_id == "r1"
    assert (v.last_request.routed_ts, v.last_request.started_ts, v.last_request.finished_ts) == (
        10.0,
        11.0,
        15.0,
    )


def test_context_without_reported_context_is_prompt_plus_output(store: StateStore) -> None:
    store.apply([routed("s", "r1", 1.0, prompt=1000), finished("s", "r1", 2.0, output=24)])
    assert store.session("s").context_tokens == 1024


def test_gaps_come_from_routed_times(store: StateStore) -> None:
    store.apply([routed("s", f"r{i}", t) for i, t in enumerate([100.0, 160.0, 400.0])])
    v = store.session("s")
    assert v.turns == 3
    assert v.recent_arrivals_ts == [100.0, 160.0, 400.0]
    assert v.inter_turn_gaps_seconds == [60.0, 240.0]


def test_arrivals_keep_the_latest_sixteen(store: StateStore) -> None:
    store.apply([routed("s", f"r{i}", float(i)) for i in range(20)])
    v = store.session("s")
    assert v.turns == 20
    assert v.recent_arrivals_ts == [float(i) for i in range(4, 20)]


def test_late_finish_of_an_older_turn_does_not_change_the_current_one(store: StateStore) -> None:
    store.apply([routed("s", "r1", 10.0, prompt=100), routed("s", "r2", 20.0, prompt=300)])
    store.apply([finished("s", "r1", 12.0, output=50)])
    v = store.session("s")
    assert v.last_request.request_id == "r2"
    assert (v.state, v.context_tokens) == ("queued", 300)


def test_finished_before_routed_ends_in_the_same_state(store: StateStore) -> None:
    store.apply(
        [finished("s", "r1", 15.0, output=10, context_tokens=1010), started("s", "r1", 11.0)]
    )
    store.apply([routed("s", "r1", 10.0, prompt=1000)])
    v = store.session("s")
    assert (v.state, v.context_tokens, v.turns) == ("idle", 1010, 1)


def test_instance_follows_the_newest_event(store: StateStore) -> None:
    store.apply(
        [routed("s", "r2", 20.0, instance="gpu-1"), routed("s", "r1", 10.0, instance="gpu-0")]
    )
    assert store.session("s").instance_id == "gpu-1"


def test_blocks_follow_the_newest_event_that_carries_them(store: StateStore) -> None:
    store.apply(
        [
            finished("s", "r1", 30.0, block_hashes=[1, 2, 3, 4]),
            routed("s", "r1", 10.0, block_hashes=[1, 2]),
            routed("s", "r2", 40.0),  # carries no blocks: keeps the last known ones
        ]
    )
    assert store.session("s").block_hashes == [1, 2, 3, 4]


def test_close_and_reopen(store: StateStore) -> None:
    store.apply([routed("s", "r1", 1.0), finished("s", "r1", 2.0)])
    store.apply([ev("session_closed", 3.0, session_id="s")])
    v = store.session("s")
    assert (v.state, v.closed_ts) == ("closed", 3.0)
    store.apply([routed("s", "r2", 4.0)])
    assert store.session("s").state == "queued"
    # A close that happened before the last turn does not close it.
    store.apply([ev("session_closed", 3.5, session_id="s")])
    assert store.session("s").state == "queued"


# -- the corners of the session rules (app/state/rules.py) ----------------------------------------


def test_a_close_at_the_time_of_the_latest_routing_closes(store: StateStore) -> None:
    store.apply([routed("s", "r1", 5.0), ev("session_closed", 5.0, session_id="s")])
    assert store.session("s").state == "closed"


def test_a_request_seen_without_its_routing_ranks_by_its_earliest_event(store: StateStore) -> None:
    # r2's routing never came: its rank is min(started, finished) = 18, after r1's routing at 10.
    store.apply(
        [
            routed("s", "r1", 10.0, prompt=700),
            finished("s", "r2", 22.0, output=5),
            started("s", "r2", 18.0),
        ]
    )
    v = store.session("s")
    assert v.last_request.request_id == "r2"
    assert (v.state, v.context_tokens, v.turns) == ("idle", 0, 1)  # no prompt known: no context
    # A routing of r2 older than r1's makes r1 the latest again.
    store.apply([routed("s", "r2", 9.0, prompt=300)])
    v = store.session("s")
    assert (v.last_request.request_id, v.state) == ("r1", "queued")


def test_a_session_keeps_its_latest_requests_whatever_the_order(store: StateStore) -> None:
    # One more request than kept, the oldest arriving last: it is the one dropped, and an event
    # for it afterwards does not displace a newer one.
    n = RECENT_REQUESTS + 1
    store.apply([routed("s", f"r{i}", 10.0 * i, prompt=100 * i) for i in range(2, n + 1)])
    store.apply([routed("s", "r1", 10.0, prompt=100)])
    store.apply([finished("s", "r1", 11.0, output=1)])
    v = store.session("s")
    assert (v.turns, v.last_request.request_id, v.context_tokens) == (n, f"r{n}", 100 * n)
    assert v.recent_arrivals_ts == [10.0 * i for i in range(1, n + 1)]


def test_a_tie_between_request_events_goes_to_the_later_applied(store: StateStore) -> None:
    store.apply([routed("s", "r1", 10.0, instance="gpu-0")])
    store.apply([started("s", "r1", 10.0, instance="gpu-1")])
    v = store.session("s")
    assert (v.instance_id, v.last_request.instance_id, v.state) == ("gpu-1", "gpu-1", "running")


def test_the_lua_names_real_functions() -> None:
    # Each part of the apply script names what it mirrors in Python: those names must exist.
    lua = (Path(app.state.memory.__file__).parent / "redis_apply.lua").read_text()
    cited = set(
        re.findall(
            r"\b(rules|memory|MemoryStore)\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)",
            "\n".join(line for line in lua.splitlines() if "--" in line),
        )
    )
    assert len(cited) > 15
    owners = {
        "rules": importlib.import_module("app.state.rules"),
        "memory": app.state.memory,
        "MemoryStore": MemoryStore(bytes_per_token=BPT, block_tokens=BLOCK),
    }
    missing = []
    for owner, path in sorted(cited - {("rules", "py"), ("memory", "py")}):  # the files' names
        target: Any = owners[owner]
        for part in path.split("."):
            target = getattr(target, part, None)
        if target is None:
            missing.append(f"{owner}.{path}")
    assert not missing, missing


def test_block_hash_types_are_kept(store: StateStore) -> None:
    store.apply([routed("s", "r1", 1.0, block_hashes=[5, "5", "ab12", 2**63 + 7])])
    assert store.session("s").block_hashes == [5, "5", "ab12", 2**63 + 7]


# -- listing live sessions ------------------------------------------------------------------


def _closed(session: str, ts: float) -> Event:
    return ev("session_closed", ts, session_id=session)


def test_live_sessions_are_the_open_ones_newest_first(store: StateStore) -> None:
    store.apply(
        [
            routed("a", "r1", 1.0),
            finished("a", "r1", 2.0),
            routed("b", "r1", 5.0),
            started("b", "r1", 5.5),
            routed("c", "r1", 3.0),
            _closed("c", 4.0),  # closed
            _closed("d", 2.0),
            routed("d", "r1", 6.0, block_hashes=[1]),  # closed, then reopened
        ]
    )
    live = store.live_sessions(10)
    assert [(v.session_id, v.state, v.last_activity_ts) for v in live] == [
        ("d", "queued", 6.0),
        ("b", "running", 5.5),
        ("a", "idle", 2.0),
    ]
    assert live == [store.session(v.session_id) for v in live]
    assert [v.session_id for v in store.live_sessions(2)] == ["d", "b"]
    assert store.live_sessions(0) == []


def test_live_sessions_carry_the_same_residency_as_session(store: StateStore) -> None:
    store.apply(
        [
            routed("a", "r", 1.0, block_hashes=[1, 2, 3]),
            routed("b", "r", 2.0, block_hashes=[3, 4]),
            routed("c", "r", 3.0),
            stored([1, 2, 3], 1.5),
            stored([4], 2.5, instance=None, tier="pool"),
        ]
    )
    live = store.live_sessions(10)
    assert {v.session_id: v.resident_blocks for v in live} == {
        "a": {"hbm@gpu-0": 3},
        "b": {"hbm@gpu-0": 1, "pool": 1},
        "c": {},
    }
    assert live == [store.session(v.session_id) for v in live]


def test_live_sessions_page_by_cursor_and_ties_go_by_id(store: StateStore) -> None:
    # Ten sessions on four timestamps, two of them closed: pages of three walk every open one once.
    times = [4.0, 2.0, 4.0, 1.0, 2.0, 4.0, 3.0, 2.0, 4.0, 1.0]
    store.apply([routed(f"s{i}", "r", t) for i, t in enumerate(times)])
    store.apply([_closed("s2", 4.0), _closed("s7", 2.0)])
    want = [
        ("s8", 4.0),
        ("s5", 4.0),
        ("s0", 4.0),
        ("s6", 3.0),
        ("s4", 2.0),
        ("s1", 2.0),
        ("s9", 1.0),
        ("s3", 1.0),
    ]
    assert [(v.session_id, v.last_activity_ts) for v in store.live_sessions(100)] == want
    pages, cursor = [], None
    while True:
        page = store.live_sessions(3, before=cursor)
        if not page:
            break
        pages.append([v.session_id for v in page])
        cursor = cursor_of(page[-1])
    assert pages == [["s8", "s5", "s0"], ["s6", "s4", "s1"], ["s9", "s3"]]
    # A cursor in the middle of a tie, and one that names no session.
    assert [v.session_id for v in store.live_sessions(2, before=(4.0, "s5"))] == ["s0", "s6"]
    assert [v.session_id for v in store.live_sessions(2, before=(2.0, "s3"))] == ["s1", "s9"]


def test_live_sessions_active_since(store: StateStore) -> None:
    store.apply([routed(f"s{i}", "r", float(i)) for i in range(6)])
    assert [v.session_id for v in store.live_sessions(10, active_since_ts=3.0)] == [
        "s5",
        "s4",
        "s3",
    ]
    assert [
        v.session_id for v in store.live_sessions(10, before=(4.0, "s4"), active_since_ts=3.0)
    ] == ["s3"]
    assert store.live_sessions(10, active_since_ts=9.0) == []


def test_live_sessions_do_not_depend_on_arrival_order(store: StateStore) -> None:
    events = [
        routed("a", "r1", 10.0),
        finished("a", "r1", 12.0),
        routed("b", "r1", 12.0),
        _closed("b", 13.0),
        routed("c", "r1", 8.0),
        routed("c", "r2", 12.0),
        _closed("d", 1.0),
        routed("d", "r1", 2.0),
        routed("e", "r1", 12.0),
    ]
    store.apply(events)
    expected = store.live_sessions(10)
    assert [v.session_id for v in expected] == ["e", "c", "a", "d"]
    store.clear()
    store.apply(list(reversed(events)))
    assert store.live_sessions(10) == expected


# -- residency ------------------------------------------------------------------------------


def test_residency_is_deduplicated_per_location(store: StateStore) -> None:
    shared = [10, 11, 12]
    store.apply(
        [
            routed("a", "ra", 1.0, block_hashes=shared + [20]),
            routed("b", "rb", 1.0, block_hashes=shared + [30]),
            stored(shared + [20], 2.0),
            stored(shared + [30], 2.1),
            stored(shared, 2.2, instance=None, tier="pool"),
        ]
    )
    locs = {loc.location: loc for loc in store.locations()}
    assert locs["hbm@gpu-0"].blocks == 5
    assert locs["hbm@gpu-0"].bytes == 5 * BLOCK * BPT
    assert locs["pool"].blocks == 3 and locs["pool"].instance_id is None
    assert store.session("a").resident_blocks == {"hbm@gpu-0": 4, "pool": 3}
    assert store.holds("hbm", "gpu-0", [10, 20, 99]) == [True, True, False]
    assert store.holds("host", "gpu-0", [10]) == [False]
    assert store.present("hbm", "gpu-0", [10, 20, 99, 10]) == {10, 20}
    assert store.present("hbm", "gpu-0", iter({30, 99})) == {30}
    assert (
        store.present("host", "gpu-0", [10]) == set() and store.present("pool", None, []) == set()
    )
    # All of it in one read, in the order asked, each answer `present`'s.
    asked: list[tuple[Any, str | None, list[int]]] = [
        ("hbm", "gpu-0", [10, 20, 99]),
        ("host", "gpu-0", [10]),
        ("pool", None, []),
        ("pool", None, [10, 20, 30, 20]),
        ("hbm", "gpu-9", [10]),
    ]
    assert store.present_many(asked) == [store.present(*q) for q in asked]
    assert store.present_many([asked[0], ("pool", None, iter([30, 10]))]) == [{10, 20}, {10}]
    assert store.present_many([]) == []


def test_stored_after_removed_in_event_time_wins_and_vice_versa(store: StateStore) -> None:
    store.apply([removed([1], 5.0), stored([1], 4.0)])  # remove is newer: absent
    store.apply([stored([2], 6.0), removed([2], 3.0)])  # store is newer: present
    assert store.holds("hbm", "gpu-0", [1, 2]) == [False, True]


def test_removal_wins_a_tie(store: StateStore) -> None:
    store.apply([stored([1], 5.0), removed([1], 5.0)])
    assert store.holds("hbm", "gpu-0", [1]) == [False]
    store.apply([removed([2], 5.0), stored([2], 5.0)])
    assert store.holds("hbm", "gpu-0", [2]) == [False]


def test_clear_removes_older_blocks_and_ignores_older_stores(store: StateStore) -> None:
    store.apply(
        [stored([1, 2], 1.0), stored([3], 9.0), cleared(5.0), stored([4], 4.0), stored([5], 6.0)]
    )
    assert store.holds("hbm", "gpu-0", [1, 2, 3, 4, 5]) == [False, False, True, False, True]
    assert [loc.cleared_ts for loc in store.locations()] == [5.0]


def test_vllm_batch_adapter(store: StateStore) -> None:
    batch = ev(
        "vllm_kv_events",
        7.0,
        instance_id="gpu-3",
        events=[
            {
                "type": "BlockStored",
                "block_hashes": [1, 2, 3],
                "parent_block_hash": None,
                "token_ids": [],
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
            },
            ["BlockStored", [9], 3, [], 16, None, "CPU"],
            {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"},
        ],
    )
    assert store.apply([batch]) == [True]
    assert store.holds("hbm", "gpu-3", [1, 2, 3]) == [True, False, True]
    assert store.holds("host", "gpu-3", [9]) == [True]
    hbm = {loc.location: loc for loc in store.locations()}["hbm@gpu-3"]
    assert hbm.block_tokens == 16
    store.apply(
        [ev("vllm_kv_events", 8.0, instance_id="gpu-3", events=[{"type": "AllBlocksCleared"}])]
    )
    assert store.holds("hbm", "gpu-3", [1, 3]) == [False, False]
    assert store.holds("host", "gpu-3", [9]) == [True]
    assert store.apply([batch]) == [False]


# -- instances and orders -------------------------------------------------------------------


def test_instances_merge_status_routing_and_residency(store: StateStore) -> None:
    store.apply(
        [
            ev(
                "instance_status",
                5.0,
                instance_id="gpu-1",
                free_kv_bytes=100,
                total_kv_bytes=400,
                queue_depth=3,
                running_requests=8,
            ),
            ev("instance_status", 4.0, instance_id="gpu-1", free_kv_bytes=999, queue_depth=0),
            routed("s", "r", 6.0, instance="gpu-2"),
            stored([1, 2], 7.0, instance="gpu-1"),
            stored([3], 7.0, instance="gpu-1", tier="host"),
        ]
    )
    by_id = {i.instance_id: i for i in store.instances()}
    assert list(by_id) == ["gpu-1", "gpu-2"]
    g1 = by_id["gpu-1"]
    assert (g1.free_kv_bytes, g1.total_kv_bytes, g1.queue_depth, g1.running_requests) == (
        100,
        400,
        3,
        8,
    )
    assert (g1.status_ts, g1.last_seen_ts) == (5.0, 7.0)
    assert g1.resident_blocks == {"hbm": 2, "host": 1}
    assert g1.resident_bytes == {"hbm": 2 * BLOCK * BPT, "host": BLOCK * BPT}
    g2 = by_id["gpu-2"]
    assert (g2.status_ts, g2.free_kv_bytes, g2.resident_blocks) == (None, None, {})


def test_order_terminal_status_wins(store: StateStore) -> None:
    store.apply(
        [
            ev("order_progress", 9.0, order_id="o1", status="completed", bytes=1024, seconds=0.5),
            ev("order_progress", 10.0, order_id="o1", status="accepted"),
        ]
    )
    o = store.order("o1")
    assert (o.status, o.bytes, o.seconds, o.status_ts) == ("completed", 1024, 0.5, 9.0)
    store.apply([ev("order_progress", 11.0, order_id="o1", status="failed", reason="link down")])
    assert store.order("o1").status == "failed"
    assert store.order("o1").reason == "link down"
    assert store.order("nope") is None


# -- bookkeeping ----------------------------------------------------------------------------


def test_stats_count_what_is_held(store: StateStore) -> None:
    store.apply(
        [
            routed("a", "r", 1.0),
            routed("b", "r", 1.0, instance="gpu-1"),
            stored([1, 2], 1.0),
            ev("order_progress", 1.0, order_id="o", status="accepted"),
        ]
    )
    s = store.stats()
    assert (s["sessions"], s["instances"], s["locations"], s["resident_blocks"], s["orders"]) == (
        2,
        2,
        1,
        2,
        1,
    )
    assert s["remembered_event_ids"] == 4


def test_checkpoint_round_trip(store: StateStore) -> None:
    assert store.checkpoint("replica-a") is None
    store.set_checkpoint("replica-a", LogPosition(3, 4096))
    assert store.checkpoint("replica-a") == LogPosition(3, 4096)
    assert store.checkpoint("replica-b") is None


def test_clear_forgets_everything(store: StateStore) -> None:
    a = routed("s", "r", 1.0)
    store.apply([a, stored([1], 1.0)])
    store.clear()
    assert store.session("s") is None and store.locations() == [] and store.instances() == []
    assert store.seen([a.event_id]) == [False]


def test_ping(store: StateStore) -> None:
    store.ping()


def test_any_order_gives_the_same_views(store: StateStore) -> None:
    events = [
        routed("s", "r1", 10.0, prompt=100, block_hashes=[1, 2]),
        started("s", "r1", 11.0),
        finished("s", "r1", 12.0, output=5, block_hashes=[1, 2, 3]),
        routed("s", "r2", 50.0, prompt=300, instance="gpu-1"),
        stored([1, 2, 3], 12.5),
        removed([2], 30.0),
        stored([2], 20.0),
        ev("instance_status", 3.0, instance_id="gpu-1", free_kv_bytes=5),
    ]
    store.apply(events)
    expected = (store.session("s"), store.instances(), store.locations())
    store.clear()
    store.apply(list(reversed(events)))
    assert (store.session("s"), store.instances(), store.locations()) == expected


# -- bounded state: expiry by event time ----------------------------------------------------

WINDOW = 10.0
RETENTION = 100.0


@pytest.fixture(params=BACKENDS)
def bounded(request: pytest.FixtureRequest) -> Iterator[StateStore]:
    """A store with a reorder window of 10 s and a session retention of 100 s."""
    yield from open_store(
        request,
        bytes_per_token=BPT,
        block_tokens=BLOCK,
        reorder_window_seconds=WINDOW,
        session_retention_seconds=RETENTION,
    )


def test_a_late_store_inside_the_window_still_loses_to_the_removal(bounded: StateStore) -> None:
    bounded.apply([stored([1, 2], 90.0), removed([1, 2], 100.0), stored([9], 109.5)])
    # The location's newest event is 109.5: stores from 99.5 on are in the window.
    bounded.apply([stored([1], 99.6), stored([2], 100.0)])  # older, and a tie: the removal wins
    assert bounded.holds("hbm", "gpu-0", [1, 2, 9]) == [False, False, True]
    # Another location's events do not move this one's window.
    bounded.apply([stored([7], 500.0, instance="gpu-1"), stored([1], 99.7)])
    assert bounded.holds("hbm", "gpu-0", [1]) == [False]


def test_tombstones_older_than_the_window_are_dropped(bounded: StateStore) -> None:
    bounded.apply([removed([1], 100.0), stored([9], 110.5)])  # 100 < 110.5 - 10: dropped
    bounded.apply([stored([1], 99.0)])  # arrives too late: nothing remembers the removal
    assert bounded.holds("hbm", "gpu-0", [1]) == [True]
    # A removal already older than the window removes what it finds but leaves no tombstone.
    bounded.apply([removed([1, 2], 100.1), stored([2], 100.0)])
    assert bounded.holds("hbm", "gpu-0", [1, 2]) == [False, True]
    # A store newer than a tombstone still in force replaces it, as before.
    bounded.apply([removed([3], 110.0), stored([3], 110.2)])
    assert bounded.holds("hbm", "gpu-0", [3]) == [True]


def test_sessions_idle_past_the_retention_are_forgotten(bounded: StateStore) -> None:
    bounded.apply(
        [
            routed("a", "r1", 10.0, block_hashes=[1]),
            finished("a", "r1", 12.0),
            routed("b", "r1", 50.0),
            _closed("b", 55.0),
            stored([1], 12.0),
        ]
    )
    bounded.apply([routed("c", "r1", 111.5)])  # cutoff 11.5: "a" (last active at 12) stays
    assert bounded.session("a") is not None and bounded.stats()["sessions"] == 3
    bounded.apply(
        [ev("instance_status", 112.5, instance_id="gpu-1", free_kv_bytes=1)]
    )  # any event counts
    assert bounded.session("a") is None
    assert [v.session_id for v in bounded.live_sessions(10)] == ["c"]
    assert [v.session_id for v in bounded.live_sessions(10, active_since_ts=0.0)] == ["c"]
    assert bounded.stats()["sessions"] == 2  # b (closed) and c
    assert bounded.holds("hbm", "gpu-0", [1]) == [True]  # residency is not the session's
    # An event older than the cutoff is about a forgotten past: ignored.
    bounded.apply([finished("a", "r1", 12.4), routed("z", "r1", 5.0), started("c", "r1", 12.0)])
    assert bounded.session("a") is None and bounded.session("z") is None
    assert bounded.session("c").state == "queued"
    # A new event starts a forgotten session afresh.
    bounded.apply([routed("a", "r2", 150.0, prompt=42)])
    v = bounded.session("a")
    assert (v.turns, v.first_seen_ts, v.last_activity_ts, v.state, v.closed_ts) == (
        1,
        150.0,
        150.0,
        "queued",
        None,
    )
    assert (v.recent_arrivals_ts, v.block_hashes, v.context_tokens) == ([150.0], [], 42)
    assert v.last_request.request_id == "r2"
    bounded.apply([routed("c", "r2", 155.5)])  # cutoff 55.5: b goes, closed or not
    assert bounded.session("b") is None
    assert [v.session_id for v in bounded.live_sessions(10)] == ["c", "a"]
    assert bounded.stats()["sessions"] == 2


def test_a_session_touched_after_its_retention_starts_afresh_in_the_same_batch(
    bounded: StateStore,
) -> None:
    bounded.apply(
        [
            routed("a", "r1", 10.0),
            _closed("a", 11.0),
            routed("b", "r1", 111.5),
            routed("a", "r2", 112.0),
        ]
    )
    v = bounded.session("a")
    assert (v.turns, v.first_seen_ts, v.state, v.closed_ts) == (1, 112.0, "queued", None)
    assert bounded.stats()["sessions"] == 2


def test_counts_after_expiry_agree_with_the_views(bounded: StateStore) -> None:
    # Sessions on many seconds, some sharing one: only those idle for more than 100 s are gone.
    bounded.apply([routed(f"s{i}", "r", 1.0 + i * 0.5) for i in range(40)])
    bounded.apply([ev("instance_status", 110.25, instance_id="gpu-1", free_kv_bytes=1)])
    live = bounded.live_sessions(100)
    kept = [f"s{i}" for i in range(40) if 1.0 + i * 0.5 >= 10.25]
    assert sorted(v.session_id for v in live) == sorted(kept)
    assert bounded.stats()["sessions"] == len(kept)
    assert [bounded.session(f"s{i}") is not None for i in range(40)] == [
        f"s{i}" in kept for i in range(40)
    ]


def _order(order_id: str, ts: float, status: str = "accepted", **kw: Any) -> Event:
    if status == "completed":
        kw = {"bytes": 1, "seconds": 0.1, **kw}
    return ev("order_progress", ts, order_id=order_id, status=status, **kw)


def test_orders_idle_past_the_retention_are_forgotten(bounded: StateStore) -> None:
    bounded.apply(
        [
            _order("a", 10.0, "completed", bytes=1, seconds=0.1),
            _order("a", 12.0),
            _order("b", 50.0),
            _order("old", 1.0),
        ]
    )
    bounded.apply([_order("c", 111.5)])  # cutoff 11.5: "a" (last active at 12) stays
    assert bounded.order("a").status == "completed" and bounded.stats()["orders"] == 3
    bounded.apply(
        [ev("instance_status", 112.5, instance_id="gpu-1", free_kv_bytes=1)]
    )  # any event counts
    assert bounded.order("a") is None and bounded.stats()["orders"] == 2
    # An event older than the cutoff is about a forgotten past: ignored.
    bounded.apply([_order("a", 12.4, "failed", reason="late"), _order("z", 5.0)])
    assert bounded.order("a") is None and bounded.order("z") is None
    # A new event starts a forgotten order afresh: its old terminal status is gone with it.
    bounded.apply([_order("a", 150.0)])
    o = bounded.order("a")
    assert (o.status, o.status_ts, o.bytes) == ("accepted", 150.0, None)
    bounded.apply([_order("c", 150.5, "completed")])  # cutoff 50.5: b goes
    assert bounded.order("b") is None and bounded.order("c").status == "completed"
    assert bounded.stats()["orders"] == 2


def test_an_order_stays_while_any_of_its_events_is_recent(bounded: StateStore) -> None:
    # A completion stamped before the accepted it beats still keeps the order alive by the later
    # one.
    bounded.apply([_order("o", 20.0), _order("o", 10.0, "completed"), _order("x", 115.0)])
    assert bounded.order("o").status == "completed"  # last activity 20 >= cutoff 15
    bounded.apply([_order("x", 121.0)])
    assert bounded.order("o") is None


def test_order_records_stay_bounded_under_distinct_ids(bounded: StateStore) -> None:
    # 2,000 distinct orders over 1,000 s of event time: about the last retention's worth stay.
    for start in range(0, 2000, 500):
        bounded.apply([_order(f"o{i}", i * 0.5) for i in range(start, start + 500)])
    held = bounded.stats()["orders"]
    assert held == sum(1 for i in range(2000) if i * 0.5 >= 999.5 - RETENTION)
    assert bounded.order("o0") is None and bounded.order("o1999") is not None


def test_instances_page_by_id_and_read_by_ids(store: StateStore) -> None:
    store.apply(
        [
            ev("instance_status", 1.0, instance_id=f"gpu-{i:02d}", free_kv_bytes=i)
            for i in (3, 1, 4, 0, 2)
        ]
        + [stored([1, 2], 2.0, instance="gpu-02")]
    )
    everything = store.instances()
    assert [i.instance_id for i in everything] == [f"gpu-{i:02d}" for i in range(5)]
    first = store.instances(limit=2)
    rest = store.instances(after=first[-1].instance_id, limit=10)
    assert first + rest == everything
    assert [i.instance_id for i in rest] == ["gpu-02", "gpu-03", "gpu-04"]
    assert rest[0].resident_blocks == {"hbm": 2}
    assert store.instances(after="gpu-04", limit=2) == [] and store.instances(limit=0) == []
    assert store.instances(ids=["gpu-04", "nope", "gpu-02"]) == [everything[2], everything[4]]


def test_context_and_holds_many(store: StateStore) -> None:
    store.apply(
        [
            routed("s", "r", 1.0, block_hashes=[5, "x", 7], prompt=3 * BLOCK),
            stored([5, "x"], 1.0),
            stored([7], 1.0, instance=None, tier="pool"),
        ]
    )
    c = store.context("s")
    assert (list(c.block_hashes), c.block_tokens, c.context_bytes, c.instance_id) == (
        [5, "x", 7],
        BLOCK,
        3 * BLOCK * BPT,
        "gpu-0",
    )
    assert store.context("nope") is None
    assert store.holds_many(
        [
            ("hbm", "gpu-0", [5, 7, "x"]),
            ("pool", None, [7]),
            ("host", "gpu-9", [5]),
            ("hbm", "gpu-0", []),
        ]
    ) == [[True, False, True], [True], [False], []]


def _held_by_holds(store: StateStore, where: Any, blocks: list[Any], start: int) -> int:
    """The held-run search done with `holds`, one block a probe: what held_prefixes must answer."""
    lo, hi = start, len(blocks)
    while lo < hi:
        m = (lo + hi + 1) // 2
        if store.holds(where[0], where[1], [blocks[m - 1]])[0]:
            lo = m
        else:
            hi = m - 1
    return lo


def test_held_prefixes_answer_the_search_over_holds(store: StateStore) -> None:
    context = list(range(1000, 1300))  # 300 blocks: several rounds of the Redis script
    store.apply(
        [
            routed("s", "r", 1.0, block_hashes=context, prompt=300 * BLOCK),
            stored(context[:200], 1.0),
            stored(context, 1.0, instance="gpu-1"),
            stored([7, 8], 1.0, instance="gpu-2"),
            # Not prefix-closed: a hole at 50..59 and the tail gone.
            stored(context[:50] + context[60:251], 1.0, instance="gpu-3"),
            stored(context[200:260], 1.0, tier="host"),
            stored(context[:1], 1.0, instance=None, tier="pool"),
        ]
    )
    where: list[Any] = [
        ("hbm", "gpu-0"),
        ("hbm", "gpu-1"),
        ("hbm", "gpu-2"),
        ("hbm", "gpu-3"),
        ("pool", None),
        ("host", "gpu-0"),
        ("host", "gpu-9"),
    ]
    starts = [0, 7, 299, 61, 0, 200, 150]
    expected = [_held_by_holds(store, w, context, 0) for w in where]
    expected_from = [_held_by_holds(store, w, context, s) for w, s in zip(where, starts)]
    assert expected[:5] == [200, 300, 0, expected[3], 1] and expected[3] in (50, 251)
    assert expected_from[5] == 260 and expected_from[3] == 251 and expected_from[6] == 150
    # The store's own sequence (packed in memory) and a plain list: the same answers.
    for blocks in (store.context("s").block_hashes, context):
        assert store.held_prefixes(where, blocks) == expected
        assert store.held_prefixes(where, blocks, starts) == expected_from
    assert store.held_prefixes([], context) == []
    assert store.held_prefixes(where[:2], [], [0, 0]) == [0, 0]
    store.apply([stored(["a", "b"], 2.0, instance="gpu-5")])
    assert store.held_prefixes([("hbm", "gpu-5"), ("hbm", "gpu-0")], ["a", "b", "c"]) == [2, 0]
    assert store.held_prefixes([("hbm", "gpu-5")], ["a", "b", "c"], [2]) == [2]


def test_instance_loads_are_those_of_the_instance_records(store: StateStore) -> None:
    store.apply(
        [
            ev(
                "instance_status",
                1.0,
                instance_id="gpu-1",
                free_kv_bytes=5,
                queue_depth=3,
                running_requests=2,
            ),
            routed("s", "r", 1.0, instance="gpu-0"),
        ]
    )
    ids = ["gpu-1", "gpu-0", "nope"]
    loads = store.instance_loads(ids)
    views = store.instances(ids=ids)
    assert loads == {i.instance_id: (i.queue_depth, i.running_requests) for i in views}
    assert loads["gpu-1"] == (3, 2) and "nope" not in loads
    assert store.instance_loads([]) == {}


# -- session signals ------------------------------------------------------------------------


def signal(session: str, ts: float, kind: str = "typing", **kw: Any) -> Event:
    return ev("session_signal", ts, session_id=session, kind=kind, **kw)


def _signals_held(store: StateStore, session_id: str) -> int:
    """How many signal entries the store itself holds for a session (not the view's count)."""
    return FACTORIES[type(store)].signals_held(store, session_id)


def test_a_signal_for_an_unknown_session_starts_it(store: StateStore) -> None:
    store.apply(
        [
            signal(
                "s",
                5.0,
                "tool_started",
                tool="web.search",
                instance_id="gpu-2",
                expected_in_seconds=2.5,
                expected_prompt_tokens=900,
            )
        ]
    )
    v = store.session("s")
    assert (v.state, v.turns, v.first_seen_ts, v.last_activity_ts) == ("idle", 0, 5.0, 5.0)
    assert (v.instance_id, v.last_request, v.context_tokens, v.signals_total) == (None, None, 0, 1)
    assert v.signals == [
        SignalView(
            ts=5.0,
            kind="tool_started",
            tool="web.search",
            instance_id="gpu-2",
            expected_in_seconds=2.5,
            expected_prompt_tokens=900,
        )
    ]
    # Signals alone set its times: the earliest and the newest of them.
    store.apply([signal("s", 3.0, "opened"), signal("s", 9.0)])
    v = store.session("s")
    assert (v.first_seen_ts, v.last_activity_ts, v.signals_total) == (3.0, 9.0, 3)
    assert [(x.ts, x.kind, x.tool, x.expected_in_seconds) for x in v.signals] == [
        (3.0, "opened", None, None),
        (5.0, "tool_started", "web.search", 2.5),
        (9.0, "typing", None, None),
    ]
    assert [x.session_id for x in store.live_sessions(10)] == ["s"]
    assert store.stats()["sessions"] == 1


def test_signals_never_move_the_times_of_a_session_with_requests(store: StateStore) -> None:
    events = [
        signal("s", 1.0, "opened"),
        routed("s", "r1", 10.0),
        finished("s", "r1", 12.0),
        signal("s", 30.0, "typing"),
        signal("s", 31.0, "typing"),
    ]
    for order in (events, list(reversed(events)), [events[k] for k in (3, 1, 0, 4, 2)]):
        store.clear()
        store.apply(order)
        v = store.session("s")
        assert (v.first_seen_ts, v.last_activity_ts, v.turns, v.state) == (10.0, 12.0, 1, "idle")
        assert (v.signals_total, [x.ts for x in v.signals]) == (3, [1.0, 30.0, 31.0])
        assert store.live_sessions(10) == [v]


def test_a_session_keeps_its_latest_signals_whatever_the_order(store: StateStore) -> None:
    # Ties at one ts are kept by the rest of the signal (kind, tool, ...), not by arrival.
    events = [signal("s", float(t // 2), kind=f"k{t % 3}", tool=f"t{t}") for t in range(20)]
    events += [signal("s", 9.0, "opened"), signal("s", 9.0, "opened", expected_in_seconds=1.0)]
    events.append(routed("s", "r1", 4.0))
    views = []
    for order in (events, list(reversed(events)), events[1::2] + events[::2]):
        store.clear()
        store.apply(order)
        views.append(store.session("s"))
    assert views[0] == views[1] == views[2]
    v = views[0]
    assert v.signals_total == 22 and len(v.signals) == RECENT_SIGNALS
    keys = [(x.ts, x.kind, x.tool or "", x.expected_in_seconds or -1.0) for x in v.signals]
    assert keys == sorted(keys) and keys[-1][0] == 9.0 and keys[0][0] >= 7.0
    assert [x.kind for x in v.signals if x.ts == 9.0] == ["k0", "k1", "opened", "opened"]


def test_a_resent_signal_counts_once(store: StateStore) -> None:
    a = signal("s", 1.0)
    assert store.apply([a, a]) == [True, False]
    assert store.apply([a]) == [False]
    v = store.session("s")
    assert (v.signals_total, len(v.signals)) == (1, 1)


def test_a_flood_of_signals_costs_bounded_memory(store: StateStore) -> None:
    for batch in range(5):
        store.apply([signal("s", batch * 1000.0 + i, kind=f"k{i % 7}") for i in range(400)])
        assert _signals_held(store, "s") == RECENT_SIGNALS
    v = store.session("s")
    assert v.signals_total == 2000 and v.signals[-1].ts == 4399.0


def test_signals_are_forgotten_with_their_session(bounded: StateStore) -> None:
    bounded.apply([routed("a", "r1", 10.0), signal("a", 60.0), signal("b", 20.0)])
    # "a" was last active at 10 (its signal does not count), "b" at 20: both past at 120.5.
    bounded.apply([routed("c", "r1", 120.5)])
    assert bounded.session("a") is None and bounded.session("b") is None
    assert bounded.stats()["sessions"] == 1
    # A signal older than the cutoff is ignored; a newer one starts the session afresh.
    bounded.apply([signal("a", 15.0), signal("b", 130.0)])
    assert bounded.session("a") is None
    bounded.apply([signal("a", 131.0)])
    v = bounded.session("a")
    assert (v.turns, v.signals_total, v.first_seen_ts, v.last_request) == (0, 1, 131.0, None)
    v = bounded.session("b")
    assert (v.signals_total, [x.ts for x in v.signals], v.first_seen_ts) == (1, [130.0], 130.0)
    # A request after signals gives the session its own times, then the request's alone.
    bounded.apply([routed("b", "r1", 125.0)])
    v = bounded.session("b")
    assert (v.first_seen_ts, v.last_activity_ts, v.signals_total) == (125.0, 125.0, 1)


def test_signal_ties_order_by_code_point_on_both_stores(store: StateStore) -> None:
    # Python orders strings by code point; the Lua copy compares bytes (UTF-8 keeps that order),
    # never the server locale's collation (which may put "z" before "Z").
    tools = ["é", "z", "Z", "a", "ab", "A", "日本", "_", "zz", "Ä"]
    store.apply([signal("s", 1.0, "tool_started", tool=t) for t in tools])
    kept = [x.tool for x in store.session("s").signals]
    assert kept == sorted(tools)[-RECENT_SIGNALS:]


# -- an engine's blocks joined to the router's session (vLLM's BlockStored session_id) ---------


def test_blocks_stored_for_a_session_extend_its_context_after_their_parent(
    store: StateStore,
) -> None:
    store.apply([routed("s", "r1", 10.0, block_hashes=[1, 2])])
    store.apply([stored([3, 4], 11.0, session_id="s", parent_block_hash=2)])
    assert store.session("s").block_hashes == [1, 2, 3, 4]
    # A new turn that diverges after block 1: the context is cut there.
    store.apply([stored([9], 12.0, session_id="s", parent_block_hash=1)])
    assert store.session("s").block_hashes == [1, 9]
    # No parent: a chain from the root starts the context again.
    store.apply([stored([7, 8], 13.0, session_id="s")])
    assert store.session("s").block_hashes == [7, 8]


def test_a_join_that_cannot_be_placed_changes_nothing(store: StateStore) -> None:
    store.apply([routed("s", "r1", 10.0, block_hashes=[1, 2])])
    store.apply(
        [
            stored([5], 11.0, session_id="s", parent_block_hash=99),  # parent not in the context
            stored([5], 11.0, session_id="s", parent_block_hash="2"),  # "2" is not 2
            stored([5], 9.0, session_id="s", parent_block_hash=2),  # older than the context
            stored([5], 11.0, session_id="s", parent_block_hash=2, tier="host"),  # not HBM
        ]
    )
    assert store.session("s").block_hashes == [1, 2]
    assert store.holds("hbm", "gpu-0", [5]) == [True]  # the blocks are stored all the same


def test_an_engine_s_blocks_start_no_session(store: StateStore) -> None:
    store.apply([stored([1, 2], 10.0, session_id="ghost")])
    assert store.session("ghost") is None
    store.apply([ev("session_signal", 11.0, session_id="sig", kind="opened")])
    store.apply([stored([1, 2], 12.0, session_id="sig")])
    assert store.session("sig").block_hashes == []  # known from a signal only: no context


def test_a_join_finds_its_parent_whole_among_string_hashes(store: StateStore) -> None:
    context = ["x,1,y", 'q"1', "1", 1]
    store.apply([routed("s", "r1", 10.0, block_hashes=context)])
    store.apply([stored([2], 11.0, session_id="s", parent_block_hash=1)])
    assert store.session("s").block_hashes == [*context, 2]
    store.apply([stored(["z"], 12.0, session_id="s", parent_block_hash="1")])
    assert store.session("s").block_hashes == ["x,1,y", 'q"1', "1", "z"]
    store.apply([stored([3], 13.0, session_id="s", parent_block_hash='q"1')])
    assert store.session("s").block_hashes == ["x,1,y", 'q"1', 3]


def test_a_join_in_the_same_apply_as_the_routing_sees_its_context(store: StateStore) -> None:
    store.apply(
        [
            routed("s", "r1", 10.0, block_hashes=[1, 2]),
            stored([3], 10.5, session_id="s", parent_block_hash=2),
            stored([4], 10.6, session_id="s", parent_block_hash=3),
        ]
    )
    assert store.session("s").block_hashes == [1, 2, 3, 4]


CAP, IRETENTION = 3, 50.0


@pytest.fixture(params=BACKENDS)
def capped(request: pytest.FixtureRequest) -> Iterator[StateStore]:
    """A store holding at most 3 instances, each forgotten 50 s after it was last heard of."""
    yield from open_store(
        request,
        bytes_per_token=BPT,
        block_tokens=BLOCK,
        session_retention_seconds=RETENTION,
        max_instances=CAP,
        instance_retention_seconds=IRETENTION,
    )


def _names(views: list[Any]) -> list[str]:
    return [v.instance_id for v in views]


def test_an_event_naming_a_new_instance_past_the_cap_is_ignored_whole(capped: StateStore) -> None:
    capped.apply(
        [
            stored([1], 10.0, instance="a"),
            ev("instance_status", 10.0, instance_id="b", free_kv_bytes=1),
            routed("s1", "r1", 10.0, instance="c"),
            # Past the cap: each kind of event naming a fourth instance changes nothing.
            stored([2], 11.0, instance="d"),
            removed([1], 11.0, instance="d"),
            cleared(11.0, instance="d"),
            ev("instance_status", 11.0, instance_id="d", free_kv_bytes=1),
            routed("s2", "r1", 11.0, instance="d"),
            ev(
                "vllm_kv_events",
                11.0,
                instance_id="d",
                events=[{"type": "BlockStored", "block_hashes": [3], "block_size": 16}],
            ),
            # Known instances still take events; so does the shared pool.
            stored([4], 12.0, instance="a"),
            stored([5], 12.0, instance=None, tier="pool"),
        ]
    )
    assert _names(capped.instances()) == ["a", "b", "c"]
    assert capped.known_instances(["a", "d"]) == ([True, False], 3)
    assert [loc.location for loc in capped.locations()] == ["hbm@a", "pool"]
    assert capped.session("s2") is None and capped.session("s1") is not None
    assert capped.holds("hbm", "d", [2, 3]) == [False, False]
    assert capped.holds("hbm", "a", [1, 4]) == [True, True]
    stats = capped.stats()
    assert (stats["instances"], stats["locations"], stats["resident_blocks"]) == (3, 2, 3)


def test_an_instance_unheard_of_past_its_retention_is_forgotten_with_its_locations(
    capped: StateStore,
) -> None:
    capped.apply(
        [
            stored([1, 2], 10.0, instance="a"),
            stored([3], 10.0, instance="a", tier="host"),
            stored([7], 30.0, instance="b"),
            stored([8], 30.0, instance=None, tier="pool"),
        ]
    )
    capped.apply([ev("instance_status", 60.0, instance_id="c", free_kv_bytes=1)])  # cutoff 10
    assert _names(capped.instances()) == ["a", "b", "c"]  # a was heard of at 10: kept
    capped.apply([ev("instance_status", 60.5, instance_id="c", free_kv_bytes=1)])  # cutoff 10.5
    assert _names(capped.instances()) == ["b", "c"]
    assert [loc.location for loc in capped.locations()] == ["hbm@b", "pool"]
    assert capped.holds("hbm", "a", [1, 2]) == [False, False]
    assert capped.holds("host", "a", [3]) == [False]
    assert capped.instances(ids=["a", "b"]) == capped.instances(ids=["b"])
    assert list(capped.instance_loads(["a", "b"])) == ["b"]
    assert capped.stats()["instances"] == 2 and capped.stats()["locations"] == 2
    # The room it left is taken by a new instance; "a" comes back afresh, with nothing held.
    capped.apply([stored([9], 61.0, instance="d"), stored([2], 61.0, instance="a")])
    assert _names(capped.instances()) == ["b", "c", "d"]
    capped.apply([ev("instance_status", 81.0, instance_id="c", free_kv_bytes=1)])  # cutoff 31
    capped.apply([stored([2], 81.0, instance="a")])  # b forgotten: room for a
    assert _names(capped.instances()) == ["a", "c", "d"]
    a = capped.instances(ids=["a"])[0]
    assert (a.last_seen_ts, a.resident_blocks) == (81.0, {"hbm": 1})
    assert capped.holds("hbm", "a", [1, 2]) == [False, True]


def test_instances_past_the_cap_and_retention_stay_bounded_under_distinct_ids(
    capped: StateStore,
) -> None:
    # 400 distinct instances over 200 s of event time, in batches: at most the cap at any time.
    for start in range(0, 400, 40):
        capped.apply([stored([i], i * 0.5, instance=f"gpu-{i}") for i in range(start, start + 40)])
        stats = capped.stats()
        assert stats["instances"] <= CAP and stats["locations"] <= CAP
        assert len(capped.instances()) == stats["instances"]
    assert len(capped.locations()) == capped.stats()["locations"]


def test_locations_page_by_name(store: StateStore) -> None:
    store.apply(
        [stored([i], 1.0, instance=f"gpu-{i}") for i in range(4)]
        + [
            stored([9], 1.0, instance="gpu-1", tier="host"),
            stored([8], 1.0, instance=None, tier="pool"),
        ]
    )
    everything = store.locations()
    assert [loc.location for loc in everything] == [
        "hbm@gpu-0",
        "hbm@gpu-1",
        "hbm@gpu-2",
        "hbm@gpu-3",
        "host@gpu-1",
        "pool",
    ]
    first = store.locations(limit=2)
    second = store.locations(after=first[-1].location, limit=3)
    rest = store.locations(after=second[-1].location, limit=3)
    assert first + second + rest == everything and len(rest) == 1
    assert store.locations(after="pool", limit=5) == [] and store.locations(limit=0) == []


def test_a_model_changed_record_is_seen_once_and_changes_nothing_else(store: StateStore) -> None:
    """The service's own record (RECORD_EVENT_TYPES): deduplicated like any event, but no
    state and no window moves, whatever its ts."""
    store.apply([routed("s", "r1", 100.0)])
    before = store.session("s")
    record = ev("model_changed", 9_000.0, slot="serving", action="promoted", version="v2")
    assert store.apply([record]) == [True]
    assert store.apply([record]) == [False]  # a resend is a duplicate
    assert store.seen_and_newest([record.event_id]) == ([True], 100.0)
    assert store.session("s") == before
