"""The serving model and its shadow: the bundled one at startup, the heuristic without it, swaps
checked on live sessions first, and each model's hit rate from the scoring loop."""

from __future__ import annotations

import functools
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.bundle import DEFAULT_MODEL_DIR
from app.core.clock import ManualClock
from app.core.config import Settings
from app.decide.advisor import Advisor
from app.predict.features import FEATURES
from app.predict.predictors import HeuristicPredictor, LearnedPredictor
from tests.api.conftest import routed, settle

NO_SCORES = {
    "predictions": 0,
    "keep_predictions": 0,
    "hits": 0,
    "misses": 0,
    "unscored": 0,
    "hit_rate": None,
    "prefetch_predictions": 0,
    "keep_advice_bytes": 0,
    "prefetch_advice_bytes": 0,
}


def turns_model(model_dir: Path) -> Path:
    """A model that answers 0.5 for sessions of at most 2 turns and 5.0 (not a probability) past
    that: it passes the probe session (2 turns) and fails on a live session with more turns."""
    import lightgbm as lgb

    x = np.zeros((40, len(FEATURES)))
    x[:, FEATURES.index("turns")] = np.arange(40) % 5 + 1
    y = np.where(x[:, FEATURES.index("turns")] <= 2, 0.5, 5.0)
    params = {
        "objective": "regression",
        "num_leaves": 2,
        "min_data_in_leaf": 1,
        "learning_rate": 1.0,
        "seed": 0,
        "deterministic": True,
        "num_threads": 1,
        "verbose": -1,
    }
    booster = lgb.train(params, lgb.Dataset(x, y, feature_name=list(FEATURES)), num_boost_round=1)
    model_dir.mkdir()
    booster.save_model(str(model_dir / "model.txt"))
    return model_dir


def session_with_turns(
    client: TestClient, session_id: str, turns: int, start_ts: float = 100.0
) -> None:
    events = []
    for i in range(turns):
        ts = start_ts + 60.0 * i
        events.append(routed(f"{session_id}-{i}", session_id, ts, block_hashes=[1, 2]))
        events.append(
            {
                "type": "request_finished",
                "event_id": f"{session_id}-{i}-f",
                "ts": ts + 5.0,
                "session_id": session_id,
                "request_id": f"r-{session_id}-{i}",
                "instance_id": "gpu-0",
                "output_tokens": 50,
            }
        )
    assert client.post("/v1/events", json={"events": events}).status_code == 200


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """The api suite's settings, with the test's own directory as the models root: the models a
    test builds there may be loaded (KVP_MODELS_ROOT)."""
    return Settings(
        data_dir=tmp_path,
        max_batch_events=50,
        max_body_bytes=64 * 1024,
        log_fsync=False,
        models_root=tmp_path,
    )


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(0.0)


@pytest.fixture
def scored(tmp_path: Path, clock: ManualClock) -> Iterator[TestClient]:
    """A service whose scoring loop does not run by itself: tests tick it on the manual clock."""
    settings = Settings(data_dir=tmp_path / "data", log_fsync=False, score_interval_seconds=0)
    with TestClient(create_app(settings, clock=clock)) as c:
        yield c


def test_the_bundled_model_serves_by_default(client: TestClient) -> None:
    assert client.get("/v1/model").json() == {
        "predictor": "learned (default)",
        "version": "default",
        "live": {"predictor": "learned (default)", "version": "default", **NO_SCORES},
        "shadow": None,
        "comparison": None,
        "by_version": {"default": NO_SCORES},
    }
    assert client.get("/readyz").json()["shadow"] is None


def test_without_a_model_the_heuristic_serves_and_readyz_says_why(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, log_fsync=False, model_dir=tmp_path / "nothing")
    with TestClient(create_app(settings)) as c:
        ready = c.get("/readyz").json()
        assert ready["status"] == "ready"
        # Named relative to the models root (the model dir's parent): /readyz shows no path.
        assert ready["predictor"] == "heuristic (no model at nothing/model.txt)"
        model = c.get("/v1/model").json()
        assert model["version"] is None and model["live"]["version"] is None


def test_reload_swaps_in_a_good_model(client: TestClient, tmp_path: Path) -> None:
    shutil.copytree(DEFAULT_MODEL_DIR, tmp_path / "v2")
    r = client.post("/v1/model/reload", json={"model_dir": str(tmp_path / "v2")})
    assert r.status_code == 200
    assert r.json() == {"predictor": "learned (v2)", "version": "v2"}
    assert client.get("/readyz").json()["predictor"] == "learned (v2)"
    assert client.get("/v1/model").json()["live"]["version"] == "v2"


def test_a_bad_model_is_refused_and_the_old_one_serves_on(
    client: TestClient, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.txt").write_text("tree\nnot really\n")
    r = client.post("/v1/model/reload", json={"model_dir": str(broken)})
    assert r.status_code == 422
    assert r.json()["field"] == "model_dir"
    assert r.json()["detail"].startswith("broken/model.txt does not load: ")
    assert str(tmp_path) not in r.json()["detail"]
    missing = client.post("/v1/model/reload", json={"model_dir": str(tmp_path / "absent")})
    assert (missing.status_code, missing.json()) == (
        422,
        {"detail": "no model at absent/model.txt", "field": "model_dir"},
    )
    empty = client.post("/v1/model/reload", json={"model_dir": ""})
    assert (empty.status_code, empty.json()) == (
        422,
        {"detail": "model_dir: String should have at least 1 character", "field": "model_dir"},
    )
    extra = client.post("/v1/model/reload", json={"model_dir": "x", "extra": 1})
    assert (extra.status_code, extra.json()) == (
        422,
        {"detail": "extra: Extra inputs are not permitted", "field": "extra"},
    )
    assert client.get("/v1/model").json()["version"] == "default"


def test_a_model_dir_the_file_system_refuses_is_refused_too(client: TestClient) -> None:
    r = client.post("/v1/model/reload", json={"model_dir": "m" * 4096})
    assert (r.status_code, r.json()["field"]) == (422, "model_dir")
    assert r.json()["detail"].endswith("/model.txt: File name too long")
    r = client.put(
        "/v1/model/shadow", content=b"\xff", headers={"content-type": "application/json"}
    )
    assert (r.status_code, r.json()) == (
        400,
        {
            "detail": "the body is not JSON: 'utf-8' codec can't decode byte 0xff in position 0: "
            "invalid start byte",
            "field": "body",
        },
    )


def test_reload_is_checked_on_live_sessions(client: TestClient, tmp_path: Path) -> None:
    bad_on_traffic = turns_model(tmp_path / "turns")
    session_with_turns(client, "chat", 3)
    r = client.post("/v1/model/reload", json={"model_dir": str(bad_on_traffic)})
    assert (r.status_code, r.json()) == (
        422,
        {
            "detail": "turns: the model's answers on 1 live session are not probabilities",
            "field": "model_dir",
        },
    )
    assert client.get("/v1/model").json()["version"] == "default"


def test_with_no_live_sessions_reload_is_checked_on_the_probe(
    client: TestClient, tmp_path: Path
) -> None:
    # The same model passes the probe session (2 turns): what the live sample adds is real traffic.
    passes_probe = turns_model(tmp_path / "turns")
    r = client.post("/v1/model/reload", json={"model_dir": str(passes_probe)})
    assert (r.status_code, r.json()) == (200, {"predictor": "learned (turns)", "version": "turns"})


def test_a_closed_session_is_not_in_the_sample(client: TestClient, tmp_path: Path) -> None:
    session_with_turns(client, "chat", 3)
    closed = {"type": "session_closed", "event_id": "close", "ts": 999.0, "session_id": "chat"}
    assert client.post("/v1/events", json={"events": [closed]}).status_code == 200
    r = client.post("/v1/model/reload", json={"model_dir": str(turns_model(tmp_path / "turns"))})
    assert r.status_code == 200


def test_shadow_set_scored_and_cleared(client: TestClient, tmp_path: Path) -> None:
    shutil.copytree(DEFAULT_MODEL_DIR, tmp_path / "v2")
    r = client.put("/v1/model/shadow", json={"model_dir": str(tmp_path / "v2")})
    assert (r.status_code, r.json()) == (200, {"predictor": "learned (v2)", "version": "v2"})
    model = client.get("/v1/model").json()
    assert model["shadow"] == {"predictor": "learned (v2)", "version": "v2", **NO_SCORES}
    assert model["live"]["version"] == "default"
    assert client.get("/readyz").json()["shadow"] == "learned (v2)"
    r = client.delete("/v1/model/shadow")
    assert (r.status_code, r.content) == (204, b"")
    assert client.get("/v1/model").json()["shadow"] is None
    assert client.delete("/v1/model/shadow").status_code == 204  # none is not an error
    assert client.get("/readyz").json()["shadow"] is None


def test_a_bad_shadow_is_refused_with_the_field_named(client: TestClient, tmp_path: Path) -> None:
    shutil.copytree(DEFAULT_MODEL_DIR, tmp_path / "v2")
    assert (
        client.put("/v1/model/shadow", json={"model_dir": str(tmp_path / "v2")}).status_code == 200
    )
    r = client.put("/v1/model/shadow", json={"model_dir": str(tmp_path / "absent")})
    assert (r.status_code, r.json()) == (
        422,
        {"detail": "no model at absent/model.txt", "field": "model_dir"},
    )
    session_with_turns(client, "chat", 3)
    bad_on_traffic = turns_model(tmp_path / "turns")
    r = client.put("/v1/model/shadow", json={"model_dir": str(bad_on_traffic)})
    assert (r.status_code, r.json()) == (
        422,
        {
            "detail": "turns: the model's answers on 1 live session are not probabilities",
            "field": "model_dir",
        },
    )
    assert client.put("/v1/model/shadow", json={}).json() == {
        "detail": "model_dir is required",
        "field": "model_dir",
    }
    # The shadow in place before the refusals is still there.
    assert client.get("/v1/model").json()["shadow"]["version"] == "v2"


def test_the_configured_shadow_loads_at_startup(tmp_path: Path) -> None:
    shutil.copytree(DEFAULT_MODEL_DIR, tmp_path / "v2")
    settings = Settings(
        data_dir=tmp_path / "data", log_fsync=False, shadow_model_dir=tmp_path / "v2"
    )
    with TestClient(create_app(settings)) as c:
        assert c.get("/v1/model").json()["shadow"]["predictor"] == "learned (v2)"


def test_a_configured_shadow_that_does_not_load_is_no_outage(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path / "data", log_fsync=False, shadow_model_dir=tmp_path / "absent"
    )
    with TestClient(create_app(settings)) as c:
        ready = c.get("/readyz").json()
        assert ready["status"] == "ready"
        assert ready["shadow"] == "none (no model at absent/model.txt)"
        assert c.get("/v1/model").json()["shadow"] is None


def test_hit_rates_of_live_and_shadow(tmp_path: Path, clock: ManualClock) -> None:
    # The heuristic serves (no model), the bundled model shadows: two models that disagree.
    settings = Settings(
        data_dir=tmp_path / "data",
        log_fsync=False,
        score_interval_seconds=0,
        model_dir=tmp_path / "none",
        shadow_model_dir=DEFAULT_MODEL_DIR,
        models_root=DEFAULT_MODEL_DIR.parent,
    )
    with TestClient(create_app(settings, clock=clock)) as c:
        clock.set(900.0)  # the events below are then in the service's past, as they are live
        session_with_turns(c, "a", 3, start_ts=740.0)  # a turn a minute, the last at 860
        session_with_turns(c, "b", 1, start_ts=300.0)  # one turn, silent since 305
        app = c.app
        settle(c)
        assert app.state.engine.scorer.tick() == 2  # type: ignore[attr-defined]
        store = app.state.engine.store  # type: ignore[attr-defined]
        views = [store.session("a"), store.session("b")]
        # What the production planner advises at 900 is what each model is judged on.
        predictors = {"live": HeuristicPredictor(), "shadow": LearnedPredictor(DEFAULT_MODEL_DIR)}
        advised = {name: Advisor(p).advise(views, 900.0) for name, p in predictors.items()}
        kept = {
            name: [a.retention == "keep" or a.prefetch for a in advice]
            for name, advice in advised.items()
        }
        per_block = app.state.engine.cluster.bytes_per_block  # type: ignore[attr-defined]
        assert kept["live"] == [True, False]  # the setup: the heuristic keeps a, lets b go

        # Both come back; c was never scored; a resend of an arrival counts once.
        arrivals = [
            routed("a-back", "a", 950.0),
            routed("b-back", "b", 960.0),
            routed("c-1", "c", 955.0),
        ]
        assert c.post("/v1/events", json={"events": arrivals}).status_code == 200
        assert c.post("/v1/events", json={"events": arrivals[:1]}).json()["duplicates"] == [
            "a-back"
        ]
        model = c.get("/v1/model").json()
        # Outside the models root: named by its last part alone.
        for name, predictor in (
            ("live", "heuristic (no model at none/model.txt)"),
            ("shadow", "learned (default)"),
        ):
            hits = sum(kept[name])
            # Unscored: c, and the four turns that built a and b before any advice.
            assert model[name] == {
                "predictor": predictor,
                "version": None if name == "live" else "default",
                "predictions": 2,
                "keep_predictions": hits,
                "hits": hits,
                "misses": 2 - hits,
                "unscored": 5,
                "hit_rate": hits / 2,
                # The cost of its advice: the context bytes of what it kept and prefetched.
                "prefetch_predictions": sum(a.prefetch for a in advised[name]),
                "keep_advice_bytes": per_block
                * sum(len(a.block_hashes) for a in advised[name] if a.retention == "keep"),
                "prefetch_advice_bytes": per_block
                * sum(len(a.block_hashes) for a in advised[name] if a.prefetch),
            }, name
        assert model["live"]["hit_rate"] == 0.5

        # A reload starts the live model's counts afresh; the shadow keeps its own.
        assert (
            c.post("/v1/model/reload", json={"model_dir": str(DEFAULT_MODEL_DIR)}).status_code
            == 200
        )
        model = c.get("/v1/model").json()
        assert model["live"] == {
            "predictor": "learned (default)",
            "version": "default",
            **NO_SCORES,
        }
        assert model["shadow"]["predictions"] == 2


def test_advice_made_after_a_late_arrival_does_not_score_it(
    scored: TestClient, clock: ManualClock
) -> None:
    c = scored
    clock.set(900.0)  # the events below are then in the service's past, as they are live
    session_with_turns(c, "a", 2, start_ts=800.0)
    settle(c)
    assert c.app.state.engine.scorer.tick() == 1  # type: ignore[attr-defined]
    before = c.get("/v1/model").json()["live"]
    assert (before["predictions"], before["unscored"]) == (1, 2)  # the two turns that built a
    # The request came at 890, before that advice, but was posted only now.
    assert c.post("/v1/events", json={"events": [routed("a-late", "a", 890.0)]}).status_code == 200
    live = c.get("/v1/model").json()["live"]
    assert (live["predictions"], live["hits"], live["misses"], live["unscored"]) == (1, 0, 0, 3)


def test_the_scoring_loop_runs_with_the_service(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", log_fsync=False, score_interval_seconds=60.0)
    app = create_app(settings)
    with TestClient(app):
        task = app.state.engine.scoring_task
        assert task is not None and not task.done()
    assert task.cancelled()
    off = create_app(Settings(data_dir=tmp_path / "off", log_fsync=False, score_interval_seconds=0))
    with TestClient(off):
        assert off.state.engine.scoring_task is None


# -- the models root (KVP_MODELS_ROOT) ----------------------------------------------------------


@pytest.fixture
def outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory outside the models root, holding a good model, a directory with no model, and
    a plain file."""
    place = tmp_path_factory.mktemp("outside")
    shutil.copytree(DEFAULT_MODEL_DIR, place / "good")
    (place / "empty").mkdir()
    (place / "file").write_text("x")
    return place


@pytest.mark.parametrize("route", ["reload", "shadow"])
def test_a_model_dir_outside_the_models_root_is_refused_alike_whatever_is_there(
    client: TestClient, tmp_path: Path, outside: Path, route: str
) -> None:
    shutil.copytree(DEFAULT_MODEL_DIR, tmp_path / "v2")
    (tmp_path / "escape").symlink_to(outside / "good", target_is_directory=True)

    def send(model_dir: str) -> tuple[int, dict[str, str]]:
        body = {"model_dir": model_dir}
        r = (
            client.post("/v1/model/reload", json=body)
            if route == "reload"
            else client.put("/v1/model/shadow", json=body)
        )
        return r.status_code, r.json()

    answers = {
        name: send(name)
        for name in (
            str(outside / "good"),
            str(outside / "empty"),
            str(outside / "file"),
            str(outside / "absent"),
            "/",
            "/etc",
            f"{tmp_path}/../{outside.name}/good",
            "../" + outside.name + "/good",
            "v2/../v2",
            "escape",
            str(tmp_path / "escape"),
        )
    }
    # One answer for all: a model there, none, a file, nothing, a symlink leading out, `..`.
    assert {code for code, _ in answers.values()} == {422}
    assert len({body["detail"] for _, body in answers.values()}) == 1, answers
    body = next(iter(answers.values()))[1]
    assert body["field"] == "model_dir" and "KVP_MODELS_ROOT" in body["detail"]
    assert str(tmp_path) not in body["detail"] and str(outside) not in body["detail"]
    model = client.get("/v1/model").json()
    assert model["version"] == "default" and model["shadow"] is None  # nothing changed


def test_a_relative_name_is_a_model_under_the_root_and_a_symlink_inside_it_is_followed(
    client: TestClient, tmp_path: Path
) -> None:
    shutil.copytree(DEFAULT_MODEL_DIR, tmp_path / "v2")
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested" / "current").symlink_to(tmp_path / "v2", target_is_directory=True)
    r = client.post("/v1/model/reload", json={"model_dir": "v2"})
    assert (r.status_code, r.json()) == (200, {"predictor": "learned (v2)", "version": "v2"})
    r = client.put("/v1/model/shadow", json={"model_dir": "nested/current"})
    assert (r.status_code, r.json()["version"]) == (200, "v2")
    # An absolute path inside the root.
    r = client.post("/v1/model/reload", json={"model_dir": str(tmp_path / "v2")})
    assert r.status_code == 200


def test_inside_the_root_errors_name_the_model_dir_relative_to_it(
    client: TestClient, tmp_path: Path
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    answers = {
        name: client.post("/v1/model/reload", json={"model_dir": name}).json()["detail"]
        for name in ("absent", "empty", "file", str(tmp_path / "absent"))
    }
    assert answers == {
        "absent": "no model at absent/model.txt",
        "empty": "no model at empty/model.txt",
        "file": "no model at file/model.txt",
        str(tmp_path / "absent"): "no model at absent/model.txt",
    }


def test_the_retraining_schedule_is_off_by_default_and_says_so(client: TestClient) -> None:
    body = client.get("/v1/model/retrain").json()
    assert body == {
        "enabled": False,
        "state": "off",
        "every_seconds": 0.0,
        "next_run_ts": None,
        "arrivals_since_last_run": 0,
        "min_arrivals": 1000,
        "runs": {"promoted": 0, "discarded": 0, "failed": 0, "skipped": 0},
        "candidate": None,
        "last": None,
    }
    assert client.get("/v1/dashboard/now").json()["retrain"] == body


def test_the_retraining_schedule_shows_its_last_run(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path,
        log_fsync=False,
        retrain_every_seconds=600.0,
        retrain_min_arrivals=5,
        score_interval_seconds=0,
        plan_interval_seconds=0,
    )
    with TestClient(create_app(settings)) as c:
        assert c.post("/v1/events", json={"events": [routed("e1")]}).status_code == 200
        settle(c)
        engine = c.app.state.engine  # type: ignore[attr-defined]
        step = functools.partial(engine.retrain_step, force=True)
        assert c.portal.call(step) == "skipped"  # type: ignore[union-attr]
        body = c.get("/v1/model/retrain").json()
        assert body["enabled"] and body["state"] == "waiting"
        assert body["arrivals_since_last_run"] == 1
        assert body["runs"]["skipped"] == 1
        assert body["last"]["outcome"] == "skipped"
        assert "fewer than KVP_RETRAIN_MIN_ARRIVALS (5)" in body["last"]["reason"]
        assert body["next_run_ts"] > 0
        metrics = c.get("/metrics").text
        assert 'kvprefetch_retrain_runs_total{outcome="skipped"} 1.0' in metrics
