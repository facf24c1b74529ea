"""Retraining on a schedule (app/predict/retrain.py), with its real parts: the engine ingesting a
piece of the conversation trace under a simulated clock into its own event log, a real training
child process on that log, the shadow judged by the paired Brier score, and the verdict.

The keep horizon is 60 s here (the judge's horizon follows it): the piece of trace spans under
ten minutes, and a 300 s horizon would leave few outcomes judged in it.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from app.core.clock import ManualClock
from app.core.config import Settings
from app.core.errors import ConfigError
from app.engine import Engine
from app.ingest.eventlog import read_events
from app.predict.retrain import RETRAINED_DIR
from kvprefetch_client.events import Event
from sim.commands import events_from_trace
from tests.conftest import trace_slice
from training import build_dataset, save_model, train

HORIZON_SECONDS = 60.0
TICK_SECONDS = 5.0  # event time between scoring ticks


@pytest.fixture(scope="module")
def trace_events(tmp_path_factory: pytest.TempPathFactory) -> list[Event]:
    folder = tmp_path_factory.mktemp("retrain-log")
    log = folder / "conversation1500.events.jsonl"
    events_from_trace(
        trace_slice(folder, "conversation_first60", 1500), log, "default", "sticky", "none", None
    )
    return sorted(read_events([log]), key=lambda e: e.ts)


@pytest.fixture(scope="module")
def good_model(tmp_path_factory: pytest.TempPathFactory, trace_events: list[Event]) -> Path:
    """A model trained on the whole piece, the judged part included: hard to beat there."""
    folder = tmp_path_factory.mktemp("good-model")
    log = folder / "all.events.jsonl"
    log.write_bytes(b"".join(e.__pydantic_serializer__.to_json(e) + b"\n" for e in trace_events))
    return save_model(train(build_dataset([log]), num_boost_round=50), folder / "good")


def build(tmp_path: Path, serving: Path | None = None, **kw: Any) -> tuple[Engine, ManualClock]:
    models = tmp_path / "models"
    models.mkdir(exist_ok=True)
    if serving is not None:
        (models / "good").symlink_to(serving)
    settings = Settings(
        data_dir=tmp_path / "data",
        log_fsync=False,
        replica_id="test-retrain",
        score_interval_seconds=0,
        plan_interval_seconds=0,
        dashboard_sample_seconds=0,
        model_dir=models / ("good" if serving is not None else "none"),
        models_root=models,
        keep_horizon_seconds=HORIZON_SECONDS,
        **{
            "retrain_every_seconds": 3600.0,
            "retrain_min_arrivals": 10,
            "retrain_min_judged": 200,
            "retrain_max_rounds": 20,
            **kw,
        },
    )
    clock = ManualClock(0.0)
    return Engine(settings, clock=clock, load_model=serving is not None), clock


async def replay(
    engine: Engine, clock: ManualClock, events: list[Event], train_at: float
) -> list[str | None]:
    """Ingest `events` in event-time order (the clock following them), score every TICK_SECONDS,
    start a run at `train_at` of the span; a last step at the end. The steps' outcomes."""
    start, end = events[0].ts, events[-1].ts
    cut = start + train_at * (end - start)
    outcomes: list[str | None] = []
    batch: list[Event] = []
    next_tick, trained = start, False
    for e in events:
        if e.ts >= next_tick or (not trained and e.ts >= cut):
            if batch:
                engine.ingest(batch)
                batch = []
            clock.set(e.ts)
            engine.score_tick()
            next_tick = e.ts + TICK_SECONDS
            if not trained and e.ts >= cut:
                outcomes.append(await engine.retrain_step(force=True))
                trained = True
        batch.append(e)
    engine.ingest(batch)
    clock.set(end)
    outcomes.append(await engine.retrain_step())
    return outcomes


def candidates(tmp_path: Path) -> list[str]:
    folder = tmp_path / "models" / RETRAINED_DIR
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_a_candidate_better_than_the_serving_heuristic_is_promoted(
    tmp_path: Path, trace_events: list[Event]
) -> None:
    async def run() -> None:
        engine, clock = build(tmp_path)
        assert engine.models.serving.version is None  # the heuristic serves
        outcomes = await replay(engine, clock, trace_events, train_at=0.4)
        # The run trained and shadowed (no outcome yet), then the verdict.
        assert outcomes == [None, "promoted"], engine.retrainer.status()
        last = engine.retrainer.last
        assert last is not None and last.version is not None
        assert last.judged >= 200
        assert last.shadow_brier is not None and last.live_brier is not None
        assert last.shadow_brier < last.live_brier
        # It serves now, from the versioned directory it was written to; no shadow is left.
        assert engine.models.serving.version == last.version
        assert engine.models.shadow is None
        assert candidates(tmp_path) == [last.version]
        card = json.loads(
            (tmp_path / "models" / RETRAINED_DIR / last.version / "card.json").read_text()
        )
        assert card["name"] == last.version
        # Trained on the log written before the run: the events up to the cut, split by time.
        assert card["data"]["valid_fraction"] == 0.2
        text = engine.metrics.exposition().decode()
        assert 'kvprefetch_retrain_runs_total{outcome="promoted"} 1.0' in text
        assert f"kvprefetch_retrain_judged_outcomes {float(last.judged)}" in text
        assert f'kvprefetch_retrain_brier_score{{slot="shadow"}} {last.shadow_brier}' in text
        await engine.close()

    asyncio.run(run())


def test_a_candidate_worse_than_the_serving_model_is_discarded(
    tmp_path: Path, trace_events: list[Event], good_model: Path
) -> None:
    async def run() -> None:
        # One boosting round: little more than the base rate, against a model that saw it all.
        engine, clock = build(tmp_path, good_model, retrain_max_rounds=1)
        assert engine.models.serving.version == "good"
        outcomes = await replay(engine, clock, trace_events, train_at=0.4)
        assert outcomes == [None, "discarded"], engine.retrainer.status()
        last = engine.retrainer.last
        assert last is not None
        assert last.shadow_brier is not None and last.live_brier is not None
        assert last.shadow_brier > last.live_brier
        assert engine.models.serving.version == "good"
        assert engine.models.shadow is None
        assert candidates(tmp_path) == []  # a discarded candidate's files are removed
        assert engine.retrainer.runs["discarded"] == 1
        await engine.close()

    asyncio.run(run())


def test_a_failing_training_run_is_counted_failed_and_the_service_serves_on(
    tmp_path: Path, trace_events: list[Event]
) -> None:
    async def run() -> None:
        engine, clock = build(tmp_path)
        # Requests routed but none finished: the log holds nothing to learn from.
        routed = [e for e in trace_events if e.type == "request_routed"][:100]
        clock.set(routed[-1].ts)
        engine.ingest(routed)
        serving = engine.models.serving
        assert await engine.retrain_step(force=True) == "failed"
        last = engine.retrainer.last
        assert last is not None and "training exited with 1" in last.reason
        assert "no finished request" in last.reason
        assert engine.models.serving is serving
        assert engine.models.shadow is None
        assert candidates(tmp_path) == []
        assert engine.retrainer.state == "waiting"
        text = engine.metrics.exposition().decode()
        assert 'kvprefetch_retrain_runs_total{outcome="failed"} 1.0' in text
        await engine.close()

    asyncio.run(run())


def test_a_training_run_past_its_timeout_is_killed_and_counted_failed(
    tmp_path: Path, trace_events: list[Event]
) -> None:
    async def run() -> None:
        engine, clock = build(tmp_path, retrain_timeout_seconds=0.001)
        routed = [e for e in trace_events if e.type == "request_routed"][:100]
        clock.set(routed[-1].ts)
        engine.ingest(routed)
        assert await engine.retrain_step(force=True) == "failed"
        assert engine.retrainer.last is not None
        assert "KVP_RETRAIN_TIMEOUT_SECONDS" in engine.retrainer.last.reason
        assert engine.models.shadow is None and candidates(tmp_path) == []
        await engine.close()

    asyncio.run(run())


def test_a_candidate_whose_shadow_an_operator_removed_is_discarded(
    tmp_path: Path, trace_events: list[Event]
) -> None:
    async def run() -> None:
        engine, clock = build(tmp_path)
        first = trace_events[: len(trace_events) // 3]
        clock.set(first[-1].ts)
        engine.ingest(first)
        assert await engine.retrain_step(force=True) is None
        status = engine.retrainer.status()
        assert status["state"] == "shadowing"
        version = status["candidate"]["version"]
        assert engine.models.shadow is not None and engine.models.shadow.version == version
        assert candidates(tmp_path) == [version]
        engine.models.clear_shadow()  # DELETE /v1/model/shadow
        assert await engine.retrain_step() == "discarded"
        assert engine.retrainer.last is not None
        assert "an operator replaced or removed the shadow" in engine.retrainer.last.reason
        assert candidates(tmp_path) == []
        await engine.close()

    asyncio.run(run())


def test_a_run_with_too_little_new_traffic_or_an_operators_shadow_is_skipped(
    tmp_path: Path, trace_events: list[Event], good_model: Path
) -> None:
    async def run() -> None:
        engine, clock = build(tmp_path, good_model, retrain_min_arrivals=1000)
        routed = [e for e in trace_events if e.type == "request_routed"][:100]
        clock.set(routed[-1].ts)
        engine.ingest(routed)
        assert await engine.retrain_step(force=True) == "skipped"
        assert engine.retrainer.last is not None
        assert "fewer than KVP_RETRAIN_MIN_ARRIVALS" in engine.retrainer.last.reason
        engine.models.set_shadow(tmp_path / "models" / "good")
        engine.retrainer.settings = engine.settings.model_copy(update={"retrain_min_arrivals": 0})
        assert await engine.retrain_step(force=True) == "skipped"
        assert engine.retrainer.last is not None
        assert "a shadow model is set" in engine.retrainer.last.reason
        assert engine.models.shadow is not None and engine.models.shadow.version == "good"
        assert engine.retrainer.runs["skipped"] == 2
        assert candidates(tmp_path) == []
        await engine.close()

    asyncio.run(run())


def test_the_schedule_follows_the_engines_clock(tmp_path: Path) -> None:
    async def run() -> None:
        engine, clock = build(tmp_path, retrain_min_arrivals=1)
        assert await engine.retrain_step() is None  # the first step sets the schedule
        assert engine.retrainer.next_run_ts == 3600.0
        clock.set(3599.0)
        assert await engine.retrain_step() is None
        clock.set(3600.0)
        assert await engine.retrain_step() == "skipped"  # due; no arrival since start
        assert engine.retrainer.next_run_ts == 7200.0
        # Run by the service, the schedule is one of the engine's loops, stopped with it.
        await engine.start()
        task = engine.retrain_task
        assert task is not None and not task.done()
        await engine.close()
        assert task.cancelled()

    asyncio.run(run())


def test_retraining_is_off_by_default(tmp_path: Path) -> None:
    async def run() -> None:
        assert Settings().retrain_every_seconds == 0
        engine = Engine(
            Settings(data_dir=tmp_path, log_fsync=False, model_dir=tmp_path / "none"),
            clock=ManualClock(0.0),
            load_model=False,
        )
        assert not engine.retrainer.enabled
        assert engine.retrainer.status()["state"] == "off"
        await engine.start()
        assert engine.retrain_task is None
        engine.clock.set(10**6)  # type: ignore[attr-defined]
        assert await engine.retrain_step() is None
        assert engine.retrainer.runs == dict.fromkeys(engine.retrainer.runs, 0)
        await engine.close()

    asyncio.run(run())


def test_retraining_without_the_training_extra_is_refused_at_startup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As a base install: no pandas (None in sys.modules: it cannot be found or imported).
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ConfigError, match=r"KVP_RETRAIN_EVERY_SECONDS.*kvprefetch\[training\]"):
        build(tmp_path)
    # Retraining off: the service starts without the extra.
    engine, _ = build(tmp_path, retrain_every_seconds=0.0)
    asyncio.run(engine.close())
