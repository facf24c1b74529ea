"""The Engine (app/engine.py) driven by hand, as the replay drives it: ingest, a scoring tick, a
planning tick, close; and the HTTP driver around a prebuilt one."""

from __future__ import annotations

import asyncio
import itertools
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.clock import ManualClock
from app.core.cluster import ClusterSpec
from app.core.config import Settings
from app.decide.advisor import Thresholds
from app.deliver import InProcessSink
from app.engine import Engine
from app.ingest.base import NullEventLog
from app.predict.slots import Serving
from app.state import MemoryStore
from kvprefetch_client.events import Event, event_adapter
from kvprefetch_client.orders import Order
from tests.decide.test_scorer import Fixed

BYTES_PER_TOKEN, BLOCK_TOKENS = 1000, 16
BLOCK_BYTES = BYTES_PER_TOKEN * BLOCK_TOKENS
_ids = itertools.count()


def ev(type_: str, ts: float, **fields: object) -> Event:
    return event_adapter.validate_python(
        {"type": type_, "event_id": f"e{next(_ids)}", "ts": ts, **fields}
    )


def settings(tmp_path: Path, **kw: object) -> Settings:
    return Settings(
        data_dir=tmp_path,
        log_fsync=False,
        replica_id="test-engine",
        bytes_per_token=BYTES_PER_TOKEN,
        block_tokens=BLOCK_TOKENS,
        score_interval_seconds=0,
        plan_interval_seconds=0,
        dashboard_sample_seconds=0,
        model_dir=tmp_path / "no-model",
        **kw,
    )  # type: ignore[arg-type]


def engine(
    tmp_path: Path, p_back: float = 0.9, **kw: object
) -> tuple[Engine, MemoryStore, InProcessSink]:
    store = MemoryStore(bytes_per_token=BYTES_PER_TOKEN, block_tokens=BLOCK_TOKENS)
    sink = InProcessSink()
    built = Engine(settings(tmp_path, **kw), store=store, clock=ManualClock(0.0), order_sink=sink)
    built.models.serving = Serving(Fixed(p_back), "fixed", None)  # type: ignore[arg-type]
    return built, store, sink


def a_finished_turn_whose_context_is_in_the_pool(ts: float = 1.0) -> list[Event]:
    """s1's turn on gpu-0, done; its two blocks are in the pool, not in gpu-0's HBM (which has
    room)."""
    return [
        ev(
            "request_routed",
            ts,
            session_id="s1",
            request_id="r1",
            instance_id="gpu-0",
            prompt_tokens=32,
            block_hashes=[1, 2],
            block_tokens=BLOCK_TOKENS,
        ),
        ev(
            "request_finished",
            ts + 1,
            session_id="s1",
            request_id="r1",
            instance_id="gpu-0",
            output_tokens=1,
        ),
        ev("kv_blocks_stored", ts + 1, tier="pool", instance_id=None, block_hashes=[1, 2]),
        ev(
            "instance_status",
            ts + 1,
            instance_id="gpu-0",
            free_kv_bytes=100 * BLOCK_BYTES,
            total_kv_bytes=100 * BLOCK_BYTES,
            queue_depth=0,
            running_requests=0,
        ),
    ]


def test_an_ingested_session_is_scored_and_its_prefetch_reaches_the_sink(tmp_path: Path) -> None:
    built, store, sink = engine(tmp_path)
    result = built.ingest(a_finished_turn_whose_context_is_in_the_pool())
    assert len(result.accepted) == 4 and store.session("s1") is not None
    built.clock.set(10.0)  # type: ignore[attr-defined]
    assert built.score_tick() == 1
    # The scoring tick drained the backlog first: the ledger heard of the turn and holds the advice.
    assert built.ledger.stats("live").predictions == 1
    assert built.ledger.latest("live", "s1").prefetch  # type: ignore[union-attr]
    plan = asyncio.run(built.plan_tick())
    (order,) = [o for o in plan.orders if o.kind == "prefetch"]
    assert (order.instance_id, list(order.block_hashes), order.session_ids) == (
        "gpu-0",
        [1, 2],
        ["s1"],
    )
    assert [m.order_id for m in sink.drain() if isinstance(m, Order)] == [
        o.order_id for o in plan.orders
    ]
    # The agent's report comes back through ingest to the scheduler (its feedback observer).
    built.ingest([ev("order_progress", 11.0, order_id=order.order_id, status="accepted")])
    built.drain()
    assert store.order(order.order_id).status == "accepted"  # type: ignore[union-attr]
    assert (
        built.scheduler.open_orders() and not asyncio.run(built.plan_tick()).orders
    )  # not ordered twice
    asyncio.run(built.close())


def test_the_order_retry_backoff_settings_reach_the_scheduler(tmp_path: Path) -> None:
    built, _, _ = engine(
        tmp_path, order_retry_backoff_seconds=2.5, order_retry_backoff_max_seconds=40.0
    )
    config = built.scheduler.config
    assert (config.retry_backoff_seconds, config.retry_backoff_max_seconds) == (2.5, 40.0)
    asyncio.run(built.close())


def test_a_started_prefetch_is_given_up_order_overdue_seconds_past_its_needed_by(
    tmp_path: Path,
) -> None:
    for overdue_seconds, given_up in ((60.0, True), (600.0, False)):
        built, _, _ = engine(tmp_path / str(overdue_seconds), order_overdue_seconds=overdue_seconds)
        assert built.scheduler.config.overdue_seconds == overdue_seconds
        built.ingest(a_finished_turn_whose_context_is_in_the_pool())
        built.clock.set(10.0)  # type: ignore[attr-defined]
        built.score_tick()
        (order,) = [o for o in asyncio.run(built.plan_tick()).orders if o.kind == "prefetch"]
        built.ingest([ev("order_progress", 11.0, order_id=order.order_id, status="accepted")])
        built.drain()
        # Two minutes past its needed_by, and no word of its end.
        built.clock.set(order.needed_by_ts + 120.0)  # type: ignore[attr-defined]
        asyncio.run(built.plan_tick())
        still_open = [o.order_id for o in built.scheduler.open_orders()]
        assert (order.order_id not in still_open) is given_up
        assert built.scheduler.totals.failed == (1 if given_up else 0)
        asyncio.run(built.close())


def test_score_tick_given_session_ids_scores_exactly_those(tmp_path: Path) -> None:
    built, _, _ = engine(tmp_path)
    built.ingest(
        [
            *a_finished_turn_whose_context_is_in_the_pool(),
            ev(
                "request_routed",
                1.0,
                session_id="s2",
                request_id="r2",
                instance_id="gpu-0",
                prompt_tokens=16,
                block_hashes=[7],
            ),
            ev(
                "request_finished",
                2.0,
                session_id="s2",
                request_id="r2",
                instance_id="gpu-0",
                output_tokens=1,
            ),
        ]
    )
    built.clock.set(10.0)  # type: ignore[attr-defined]
    assert built.score_tick(["s2", "nobody"]) == 1
    assert (
        built.ledger.latest("live", "s2") is not None and built.ledger.latest("live", "s1") is None
    )
    asyncio.run(built.close())


def test_the_thresholds_are_set_once_for_advisor_and_scheduler(tmp_path: Path) -> None:
    # A chance of 0.6 is a prefetch by default (0.5) and none at KVP_PREFETCH_MIN_P=0.7.
    for min_p, prefetches in ((0.5, True), (0.7, False)):
        built, _, _ = engine(
            tmp_path / str(min_p), p_back=0.6, prefetch_min_p=min_p, lead_seconds=20.0
        )
        assert built.thresholds == Thresholds(prefetch_min_p=min_p, lead_seconds=20.0)
        assert (built.scheduler.config.prefetch_min_p, built.scheduler.config.lead_seconds) == (
            min_p,
            20.0,
        )
        built.ingest(a_finished_turn_whose_context_is_in_the_pool())
        built.clock.set(10.0)  # type: ignore[attr-defined]
        built.score_tick()
        assert built.ledger.latest("live", "s1").prefetch is prefetches  # type: ignore[union-attr]
        assert (
            any(o.kind == "prefetch" for o in asyncio.run(built.plan_tick()).orders) is prefetches
        )
        asyncio.run(built.close())


def test_horizons_out_of_order_are_refused_as_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lead_seconds"):
        settings(tmp_path, lead_seconds=400.0)


def test_the_cluster_is_described_once(tmp_path: Path) -> None:
    built, _, _ = engine(tmp_path, pool_link_bytes_per_second=1e6, prefetch_link_share=0.25)
    spec = built.cluster
    assert spec == ClusterSpec(
        bytes_per_token=BYTES_PER_TOKEN,
        block_tokens=BLOCK_TOKENS,
        pool_link_bytes_per_second=1e6,
        link_share=0.25,
    )
    assert spec.bytes_per_block == BLOCK_BYTES and spec.load_seconds(1e6, "pool") == 1.0
    assert spec.recompute_seconds(20_000) == 1.0
    config = built.scheduler.config
    assert (config.bytes_per_block, config.pool_link_bytes_per_second, config.link_share) == (
        BLOCK_BYTES,
        1e6,
        0.25,
    )
    assert built.hint_config.pool_link_bytes_per_second == 1e6
    asyncio.run(built.close())


def test_close_is_idempotent_and_closes_only_what_it_built(tmp_path: Path) -> None:
    built, store, sink = engine(tmp_path)
    built.ingest(a_finished_turn_whose_context_is_in_the_pool())
    asyncio.run(built.close())
    asyncio.run(built.close())  # a second call does nothing
    assert built.closed and not built.running
    # The injected store and sink are the caller's: still open.
    assert store.session("s1") is not None
    assert sink.submit_nowait([]) == []
    # The backlog was drained on the way: the ledger heard of the routed request.
    assert built.backlog.events == 0 and built.ledger.stats("live").unscored == 1


def test_a_replay_engine_writes_nothing_to_the_data_dir(tmp_path: Path) -> None:
    store = MemoryStore(bytes_per_token=BYTES_PER_TOKEN, block_tokens=BLOCK_TOKENS)
    built = Engine(
        settings(tmp_path / "data"),
        store=store,
        clock=ManualClock(0.0),
        order_sink=InProcessSink(),
        event_log=NullEventLog(),
        recover=False,
        load_model=False,
    )
    built.ingest(a_finished_turn_whose_context_is_in_the_pool())
    asyncio.run(built.close())
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").rglob("*.jsonl*"))
    assert built.models.serving.version is None  # the heuristic, nothing loaded
    # A replay's models compile before they score, so its answers never change midway; the
    # service's start never waits on a compile (the Booster serves meanwhile).
    assert not built.models.compile_in_background
    service, _, _ = engine(tmp_path / "service")
    assert service.models.compile_in_background
    asyncio.run(service.close())


def test_create_app_runs_a_prebuilt_engine(tmp_path: Path) -> None:
    built, store, _ = engine(tmp_path)
    with TestClient(create_app(built)) as client:
        assert client.app.state.engine is built  # type: ignore[attr-defined]
        body = {
            "events": [
                e.model_dump(mode="json") for e in a_finished_turn_whose_context_is_in_the_pool()
            ]
        }
        assert client.post("/v1/events", json=body).status_code == 200
        assert built.running
    assert built.closed and store.session("s1") is not None
    with pytest.raises(ValueError, match=r"Engine\(\)"):
        create_app(built, store=store)


def test_a_replay_engine_takes_no_setting_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sim.replay import sim_engine
    from sim.scenario import load_scenario

    monkeypatch.setenv("KVP_PREFETCH_MIN_P", "0.9")
    monkeypatch.setenv("KVP_POOL_LINK_BYTES_PER_SECOND", "1")
    scenario = load_scenario("default")
    replay_engine = sim_engine(scenario, load_model=False, planner_options={"keep_min_p": 0.3})
    assert replay_engine.thresholds == Thresholds(keep_min_p=0.3)
    assert replay_engine.cluster == scenario.cluster
    asyncio.run(replay_engine.close())


@pytest.mark.parametrize("model", ["heuristic", "learned"])
def test_a_session_known_only_by_its_signals_is_scored_and_planned_without_harm(
    tmp_path: Path, model: str
) -> None:
    # A signal-only session is live (idle, no turn, no instance, no blocks): every reader of
    # live sessions (the scorer's features, the planner, outcomes, metrics) takes it.
    from tests.conftest import REPO

    model_dir = REPO / "models" / "default" if model == "learned" else tmp_path / "no-model"
    store = MemoryStore(bytes_per_token=BYTES_PER_TOKEN, block_tokens=BLOCK_TOKENS)
    built = Engine(
        settings(tmp_path).model_copy(update={"model_dir": model_dir}),
        store=store,
        clock=ManualClock(0.0),
        order_sink=InProcessSink(),
    )
    assert built.models.serving.version == (None if model == "heuristic" else "default")
    events = a_finished_turn_whose_context_is_in_the_pool()
    events += [
        ev("session_signal", 5.0, session_id="new", kind="opened"),
        ev("session_signal", 6.0, session_id="s1", kind="typing", expected_in_seconds=2.0),
        ev("session_signal", 7.0, session_id="new", kind="tool_started", tool="grep"),
    ]
    assert len(built.ingest(events).accepted) == 7
    built.clock.set(10.0)  # type: ignore[attr-defined]
    assert built.score_tick() == 2
    asyncio.run(built.plan_tick())
    view = store.session("new")
    assert (view.turns, view.state, view.signals_total) == (0, "idle", 2)  # type: ignore[union-attr]
    assert [k.signals for k in built.metrics.signals.totals()][:3] == [1, 1, 1]
    asyncio.run(built.close())


def test_with_the_lru_guard_advice_that_loses_to_lru_is_turned_off(tmp_path: Path) -> None:
    built, _, _ = engine(tmp_path, lru_guard=True, lru_guard_min_arrivals=5)
    assert built.guard is not None and built.settings.lru_guard
    events = [
        ev(
            "instance_status",
            0.0,
            instance_id="gpu-0",
            free_kv_bytes=100 * BLOCK_BYTES,
            total_kv_bytes=100 * BLOCK_BYTES,
        )
    ]
    # Six sessions come back to their context; the engine reports it nowhere in gpu-0's HBM (the
    # advice let it go), only in the pool, where LRU would have kept it: the advice lost each.
    for k in range(6):
        context = [1000 * k + 1, 1000 * k + 2]
        events.append(ev("kv_blocks_stored", 1.0, tier="pool", block_hashes=context))
        for turn in range(2):
            events.append(
                ev(
                    "request_routed",
                    10.0 * k + 5.0 * turn + 1,
                    session_id=f"s{k}",
                    request_id=f"r{k}-{turn}",
                    instance_id="gpu-0",
                    prompt_tokens=32,
                    block_hashes=context,
                    block_tokens=BLOCK_TOKENS,
                )
            )
    for e in events:  # one batch each, as engines and routers post them
        built.ingest([e])
    built.drain()
    verdict = built.guard.verdicts["gpu-0"]
    assert (verdict.state, verdict.fallbacks) == ("lru", 1)
    assert not built.guard.allowed("gpu-0", built.clock.now())
    text = built.metrics.exposition().decode()
    assert 'kvprefetch_lru_guard_instances{state="lru"} 1.0' in text
    assert "kvprefetch_lru_guard_fallbacks_total 1.0" in text


def test_the_lru_guard_is_on_by_default_and_off_when_told(tmp_path: Path) -> None:
    built, _, _ = engine(tmp_path)
    assert built.guard is not None and built.scorer.guard is built.guard
    built, _, _ = engine(tmp_path / "off", lru_guard=False)
    assert built.guard is None and built.scorer.guard is None


# -- the event log written off the loop (memory store) -----------------------------------------


def _blocking_log(built: Engine) -> tuple[threading.Event, threading.Event, list[int]]:
    """The engine's log appends, held until `release` is set; `entered` set at each, whose sizes
    are listed."""
    entered, release, sizes = threading.Event(), threading.Event(), []
    append = built.event_log.append

    def held(data: bytes):  # type: ignore[no-untyped-def]
        sizes.append(len(data))
        entered.set()
        release.wait(5)
        return append(data)

    built.event_log.append = held  # type: ignore[method-assign]
    return entered, release, sizes


def test_the_loop_runs_on_while_a_batch_waits_on_its_log_write(tmp_path: Path) -> None:
    built, store, _ = engine(tmp_path)
    entered, release, sizes = _blocking_log(built)
    turn = a_finished_turn_whose_context_is_in_the_pool()

    async def main() -> None:
        first = asyncio.create_task(built.ingest_async(turn[:1]))
        second = asyncio.create_task(built.ingest_async(turn[1:]))
        # Were the write on the loop, the loop would sit in it until `release` timed out.
        assert await asyncio.to_thread(entered.wait, 5)
        for _ in range(5):
            await asyncio.sleep(0)
        assert not first.done() and not second.done()
        assert store.session("s1") is None  # applied only once logged
        assert len(sizes) == 1  # the log thread takes the second batch after the first
        release.set()
        one, two = await first, await second
        assert one is not None and two is not None
        assert one.accepted == [turn[0].event_id]
        assert two.accepted == [e.event_id for e in turn[1:]]

    asyncio.run(main())
    assert len(sizes) == 2
    assert store.checkpoint("test-engine") == built.event_log.position
    assert store.session("s1") is not None


def test_a_caller_cancelled_midway_leaves_its_batch_logged_and_applied(tmp_path: Path) -> None:
    built, store, _ = engine(tmp_path)
    entered, release, _ = _blocking_log(built)
    turn = a_finished_turn_whose_context_is_in_the_pool()

    async def main() -> None:
        caller = asyncio.create_task(built.ingest_async(turn))
        assert await asyncio.to_thread(entered.wait, 5)
        caller.cancel()  # a request that timed out
        with pytest.raises(asyncio.CancelledError):
            await caller
        closing = asyncio.create_task(built.close())
        await asyncio.sleep(0.05)
        assert not closing.done()  # close waits for the batch under way
        release.set()
        await closing

    asyncio.run(main())
    assert store.session("s1") is not None
    assert store.checkpoint("test-engine") == built.event_log.position
    # The client's retry finds its events taken.
    retry = built.ingestor.ingest(turn)
    assert retry.accepted == [] and len(retry.duplicates) == len(turn)


def test_batches_being_logged_count_against_the_backlogs_room(tmp_path: Path) -> None:
    built, store, _ = engine(tmp_path, backlog_max_events=3, max_batch_events=3)
    entered, release, sizes = _blocking_log(built)
    turn = a_finished_turn_whose_context_is_in_the_pool()  # three events

    async def main() -> None:
        first = asyncio.create_task(built.ingest_async(turn[:2], check_room=True))
        assert await asyncio.to_thread(entered.wait, 5)
        # Two events on their way to the backlog: no room for two more, nothing logged of them.
        assert await built.ingest_async(turn[2:] * 2, check_room=True) is None
        assert len(sizes) == 1
        release.set()
        assert (await first) is not None

    asyncio.run(main())
    assert store.session("s1") is not None


def test_with_the_log_thread_off_a_batch_is_written_on_the_loop(tmp_path: Path) -> None:
    built, store, _ = engine(tmp_path, log_thread=False)
    writers: list[str] = []
    append = built.event_log.append

    def recorded(data: bytes):  # type: ignore[no-untyped-def]
        writers.append(threading.current_thread().name)
        return append(data)

    built.event_log.append = recorded  # type: ignore[method-assign]

    async def main() -> str:
        assert await built.ingest_async(a_finished_turn_whose_context_is_in_the_pool()) is not None
        return threading.current_thread().name

    assert writers == [asyncio.run(main())]
    assert store.session("s1") is not None


def test_a_batch_the_log_refuses_is_abandoned_and_the_next_one_still_applies(
    tmp_path: Path,
) -> None:
    from app.core.errors import EventLogError

    built, store, _ = engine(tmp_path)
    append, calls = built.event_log.append, []

    def full_once(data: bytes):  # type: ignore[no-untyped-def]
        calls.append(len(data))
        if len(calls) == 1:
            raise EventLogError("No space left on device")
        return append(data)

    built.event_log.append = full_once  # type: ignore[method-assign]
    turn = a_finished_turn_whose_context_is_in_the_pool()

    async def main() -> None:
        first = asyncio.create_task(built.ingest_async(turn[:1]))
        second = asyncio.create_task(built.ingest_async(turn[1:]))
        with pytest.raises(EventLogError):
            await first
        taken = await second
        assert taken is not None and taken.accepted == [e.event_id for e in turn[1:]]
        retry = await built.ingest_async(turn[:1])  # the client's retry of the refused batch
        assert retry is not None and retry.accepted == [turn[0].event_id]

    asyncio.run(main())
    assert store.checkpoint("test-engine") == built.event_log.position


def _log_ids(built: Engine) -> list[str]:
    from app.ingest.eventlog import iter_log

    return [e.event_id for _, e in iter_log(Path(built.event_log.directory), None)]


def test_a_retry_overlapping_its_original_waits_and_is_logged_once(tmp_path: Path) -> None:
    built, store, _ = engine(tmp_path)
    entered, release, sizes = _blocking_log(built)
    turn = a_finished_turn_whose_context_is_in_the_pool()

    async def main() -> None:
        original = asyncio.create_task(built.ingest_async(turn))
        assert await asyncio.to_thread(entered.wait, 5)
        # The client gave up on the original and retries the same ids while it is written.
        retry = asyncio.create_task(built.ingest_async(turn))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not retry.done() and len(sizes) == 1  # held back, nothing handed to the log
        release.set()
        first, again = await original, await retry
        assert first is not None and first.accepted == [e.event_id for e in turn]
        assert again is not None and again.accepted == []
        assert again.duplicates == [e.event_id for e in turn]

    asyncio.run(main())
    assert len(sizes) == 1
    assert _log_ids(built) == [e.event_id for e in turn]
    assert store.session("s1") is not None


def test_a_retry_of_a_batch_the_log_refused_is_logged(tmp_path: Path) -> None:
    from app.core.errors import EventLogError

    built, store, _ = engine(tmp_path)
    entered, release, _ = _blocking_log(built)
    held_append, calls = built.event_log.append, []

    def full_once(data: bytes):  # type: ignore[no-untyped-def]
        calls.append(len(data))
        if len(calls) == 1:
            entered.set()
            release.wait(5)
            raise EventLogError("No space left on device")
        return held_append(data)

    built.event_log.append = full_once  # type: ignore[method-assign]
    turn = a_finished_turn_whose_context_is_in_the_pool()

    async def main() -> None:
        original = asyncio.create_task(built.ingest_async(turn))
        assert await asyncio.to_thread(entered.wait, 5)
        retry = asyncio.create_task(built.ingest_async(turn))
        for _ in range(5):
            await asyncio.sleep(0)
        release.set()
        with pytest.raises(EventLogError):
            await original
        again = await retry
        assert again is not None and again.accepted == [e.event_id for e in turn]

    asyncio.run(main())
    assert _log_ids(built) == [e.event_id for e in turn]
    assert store.session("s1") is not None


# Who hears of an accepted batch from the backlog, in order, and why there (app/engine.py,
# Engine._ordered_observers):
OBSERVER_ORDER = [
    # First: arrivals are scored against the advice in force before anything moves.
    "ledger",
    # The planning side (another replica's batches reach these too, with a planning lease):
    "scorer",
    # Before the feedback, which forgets a completed order the landed prefetches look up.
    "landed",
    "feedback",
    # What the sink needs to hear (here the pull queue's order_progress).
    "sink:PullQueue",
    # Before the outcomes: it looks each arrival up in its LRU before the outcome moves it.
    "guard",
    "outcomes",
    "tools",
    "retrainer",
    # Last: they sync their counters with what the others counted just now.
    "metrics",
]


def test_the_observers_are_one_list_in_a_pinned_order(tmp_path: Path) -> None:
    built = Engine(
        settings(tmp_path, order_sink="pull", retrain_every_seconds=3600.0),
        clock=ManualClock(0.0),
    )
    try:
        assert [o.name for o in built.observers] == OBSERVER_ORDER
        assert [o.name for o in built.immediate_observers][:2] == ["deployment", "backlog"]
    finally:
        asyncio.run(built.close())
    # Optional ones leave their place empty, the others keep their order.
    plain = Engine(settings(tmp_path / "plain", order_sink="memory", lru_guard=False))
    try:
        expected = [n for n in OBSERVER_ORDER if n not in ("sink:PullQueue", "guard", "retrainer")]
        assert [o.name for o in plain.observers] == expected
    finally:
        asyncio.run(plain.close())
