"""The scoring loop's pass over every live session (`Scorer(every_live=True)`): a FeatureTable kept
current from the store, every live session advised each pass in chunks, the advice equal to the
Advisor's on the same sessions' views at the same time, on both stores."""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.core.bundle import DEFAULT_MODEL_DIR
from app.core.clock import ManualClock
from app.decide.advisor import MAX_IDLE_SECONDS, Advisor, SessionAdvice, Thresholds
from app.decide.popularity import PrefixPopularity
from app.decide.routing import SameInstanceEstimate
from app.decide.scheduler import Scheduler, SchedulerConfig
from app.decide.scorer import HANDOFF_REFRESH_SECONDS, Scorer, next_chunk_sessions
from app.decide.table_advice import advise_rows, session_advice
from app.observe.ledger import AdviceLedger
from app.predict.features import SESSION_FEATURES
from app.predict.predictors import LearnedPredictor
from app.predict.slots import ModelSlots, Serving
from app.predict.tool_durations import ToolDurations
from app.state import MemoryStore
from app.state.base import StateStore
from app.state.redis import RedisStore
from kvprefetch_client.events import Event, event_adapter
from tests.decide.test_scorer import Fixed

_ids = itertools.count()
NOW = 10_000.0


def ev(type_: str, ts: float, **fields: object) -> Event:
    return event_adapter.validate_python(
        {"type": type_, "event_id": f"t{next(_ids)}", "ts": ts, **fields}
    )


def turn(
    session_id: str, routed_ts: float, finished_ts: float | None, blocks: list[int] | None = None
) -> list[Event]:
    request_id = f"r{next(_ids)}"
    out = [
        ev(
            "request_routed",
            routed_ts,
            session_id=session_id,
            request_id=request_id,
            instance_id=f"gpu-{hash(session_id) % 3}",
            prompt_tokens=1000,
            block_hashes=blocks if blocks is not None else [1, 2],
        )
    ]
    if finished_ts is not None:
        out.append(
            ev(
                "request_finished",
                finished_ts,
                session_id=session_id,
                request_id=request_id,
                instance_id=f"gpu-{hash(session_id) % 3}",
                output_tokens=50,
            )
        )
    return out


def mixed_events(n: int, seed: int) -> list[Event]:
    """Sessions of every kind the advisor tells apart: idle with a few turns (some sharing a
    context head), running, queued, closed, signalled (fresh and stale), idle past the horizon
    (some with a fresh signal), with no blocks."""
    rng = random.Random(seed)
    out: list[Event] = []
    for i in range(n):
        sid = f"s{i}"
        kind = i % 10
        t = NOW - (rng.uniform(5.0, 90.0) if i % 2 else rng.uniform(5.0, 1500.0))
        gap = 40.0 if i % 2 else 200.0
        blocks = [1000 + i % 4, *range(10 * i, 10 * i + rng.randint(1, 12))] if i % 3 else []
        for k in range(rng.randint(1, 4)):
            out += turn(sid, t - gap * (k + 1), t - gap * (k + 1) + 20.0, blocks or None)
        if kind == 1:
            out += turn(sid, t, None, blocks)  # running or queued
            if rng.random() < 0.5:
                out.append(
                    ev(
                        "request_started",
                        t + 1.0,
                        session_id=sid,
                        request_id=f"x{i}",
                        instance_id="gpu-0",
                    )
                )
        else:
            out += turn(sid, t, t + 20.0, blocks)
        if kind == 2:
            out.append(ev("session_closed", t + 30.0, session_id=sid))
        if kind in (3, 4):
            ts = NOW - rng.uniform(0.0, 60.0)
            out.append(
                ev("session_signal", ts, session_id=sid, kind=rng.choice(["opened", "typing"]))
            )
        if kind == 5:
            old = NOW - MAX_IDLE_SECONDS - rng.uniform(10.0, 500.0)
            out += turn(f"old{i}", old - 100.0, old, blocks)
            if i % 20 == 5:
                out.append(ev("session_signal", NOW - 3.0, session_id=f"old{i}", kind="opened"))
    return out


def tool_runs(n: int, start: float) -> list[Event]:
    """`n` finished runs of `bash`, 2 to 40 s long, by other sessions."""
    out = []
    for k in range(n):
        t, sid = start + 60.0 * k, f"agent{k}"
        out.append(ev("session_signal", t, session_id=sid, kind="tool_started", tool="bash"))
        seconds = 2.0 + 38.0 * k / (n - 1)
        out.append(
            ev("session_signal", t + seconds, session_id=sid, kind="tool_finished", tool="bash")
        )
    return out


class Floors:
    """A deployment whose signals are worth a fixed chance per kind (the advisor's floor)."""

    def followed_lower_bound(self, kind: str) -> float:
        return {"opened": 0.6, "typing": 0.3}.get(kind, 0.0)


def scorer_for(store: StateStore, predictor: Any, **kw: Any) -> tuple[Scorer, AdviceLedger]:
    ledger = AdviceLedger()
    models = ModelSlots(Path("no-model"), ledger=ledger)
    models.serving = Serving(predictor, "test", None)
    routes = SameInstanceEstimate()
    for k in range(10):  # 7 of 10 returns land where the context is: p_same < 1
        routes.observe("gpu-0", "gpu-0" if k < 7 else "gpu-1")
    popularity = PrefixPopularity()
    for i in range(4):
        popularity.routed("a", [1000 + i], NOW - 10.0)
        popularity.routed("b", [1000 + i], NOW - 5.0)
    scorer = Scorer(
        store,
        models,
        ledger,
        ManualClock(NOW),
        routes=routes,
        popularity=popularity,
        deployment=Floors(),  # type: ignore[arg-type]
        every_live=True,
        **kw,
    )
    return scorer, ledger


def view_path_advice(scorer: Scorer, advisor: Advisor, now: float) -> dict[str, SessionAdvice]:
    """What the page path advises on the same sessions: their views, read from the store."""
    ids = scorer.table.session_ids
    views = [v for v in scorer.store.sessions(ids) if v is not None]
    return {a.session_id: a for a in advisor.advise(views, now)}


def table_path_advice(scorer: Scorer, advisor: Advisor, now: float) -> dict[str, SessionAdvice]:
    table = scorer.table
    rows = np.arange(len(table))
    advice = advise_rows(advisor, table, scorer._held, rows, now, read=scorer.store.sessions)
    out = session_advice(advisor, table, scorer._held, advice, np.arange(len(advice.rows)), now)
    return {a.session_id: a for a in out}


@pytest.fixture(scope="module")
def model() -> LearnedPredictor:
    return LearnedPredictor(DEFAULT_MODEL_DIR)


def check_parity(store: StateStore, model: LearnedPredictor) -> None:
    store.apply(mixed_events(120, seed=7))
    # Thresholds the bundled model's chances on these sessions fall on both sides of.
    thresholds = Thresholds(keep_min_p=0.14, demote_max_p=0.02, prefetch_min_p=0.2)
    tools = ToolDurations()
    scorer, ledger = scorer_for(store, model, chunk_sessions=32, thresholds=thresholds, tools=tools)
    # Tool calls in flight for a few idle sessions (some signalled too): their tools' curves
    # stand for the model's on both paths.
    tools.observe(tool_runs(20, NOW - 3000.0))
    tooled = [f"s{i}" for i in range(120) if i % 10 in (0, 3)]
    tools.observe(
        ev("session_signal", NOW - 4.0, session_id=s, kind="tool_started", tool="bash")
        for s in tooled
    )
    scorer.tick()
    advisor = scorer._advisor(model)
    assert advisor.tool_outlooks(tooled, NOW).keys() == set(tooled)
    for now in (NOW, NOW + 7.5, NOW + 200.0):
        table = table_path_advice(scorer, advisor, now)
        views = view_path_advice(scorer, advisor, now)
        assert table.keys() == views.keys()
        for session_id, a in views.items():
            b = table[session_id]
            assert (b.retention, b.prefetch, b.queued, b.shared_blocks) == (
                a.retention,
                a.prefetch,
                a.queued,
                a.shared_blocks,
            ), session_id
            assert (b.instance_id, b.block_hashes, b.keep_seconds) == (
                a.instance_id,
                a.block_hashes,
                a.keep_seconds,
            )
            for field in ("p_keep", "p_soon", "p_return", "needed_in_seconds"):
                assert getattr(b, field) == pytest.approx(getattr(a, field), abs=1e-12), field
    # Every kind of session was there to tell apart.
    advice = view_path_advice(scorer, advisor, NOW)
    assert {a.retention for a in advice.values()} >= {"keep", "lru"}
    assert any(a.queued for a in advice.values()) and any(a.prefetch for a in advice.values())
    assert any(a.shared_blocks for a in advice.values())
    assert any(a.needed_in_seconds == 0.0 and not a.queued for a in advice.values())  # a floor
    # The pass recorded exactly that advice for every idle session.
    for session_id, a in advice.items():
        rec = ledger.latest("live", session_id)
        if a.queued:
            assert rec is None
        else:
            assert rec is not None and (rec.retention, rec.prefetch) == (a.retention, a.prefetch)
            assert rec.p_keep == pytest.approx(a.p_keep, abs=1e-12)


def test_the_tables_advice_equals_the_advisors_on_the_memory_store(
    model: LearnedPredictor,
) -> None:
    check_parity(MemoryStore(bytes_per_token=1, block_tokens=512), model)


@pytest.mark.redis
def test_the_tables_advice_equals_the_advisors_on_the_redis_store(
    model: LearnedPredictor, redis_url: str, clean_redis: str
) -> None:
    store = RedisStore.from_url(redis_url, prefix=clean_redis, bytes_per_token=1, block_tokens=512)
    try:
        check_parity(store, model)
    finally:
        store.close()


@pytest.fixture
def memory() -> Iterator[MemoryStore]:
    yield MemoryStore(bytes_per_token=1, block_tokens=512)


def idle_sessions(store: MemoryStore, n: int) -> list[str]:
    ids = [f"s{i}" for i in range(n)]
    for i, sid in enumerate(ids):
        store.apply(turn(sid, NOW - 400.0 - i, NOW - 300.0 - i))
    return ids


def test_a_pass_advises_every_live_session_in_chunks(memory: MemoryStore) -> None:
    ids = idle_sessions(memory, 150)
    memory.apply(turn("busy", NOW - 5.0, None))
    scorer, ledger = scorer_for(memory, Fixed(0.9), chunk_sessions=40, sessions_per_tick=8)
    assert scorer.tick() == 151
    stats = scorer.last_pass
    assert stats is not None
    assert (stats.sessions, stats.advised, stats.chunks) == (151, 151, math.ceil(151 / 40))
    assert ledger.stats("live").predictions == 150  # the queued one predicts nothing
    assert all(ledger.latest("live", s) is not None for s in ids)
    scorer.tick()  # and again every pass, not a page at a time
    assert ledger.stats("live").predictions == 300


class Slow(Fixed):
    """Fixed, taking at least `seconds` a call: a chunk holds the loop at least that long, on any
    machine."""

    def __init__(self, p: float, seconds: float) -> None:
        super().__init__(p)
        self.seconds = seconds

    def p_within(self, sessions: Any, now: float, horizons: Any) -> np.ndarray:
        time.sleep(self.seconds)
        return super().p_within(sessions, now, horizons)


def test_chunks_that_hold_the_loop_past_the_target_are_cut_and_every_session_still_advised(
    memory: MemoryStore,
) -> None:
    ids = idle_sessions(memory, 1000)
    predictor = Slow(0.9, seconds=0.2)  # four times the target at least, each chunk
    scorer, ledger = scorer_for(memory, predictor, chunk_sessions=400, chunk_target_seconds=0.05)
    assert scorer.tick() == 1000
    stats = scorer.last_pass
    assert stats is not None and stats.advised == 1000
    # 400 first, then at most 400 * 0.05 / 0.2 = 100 a chunk (64 at the least): 7 chunks or more,
    # where fixed chunks of 400 would be 3.
    assert stats.chunks >= 1 + math.ceil(600 / 100)
    assert all(ledger.latest("live", s) is not None for s in ids)


def test_fixed_chunks_without_a_target(memory: MemoryStore) -> None:
    idle_sessions(memory, 1000)
    scorer, _ = scorer_for(memory, Slow(0.9, seconds=0.2), chunk_sessions=400)
    scorer.tick()
    assert scorer.last_pass is not None and scorer.last_pass.chunks == 3


@pytest.mark.parametrize(
    ("sessions", "held", "expected"),
    [
        (2048, 0.100, 1024),  # twice the target: half the sessions
        (2048, 0.040, 2048),  # within it: the same
        (1024, 0.010, 2048),  # under half of it: doubled ...
        (2048, 0.010, 2048),  # ... up to the most
        (100, 10.0, 64),  # never below the floor ...
        (40, 10.0, 40),  # ... or the most, when that is smaller
    ],
)
def test_the_next_chunk_follows_what_the_last_one_held(
    sessions: int, held: float, expected: int
) -> None:
    assert next_chunk_sessions(sessions, held, 0.05, 2048 if sessions > 40 else 40) == expected


def test_the_pass_yields_between_chunks_and_rereads_what_changed_meanwhile(
    memory: MemoryStore,
) -> None:
    ids = idle_sessions(memory, 100)
    scorer, ledger = scorer_for(memory, Fixed(0.9), chunk_sessions=25)
    scorer.tick()  # the table is built
    order = scorer.table.session_ids
    steps = scorer.passes()
    while ledger.stats("live").predictions < 100 + 25:
        next(steps)  # a step at a time; the loop may run other work between them
    assert ledger.stats("live").predictions == 100 + 25  # the first chunk is done
    late = order[-1]  # in the last chunk
    back = turn(late, NOW, None)
    memory.apply(back)
    scorer.observe(back)
    for _ in steps:
        pass
    assert scorer.last_pass is not None and scorer.last_pass.chunks == 4
    assert ledger.stats("live").predictions == 100 + 99  # `late` is queued now: not predicted
    assert ledger.latest("live", late) is not None and ledger.latest("live", late).made_ts == NOW
    assert set(ids) == set(order)


def test_many_dirty_rows_are_reread_a_slice_a_step(
    memory: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    import app.decide.scorer as scorer_module

    monkeypatch.setattr(scorer_module, "REFRESH_SESSIONS", 2)
    ids = idle_sessions(memory, 10)
    scorer, ledger = scorer_for(memory, Fixed(0.9))
    scorer.tick()
    for sid in ids[:7]:
        more = turn(sid, NOW - 10.0, NOW - 5.0)
        memory.apply(more)
        scorer.observe(more)
    reads: list[int] = []
    bulk = memory.sessions

    def spy(session_ids: Any, *, resident: bool = True) -> Any:
        assert not resident  # the table never reads residency: the pass skips finding it
        reads.append(len(session_ids))
        return bulk(session_ids, resident=resident)

    monkeypatch.setattr(memory, "sessions", spy)
    steps = 0
    for _ in scorer.passes():
        steps += 1
    # Three slices of two, each a step of its own; the last one with the chunk it precedes (the
    # heuristic model then reads its views: the fifth read).
    assert reads[:4] == [2, 2, 2, 1] and steps == 4
    assert ledger.stats("live").predictions == 20
    assert all(scorer._held[s].block_hashes for s in ids)


def test_ingest_dirtying_rows_faster_than_they_are_read_cannot_hold_the_pass(
    memory: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    import app.decide.scorer as scorer_module

    monkeypatch.setattr(scorer_module, "REFRESH_SESSIONS", 2)
    ids = idle_sessions(memory, 10)
    scorer, ledger = scorer_for(memory, Fixed(0.9))
    scorer.tick()
    steps = scorer.passes()
    for k in range(100):  # between steps, three sessions change: more than a slice reads
        if next(steps, None) is None:
            break
        for sid in ids[(3 * k) % 9 : (3 * k) % 9 + 3]:
            more = turn(sid, NOW - 10.0 + k * 0.01, NOW - 5.0 + k * 0.01)
            memory.apply(more)
            scorer.observe(more)
    assert k < 10, k  # the pass ended
    assert ledger.stats("live").predictions == 20


def test_dirty_rows_are_refreshed_and_closed_sessions_dropped(memory: MemoryStore) -> None:
    idle_sessions(memory, 10)
    scorer, _ = scorer_for(memory, Fixed(0.9), sessions_per_tick=1)
    scorer.tick()
    row = scorer.table.row("s3")
    assert row is not None
    assert scorer.table.advisor_columns([row])[0][0] == 0  # idle
    more = turn("s3", NOW - 10.0, NOW - 5.0, blocks=[7, 8, 9])
    closed = [ev("session_closed", NOW - 1.0, session_id="s4")]
    memory.apply(more + closed)
    scorer.observe(more + closed)
    scorer.tick()
    assert "s4" not in scorer.table and "s4" not in scorer._held
    assert scorer._held["s3"].block_hashes == (7, 8, 9)
    row = scorer.table.row("s3")
    turns = SESSION_FEATURES.index("turns")
    assert row is not None and scorer.table.session_matrix(NOW, np.array([row]))[0, turns] == 2.0
    assert len(scorer.table) == 9


def test_a_change_no_observer_saw_comes_in_with_the_sweep(memory: MemoryStore) -> None:
    idle_sessions(memory, 6)
    scorer, _ = scorer_for(memory, Fixed(0.9), sessions_per_tick=2)
    scorer.tick()
    memory.apply(turn("s2", NOW - 3.0, NOW - 2.0, blocks=[5]))  # never observed
    for _ in range(3):  # three pages of two cover the six sessions
        scorer.tick()
    assert scorer._held["s2"].block_hashes == (5,)


def test_sessions_idle_past_the_horizon_leave_the_table_until_an_event(
    memory: MemoryStore,
) -> None:
    idle_sessions(memory, 3)
    scorer, ledger = scorer_for(memory, Fixed(0.9))
    scorer.tick()
    assert len(scorer.table) == 3
    later = NOW + MAX_IDLE_SECONDS
    scorer.clock.set(later)  # type: ignore[attr-defined]
    scorer.tick()
    assert len(scorer.table) == 0 and scorer.last_pass is not None
    assert scorer.last_pass.advised == 0 and ledger.stats("live").predictions == 3
    back = turn("s1", later, later + 1.0)
    memory.apply(back)
    scorer.observe(back)
    scorer.clock.set(later + 2.0)  # type: ignore[attr-defined]
    scorer.tick()
    assert scorer.table.session_ids == ["s1"]


def test_sessions_the_store_forgets_by_retention_leave_the_table() -> None:
    # The store forgets a session idle past its retention by the newest event's ts, with no
    # event for it: the table must not keep advising it (nor the ledger keep it) for the 30
    # minutes of the planner's horizon.
    retention_seconds = 400.0
    store = MemoryStore(
        bytes_per_token=1, block_tokens=512, session_retention_seconds=retention_seconds
    )
    ids = idle_sessions(store, 3)  # last active NOW-300 .. NOW-302
    fresh = turn("fresh", NOW - 20.0, NOW - 10.0)
    store.apply(fresh)
    scorer, ledger = scorer_for(store, Fixed(0.9), session_retention_seconds=retention_seconds)
    scorer.observe(fresh)
    scorer.tick()  # built from the listing: the store had forgotten none yet (newest NOW-10)
    assert sorted(scorer.table.session_ids) == sorted([*ids, "fresh"])
    later = turn("other", NOW + 100.0, NOW + 105.0)  # moves the store's cutoff past s0..s2
    store.apply(later)
    scorer.observe(later)
    scorer.clock.set(NOW + 106.0)  # type: ignore[attr-defined]
    assert all(store.session(s) is None for s in ids)  # forgotten, no event said so
    scorer.tick()
    assert sorted(scorer.table.session_ids) == ["fresh", "other"]
    assert scorer.last_pass is not None and scorer.last_pass.advised == 2
    before = ledger.stats("live").predictions
    scorer.tick()
    assert ledger.stats("live").predictions - before == 2  # nor is it advised again


def test_only_advice_that_changed_goes_to_the_scheduler(memory: MemoryStore) -> None:
    ids = idle_sessions(memory, 20)
    fixed = Fixed(0.9)
    scorer, _ = scorer_for(memory, fixed)
    scheduler = Scheduler(memory, SchedulerConfig(bytes_per_block=512))
    scorer.scheduler = scheduler
    handed: list[list[str]] = []
    advise = scheduler.advise

    def spy(advice: list[SessionAdvice], now: float) -> None:
        handed.append([a.session_id for a in advice])
        advise(advice, now)

    scheduler.advise = spy  # type: ignore[method-assign]
    scorer.tick()
    assert sorted(handed[-1]) == sorted(ids) and scheduler.tracked_sessions == 20
    scorer.clock.set(NOW + 1.0)  # type: ignore[attr-defined]
    scorer.tick()
    assert len(handed) == 1  # nothing changed: nothing handed
    fixed.per_session["s5"] = 0.05  # s5's chance fell
    scorer.clock.set(NOW + 2.0)  # type: ignore[attr-defined]
    scorer.tick()
    assert handed[-1] == ["s5"]
    latest = {a.session_id: a for a, _ in scheduler.latest_advice()}
    assert latest["s5"].retention == "demote"
    scorer.clock.set(NOW + 2.0 + HANDOFF_REFRESH_SECONDS)  # type: ignore[attr-defined]
    scorer.tick()
    assert sorted(handed[-1]) == sorted(ids)  # refreshed before the scheduler's advice expires


def test_a_view_without_blocks_or_a_closed_listing_is_not_advised(memory: MemoryStore) -> None:
    memory.apply(turn("a", NOW - 50.0, NOW - 40.0))
    memory.apply([ev("session_signal", NOW - 1.0, session_id="only-signal", kind="opened")])
    scorer, ledger = scorer_for(memory, Fixed(0.9))
    scorer.tick()
    assert ledger.latest("live", "a") is not None
    assert ledger.latest("live", "only-signal") is None  # no context to keep
    assert scorer._held["a"].block_hashes == (1, 2)


def test_run_yields_the_event_loop_between_chunks(memory: MemoryStore) -> None:
    import asyncio

    idle_sessions(memory, 50)
    scorer, ledger = scorer_for(memory, Fixed(0.9), chunk_sessions=10)
    seen: list[int] = []

    async def drive() -> None:
        task = asyncio.create_task(scorer.run(0.0))
        # A bound on the loop's turns, not a timing (the pass waits as long as each step held
        # the loop: LOOP_SHARE).
        for _ in range(100_000):
            await asyncio.sleep(0)
            seen.append(ledger.stats("live").predictions)
            if seen[-1] >= 100:
                break
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(drive())
    # This task ran between the chunks of one pass: it saw every chunk's records land.
    assert {10, 20, 30, 40, 50, 60} <= set(seen)


def test_a_pass_paces_itself_only_while_events_come_in(memory: MemoryStore) -> None:
    """After each step `run` waits as long as the step held the loop while ingest is flowing
    (LOOP_SHARE: ingest gets the other half), and only yields on a loop that has had none for
    BUSY_SECONDS, so a quiet service's pass takes its working time, not twice it."""
    from app.decide import scorer as scorer_module

    scorer, _ = scorer_for(memory, Fixed(0.9))
    now = time.monotonic()
    assert scorer.pause_after(0.02, now) == 0.0  # nothing observed yet
    scorer.observe([])
    observed = time.monotonic()
    paced = 0.02 * (1.0 - scorer_module.LOOP_SHARE) / scorer_module.LOOP_SHARE
    assert scorer.pause_after(0.02, observed) == pytest.approx(paced)
    assert scorer.pause_after(0.02, observed + scorer_module.BUSY_SECONDS / 2) == pytest.approx(
        paced
    )
    assert scorer.pause_after(0.02, observed + scorer_module.BUSY_SECONDS + 0.5) == 0.0


def test_what_changes_while_the_first_pass_builds_the_table_is_reread(
    memory: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    import app.decide.scorer as scorer_module

    monkeypatch.setattr(scorer_module, "REBUILD_PAGE_SESSIONS", 2)
    idle_sessions(memory, 6)
    scorer, _ = scorer_for(memory, Fixed(0.9))
    early = turn("s9", NOW - 1.0, None)  # before the first pass: the pass reads it anyway
    memory.apply(early)
    scorer.observe(early)
    steps = scorer.passes()
    next(steps)  # the first page of the listing is read: s9 (the newest), s0
    assert set(scorer._held) == {"s9", "s0"}
    more = turn("s0", NOW - 0.5, NOW - 0.2, blocks=[42])
    memory.apply(more)
    scorer.observe(more)
    for _ in steps:
        pass
    assert scorer._held["s0"].block_hashes == (42,)
    assert len(scorer.table) == 7
