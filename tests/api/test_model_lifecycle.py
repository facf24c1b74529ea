"""The model lifecycle as data: promote and rollback, every change in the event log, the serving
choice kept across a restart, counts kept per version; and a manual shadow judged beside the
serving model (Brier, cost, disagreements) in /v1/model, /metrics and the dashboard."""

from __future__ import annotations

import asyncio
import math
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.bundle import DEFAULT_MODEL_DIR, model_identity
from app.core.clock import ManualClock
from app.core.config import Settings
from app.decide.advisor import Advisor
from app.engine import Engine
from app.ingest.eventlog import read_events
from app.predict.predictors import HeuristicPredictor, LearnedPredictor
from kvprefetch_client.events import ModelChanged
from tests.api.conftest import routed, settle
from tests.api.test_model import session_with_turns


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """The test's directory is the models root, holding a copy of the bundled model (v2)."""
    shutil.copytree(DEFAULT_MODEL_DIR, tmp_path / "v2")
    return Settings(data_dir=tmp_path / "data", log_fsync=False, models_root=tmp_path)


def model_changes(settings: Settings) -> list[ModelChanged]:
    return [e for e in read_events([settings.event_log_dir]) if isinstance(e, ModelChanged)]


def test_promote_moves_the_shadow_to_serving_and_empties_the_slot(settings: Settings) -> None:
    with TestClient(create_app(settings)) as c:
        r = c.post("/v1/model/promote")
        assert (r.status_code, r.json()["field"]) == (409, "shadow")  # no shadow yet
        assert c.put("/v1/model/shadow", json={"model_dir": "v2"}).status_code == 200
        r = c.post("/v1/model/promote")
        assert (r.status_code, r.json()) == (200, {"predictor": "learned (v2)", "version": "v2"})
        model = c.get("/v1/model").json()
        assert (model["version"], model["shadow"], model["comparison"]) == ("v2", None, None)
        assert c.get("/readyz").json()["shadow"] is None
        assert c.post("/v1/model/promote").status_code == 409  # the slot is empty now
        # Rollback: what served before the promote serves again, once.
        r = c.post("/v1/model/rollback")
        assert (r.status_code, r.json()["version"]) == (200, "default")
        assert c.get("/v1/model").json()["version"] == "default"
        r = c.post("/v1/model/rollback")
        assert (r.status_code, r.json()["field"]) == (409, "serving")


def test_every_model_change_is_an_event_in_the_log(settings: Settings) -> None:
    with TestClient(create_app(settings)) as c:
        assert c.put("/v1/model/shadow", json={"model_dir": "v2"}).status_code == 200
        assert c.post("/v1/model/promote").status_code == 200
        assert c.post("/v1/model/rollback").status_code == 200
        assert c.put("/v1/model/shadow", json={"model_dir": "v2"}).status_code == 200
        assert c.delete("/v1/model/shadow").status_code == 204
        # Posted, a model change is refused: the log's lineage is the service's own word.
        forged = ModelChanged(event_id="forged", ts=1.0, slot="serving", action="promoted")
        r = c.post("/v1/events", json={"events": [forged.model_dump()]})
        assert (r.status_code, r.json()["field"]) == (422, "events[0].type")
    changes = model_changes(settings)
    assert [(e.slot, e.action, e.version, e.model_dir) for e in changes] == [
        ("shadow", "loaded", "v2", "v2"),
        ("serving", "promoted", "v2", "v2"),
        ("shadow", "cleared", None, None),
        ("serving", "rolled_back", "default", "default"),
        ("shadow", "loaded", "v2", "v2"),
        ("shadow", "cleared", None, None),
    ]
    identity = model_identity(settings.models_root_dir / "v2")
    promoted = changes[1]
    assert (promoted.card_sha256, promoted.model_sha256) == (
        identity["card_sha256"],
        identity["model_sha256"],
    )
    assert promoted.model_sha256 is not None
    assert [e.ts for e in changes] == sorted(e.ts for e in changes)
    assert "forged" not in {e.event_id for e in changes}


def test_a_promoted_model_serves_again_after_a_restart(settings: Settings) -> None:
    async def run() -> None:
        engine = Engine(settings)
        await engine.lifecycle.set_shadow(settings.models_root_dir / "v2", [], None)
        await engine.lifecycle.promote()
        await engine.close()
        again = Engine(settings)
        assert (again.models.serving.version, again.models.shadow) == ("v2", None)
        await again.close()
        # An operator who changed KVP_MODEL_DIR since means the new one.
        shutil.copytree(DEFAULT_MODEL_DIR, settings.models_root_dir / "v3")
        changed = settings.model_copy(update={"model_dir": settings.models_root_dir / "v3"})
        third = Engine(changed)
        assert third.models.serving.version == "v3"
        await third.close()

    asyncio.run(run())


def test_a_rollback_is_kept_across_a_restart_too(settings: Settings) -> None:
    async def run() -> None:
        engine = Engine(settings)
        await engine.lifecycle.reload(settings.models_root_dir / "v2", [], None)
        await engine.lifecycle.rollback()
        await engine.close()
        again = Engine(settings)
        assert again.models.serving.version == "default"
        await again.close()

    asyncio.run(run())


def test_a_manual_shadow_is_judged_beside_the_serving_model(tmp_path: Path) -> None:
    # The heuristic serves (no model), the bundled model shadows: two models that disagree.
    clock = ManualClock(0.0)
    settings = Settings(
        data_dir=tmp_path / "data",
        log_fsync=False,
        score_interval_seconds=0,
        model_dir=tmp_path / "none",
        shadow_model_dir=DEFAULT_MODEL_DIR,
        models_root=DEFAULT_MODEL_DIR.parent,
        dashboard_show_session_ids=True,
    )
    with TestClient(create_app(settings, clock=clock)) as c:
        clock.set(900.0)
        session_with_turns(c, "a", 3, start_ts=740.0)
        session_with_turns(c, "b", 1, start_ts=300.0)
        settle(c)
        engine = c.app.state.engine  # type: ignore[attr-defined]
        assert engine.scorer.tick() == 2
        views = [engine.store.session("a"), engine.store.session("b")]
        live = Advisor(HeuristicPredictor()).advise(views, 900.0)
        shadow = Advisor(LearnedPredictor(DEFAULT_MODEL_DIR)).advise(views, 900.0)
        differ = [
            x.session_id
            for x, y in zip(live, shadow)
            if (x.retention, x.prefetch) != (y.retention, y.prefetch)
        ]
        assert differ, "the setup: the two models disagree on some session"
        # Both come back within the keep horizon; a later event moves event time past it.
        back = [routed("a-back", "a", 950.0), routed("b-back", "b", 960.0)]
        assert c.post("/v1/events", json={"events": back}).status_code == 200
        later = 900.0 + settings.keep_horizon_seconds + 1.0
        clock.set(later)
        assert c.post("/v1/events", json={"events": [routed("z", "z", later)]}).status_code == 200

        def brier(advice: list) -> float:  # type: ignore[type-arg]
            return sum((1.0 - a.p_keep) ** 2 for a in advice) / len(advice)

        model = c.get("/v1/model").json()
        compared = model["comparison"]
        assert compared["judged"] == 2
        assert compared["live_brier"] == pytest.approx(brier(live))
        assert compared["shadow_brier"] == pytest.approx(brier(shadow))
        assert (compared["paired"], compared["disagreed"]) == (2, len(differ))
        # The cost of each model's advice, side by side.
        per_block = engine.cluster.bytes_per_block
        for slot, advice in (("live", live), ("shadow", shadow)):
            kept = sum(len(a.block_hashes) for a in advice if a.retention == "keep")
            assert model[slot]["keep_advice_bytes"] == per_block * kept, slot

        text = c.get("/metrics").text
        scores = {
            line.split('slot="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("kvprefetch_retrain_brier_score{")
        }
        assert not math.isnan(scores["shadow"])
        assert scores["shadow"] == pytest.approx(brier(shadow))
        assert scores["live"] == pytest.approx(brier(live))
        assert "kvprefetch_retrain_judged_outcomes 2.0" in text
        for slot, advice in (("live", live), ("shadow", shadow)):
            kept = sum(len(a.block_hashes) for a in advice if a.retention == "keep")
            line = f'kvprefetch_advice_bytes_total{{advice="keep",slot="{slot}"}} '
            [value] = [float(x[len(line) :]) for x in text.splitlines() if x.startswith(line)]
            assert value == per_block * kept, slot

        now = c.get("/v1/dashboard/now").json()
        dash = now["models"]["comparison"]
        assert (dash["judged"], dash["disagreed"]) == (2, len(differ))
        assert sorted(d["session_id"] for d in dash["disagreements"]) == sorted(differ)
        first = dash["disagreements"][0]
        by_id = {a.session_id: a for a in live}
        assert first["live"]["retention"] == by_id[first["session_id"]].retention
        assert first["context_bytes"] == per_block * len(by_id[first["session_id"]].block_hashes)
        # Bounded by `limit`, as top_sessions.
        assert (
            len(c.get("/v1/dashboard/now?limit=1").json()["models"]["comparison"]["disagreements"])
            == 1
        )


def test_the_disagreements_hide_session_ids_as_top_sessions_do(settings: Settings) -> None:
    settings = settings.model_copy(
        update={"shadow_model_dir": settings.models_root_dir / "v2", "score_interval_seconds": 0}
    )
    clock = ManualClock(900.0)
    with TestClient(create_app(settings, clock=clock)) as c:
        engine = c.app.state.engine  # type: ignore[attr-defined]
        engine.ledger.record_columns("live", ["s"], ["keep"], [False], [0.9], 1.0, [2])
        engine.ledger.record_columns("shadow", ["s"], ["lru"], [False], [0.1], 1.0, [2])
        dash = c.get("/v1/dashboard/now").json()["models"]["comparison"]
        assert [d["session_id"] for d in dash["disagreements"]] == [None]
        assert dash["disagreements"][0]["shadow"]["retention"] == "lru"


def test_counts_are_kept_per_model_version_and_go_with_a_promoted_shadow(
    settings: Settings,
) -> None:
    with TestClient(create_app(settings.model_copy(update={"score_interval_seconds": 0}))) as c:
        engine = c.app.state.engine  # type: ignore[attr-defined]
        ledger = engine.ledger
        # Each recorded pass synced to the metrics, as the scoring loop's timing hook does.
        ledger.record_columns("live", ["s"], ["keep"], [False], [0.9], 1.0, [2])
        engine.metrics.sync()
        assert c.put("/v1/model/shadow", json={"model_dir": "v2"}).status_code == 200
        ledger.record_columns("live", ["s", "t"], ["keep", "lru"], [False, False], [0.9, 0.1], 2.0)
        ledger.record_columns(
            "shadow", ["s", "t"], ["keep", "keep"], [False, True], [0.8, 0.7], 2.0
        )
        engine.metrics.sync()
        assert c.post("/v1/model/promote").status_code == 200
        model = c.get("/v1/model").json()
        # The promoted model serves with what it counted as the shadow.
        assert (model["live"]["predictions"], model["live"]["prefetch_predictions"]) == (2, 1)
        # And the model it replaced keeps its counts under its version.
        assert model["by_version"]["default"]["predictions"] == 3
        assert model["by_version"]["v2"]["predictions"] == 2
        text = c.get("/metrics").text
        # The promoted shadow's records are not counted again under the live slot.
        assert 'kvprefetch_predictions_total{slot="live"} 3.0' in text
        assert 'kvprefetch_predictions_total{slot="shadow"} 2.0' in text


def test_the_documented_join_names_the_model_that_served_each_request(
    settings: Settings, tmp_path: Path
) -> None:
    """The pandas join in docs/operators/model-lifecycle.md, run as written on a real log."""
    import pandas as pd

    from training.compact import compact_log

    clock = ManualClock(1000.0)
    with TestClient(create_app(settings, clock=clock)) as c:

        def request(event_id: str, ts: float) -> None:
            clock.set(ts)
            assert (
                c.post("/v1/events", json={"events": [routed(event_id, ts=ts)]}).status_code == 200
            )

        request("before", 1001.0)
        clock.set(1010.0)
        assert c.put("/v1/model/shadow", json={"model_dir": "v2"}).status_code == 200
        clock.set(1020.0)
        assert c.post("/v1/model/promote").status_code == 200
        request("promoted", 1030.0)
        clock.set(1040.0)
        assert c.post("/v1/model/rollback").status_code == 200
        request("rolled-back", 1050.0)
    parquet = tmp_path / "events.parquet"
    compact_log([settings.event_log_dir], parquet)
    doc = (Path(__file__).parents[2] / "docs/operators/model-lifecycle.md").read_text()
    code = doc.split("## The lifecycle as data", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict[str, object] = {}
    exec(code.replace('"events.parquet"', repr(str(parquet))), scope)
    served_by = scope["served_by"]
    versions = dict(zip(served_by.request_id, served_by.version))  # type: ignore[attr-defined]
    v2 = model_identity(settings.models_root_dir / "v2")["model_sha256"]
    shas = dict(zip(served_by.request_id, served_by.model_sha256))  # type: ignore[attr-defined]
    # Before the first record: the model the service started with (no record names it).
    assert pd.isna(versions["r-before"])
    assert (versions["r-promoted"], shas["r-promoted"]) == ("v2", v2)
    assert versions["r-rolled-back"] == "default"
