"""The scoring loop: a page of live idle sessions per tick, advised by the live model and the
shadow."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from app.core.clock import ManualClock
from app.core.errors import StoreUnavailable
from app.decide.advisor import MAX_IDLE_SECONDS
from app.decide.scorer import Scorer
from app.observe.ledger import AdviceLedger
from app.predict.slots import ModelSlots, Serving
from app.state import MemoryStore, SessionView
from kvprefetch_client.events import Event, event_adapter

_ids = itertools.count()


class Fixed:
    """P(within h) = a fixed chance per session (default `p`), whatever the horizon."""

    name = "fixed"

    def __init__(self, p: float, per_session: dict[str, float] | None = None) -> None:
        self.p, self.per_session = p, per_session or {}
        self.calls = 0

    def p_within(
        self, sessions: Sequence[SessionView], now: float, horizons: Sequence[float]
    ) -> np.ndarray:
        self.calls += 1
        return np.array(
            [[self.per_session.get(s.session_id, self.p)] * len(horizons) for s in sessions]
        )


class Broken:
    name = "broken"

    def p_within(
        self, sessions: Sequence[SessionView], now: float, horizons: Sequence[float]
    ) -> np.ndarray:
        raise RuntimeError("shadow bug")


def ev(type_: str, ts: float, **fields: object) -> Event:
    return event_adapter.validate_python(
        {"type": type_, "event_id": f"e{next(_ids)}", "ts": ts, **fields}
    )


def turn(session_id: str, routed_ts: float, finished_ts: float | None) -> list[Event]:
    request_id = f"r{next(_ids)}"
    out = [
        ev(
            "request_routed",
            routed_ts,
            session_id=session_id,
            request_id=request_id,
            instance_id="gpu-0",
            prompt_tokens=100,
            block_hashes=[1, 2],
        )
    ]
    if finished_ts is not None:
        out.append(
            ev(
                "request_finished",
                finished_ts,
                session_id=session_id,
                request_id=request_id,
                instance_id="gpu-0",
                output_tokens=10,
            )
        )
    return out


def setup(
    tmp_path: Path,
    live: object,
    shadow: object | None = None,
    per_tick: int = 256,
    now: float = 1000.0,
    store: MemoryStore | None = None,
) -> tuple[MemoryStore, AdviceLedger, Scorer]:
    store = store if store is not None else MemoryStore(bytes_per_token=1, block_tokens=512)
    ledger = AdviceLedger()
    models = ModelSlots(tmp_path / "no-model", ledger=ledger)
    models.serving = Serving(live, "fixed", None)  # type: ignore[arg-type]
    if shadow is not None:
        models.shadow = Serving(shadow, "shadow", "s1")  # type: ignore[arg-type]
        ledger.start("shadow")
    return (
        store,
        ledger,
        Scorer(store, models, ledger, ManualClock(now), sessions_per_tick=per_tick),
    )


def test_a_tick_advises_idle_sessions_with_live_and_shadow(tmp_path: Path) -> None:
    store, ledger, scorer = setup(tmp_path, Fixed(0.9, {"b": 0.05}), shadow=Fixed(0.05))
    store.apply([*turn("a", 900.0, 910.0), *turn("b", 900.0, 920.0), *turn("busy", 990.0, None)])
    assert scorer.tick() == 3  # read three, advised the two idle ones
    assert (ledger.latest("live", "a").retention, ledger.latest("live", "a").prefetch) == (
        "keep",
        True,
    )
    assert ledger.latest("live", "b").retention == "demote"
    assert ledger.latest("live", "busy") is None
    assert ledger.latest("shadow", "a").retention == "demote"
    assert ledger.latest("live", "a").made_ts == 1000.0
    # Their next requests are scored per model.
    ledger.observe(turn("a", 1010.0, None) + turn("b", 1010.0, None))
    live, shadow = ledger.stats("live"), ledger.stats("shadow")
    assert (live.predictions, live.keep_predictions, live.hits, live.misses) == (2, 1, 1, 1)
    assert (shadow.predictions, shadow.keep_predictions, shadow.hits, shadow.misses) == (2, 0, 0, 2)


def test_ticks_page_through_the_live_sessions_and_start_over(tmp_path: Path) -> None:
    store, ledger, scorer = setup(tmp_path, Fixed(0.9), per_tick=2)
    for i in range(5):
        store.apply(turn(f"s{i}", 900.0 + i, 950.0 + i))
    assert [scorer.tick() for _ in range(4)] == [2, 2, 1, 2]
    assert ledger.stats("live").predictions == 7
    assert [ledger.latest("live", f"s{i}") is not None for i in range(5)] == [True] * 5


def test_sessions_idle_past_the_planners_horizon_are_not_read(tmp_path: Path) -> None:
    store, ledger, scorer = setup(tmp_path, Fixed(0.9), now=5000.0)
    store.apply(
        turn("old", 100.0, 5000.0 - MAX_IDLE_SECONDS - 1.0) + turn("recent", 4000.0, 4100.0)
    )
    assert scorer.tick() == 1
    assert ledger.latest("live", "old") is None and ledger.latest("live", "recent") is not None


def test_a_broken_shadow_does_not_stop_live_scoring(tmp_path: Path) -> None:
    store, ledger, scorer = setup(tmp_path, Fixed(0.9), shadow=Broken())
    store.apply(turn("a", 900.0, 910.0))
    assert scorer.tick() == 1
    assert ledger.stats("live").predictions == 1 and ledger.stats("shadow").predictions == 0


def test_an_empty_store_scores_nothing(tmp_path: Path) -> None:
    live = Fixed(0.9)
    _, ledger, scorer = setup(tmp_path, live)
    assert scorer.tick() == 0
    assert live.calls == 0 and ledger.stats("live").predictions == 0


def test_run_ticks_until_cancelled(tmp_path: Path) -> None:
    store, ledger, scorer = setup(tmp_path, Fixed(0.9))
    store.apply(turn("a", 900.0, 910.0))

    async def drive() -> None:
        task = asyncio.create_task(scorer.run(0.0))
        for _ in range(100):  # each tick waits one turn of the loop: a bound, not a timing
            await asyncio.sleep(0)
            if ledger.stats("live").predictions >= 2:
                break
        assert ledger.stats("live").predictions >= 2
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()

    asyncio.run(drive())


class BlipsOnce(MemoryStore):
    """A store whose first listing fails, as Redis does when it blips."""

    blipped = False

    def live_sessions(self, *args, **kw):  # type: ignore[no-untyped-def]
        if not self.blipped:
            self.blipped = True
            raise StoreUnavailable("blip")
        return super().live_sessions(*args, **kw)


def test_a_store_blip_skips_a_tick_and_scoring_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, ledger, scorer = setup(
        tmp_path, Fixed(0.9), store=BlipsOnce(bytes_per_token=1, block_tokens=512)
    )
    store.apply(turn("a", 900.0, 910.0))

    async def drive() -> None:
        task = asyncio.create_task(scorer.run(0.0))
        for _ in range(100):
            await asyncio.sleep(0)
            if ledger.stats("live").predictions >= 1:
                break
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(drive())
    assert ledger.stats("live").predictions >= 1
    assert "scoring tick skipped: blip" in caplog.text


def test_a_finished_session_is_advised_at_the_next_tick_ahead_of_the_page(tmp_path: Path) -> None:
    store, ledger, scorer = setup(tmp_path, Fixed(0.9), per_tick=1)
    early, late = turn("early", 100.0, 200.0), turn("late", 300.0, 400.0)
    store.apply([*early, *late])
    scorer.observe(early)  # its finish: advised next tick, though the page starts at the newest
    assert scorer.tick() == 2
    assert ledger.latest("live", "early") is not None and ledger.latest("live", "late") is not None
    assert scorer.tick() == 1  # no finish waiting: the page alone


def test_a_signalled_session_is_advised_at_the_next_tick_ahead_of_the_page(
    tmp_path: Path,
) -> None:
    store, ledger, scorer = setup(tmp_path, Fixed(0.9), per_tick=1)
    store.apply([*turn("early", 100.0, 200.0), *turn("late", 300.0, 400.0)])
    signal = [ev("session_signal", 500.0, session_id="early", kind="typing")]
    store.apply(signal)
    scorer.observe(signal)  # news about its next request: advised next tick
    assert scorer.tick() == 2
    assert ledger.latest("live", "early") is not None
    assert scorer.tick() == 1  # nothing waiting: the page alone


@pytest.mark.parametrize("every_live", [False, True])
def test_a_guard_fallback_withdraws_the_instances_pins_once(
    tmp_path: Path, every_live: bool
) -> None:
    from app.decide.guard import GuardConfig, InstanceVerdict, LruGuard
    from app.decide.scheduler import Scheduler, SchedulerConfig

    store = MemoryStore(bytes_per_token=1, block_tokens=512)
    store.apply(turn("a", 900.0, 910.0))
    store.apply(
        [ev("kv_blocks_stored", 911.0, tier="hbm", instance_id="gpu-0", block_hashes=[1, 2])]
    )
    ledger = AdviceLedger()
    models = ModelSlots(tmp_path / "no-model", ledger=ledger)
    models.serving = Serving(Fixed(0.9), "fixed", None)  # type: ignore[arg-type]
    scheduler = Scheduler(store, SchedulerConfig(bytes_per_block=512))
    guard = LruGuard(GuardConfig(bytes_per_block=512))
    guard.verdicts["gpu-0"] = InstanceVerdict()
    clock = ManualClock(1000.0)
    scorer = Scorer(
        store, models, ledger, clock, scheduler=scheduler, guard=guard, every_live=every_live
    )
    scorer.tick()
    [pin] = scheduler.plan(1000.0).orders
    assert pin.kind == "pin"
    scheduler.on_progress(pin.order_id, "completed")
    # The advice lost there: the next tick notices and the next plan cancels the pin.
    guard.verdicts["gpu-0"] = InstanceVerdict(state="lru", since_ts=1001.0, retry_seconds=600.0)
    guard.verdicts["gpu-0"].fallbacks = 1
    clock.set(1002.0)
    scorer.tick()
    plan = scheduler.plan(1002.0)
    assert [c.order_id for c in plan.cancels] == [pin.order_id] and plan.orders == []
    clock.set(1003.0)
    scorer.tick()
    assert scheduler.plan(1003.0).cancels == []  # once per fallback


def test_a_demote_suspension_withdraws_the_instances_demotes_once_until_they_are_tried_again(
    tmp_path: Path,
) -> None:
    from app.decide.guard import DemoteVerdict, GuardConfig, LruGuard
    from app.decide.scheduler import Scheduler, SchedulerConfig

    store = MemoryStore(bytes_per_token=1, block_tokens=512)
    store.apply(turn("a", 900.0, 910.0))
    store.apply(
        [ev("kv_blocks_stored", 911.0, tier="hbm", instance_id="gpu-0", block_hashes=[1, 2])]
    )
    ledger = AdviceLedger()
    models = ModelSlots(tmp_path / "no-model", ledger=ledger)
    models.serving = Serving(Fixed(0.0), "fixed", None)  # type: ignore[arg-type]
    scheduler = Scheduler(store, SchedulerConfig(bytes_per_block=512))
    guard = LruGuard(GuardConfig(bytes_per_block=512))
    clock = ManualClock(1000.0)
    scorer = Scorer(store, models, ledger, clock, scheduler=scheduler, guard=guard)
    scorer.tick()
    [demote] = scheduler.plan(1000.0).orders
    assert demote.kind == "demote"
    scheduler.on_progress(demote.order_id, "completed")
    # The demotes cost more than their room kept there: the next tick withdraws them, once.
    guard.demotes["gpu-0"] = DemoteVerdict(state="lru", since_ts=1001.0, retry_seconds=600.0)
    guard.demotes["gpu-0"].suspensions = 1
    clock.set(1002.0)
    scorer.tick()
    plan = scheduler.plan(1002.0)
    assert [c.order_id for c in plan.cancels] == [demote.order_id] and plan.orders == []
    clock.set(1003.0)
    scorer.tick()
    again = scheduler.plan(1003.0)
    assert again.cancels == [] and again.orders == []  # once; and no demote meanwhile
    # Tried again after the wait: demoted once more.
    clock.set(1002.0 + 600.0)
    scorer.tick()
    assert [o.kind for o in scheduler.plan(1602.0).orders] == ["demote"]
