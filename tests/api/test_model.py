"""The serving model: the bundled one at startup, the heuristic without it, reloads that check first."""

from __future__ import annotations

import shutil
from pathlib import Path

from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.config import Settings
from app.engine.predictor import DEFAULT_MODEL_DIR


def test_the_bundled_model_serves_by_default(client: TestClient) -> None:
    assert client.get("/v1/model").json() == {"predictor": "learned (default)", "version": "default"}


def test_without_a_model_the_heuristic_serves_and_readyz_says_why(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, log_fsync=False, model_dir=tmp_path / "nothing")
    with TestClient(create_app(settings)) as c:
        ready = c.get("/readyz").json()
        assert ready["status"] == "ready"
        assert ready["predictor"] == f"heuristic (no model at {tmp_path / 'nothing' / 'model.txt'})"
        assert c.get("/v1/model").json()["version"] is None


def test_reload_swaps_in_a_good_model(client: TestClient, tmp_path: Path) -> None:
    shutil.copytree(DEFAULT_MODEL_DIR, tmp_path / "v2")
    r = client.post("/v1/model/reload", json={"model_dir": str(tmp_path / "v2")})
    assert r.status_code == 200
    assert r.json() == {"predictor": "learned (v2)", "version": "v2"}
    assert client.get("/readyz").json()["predictor"] == "learned (v2)"


def test_a_bad_model_is_refused_and_the_old_one_serves_on(client: TestClient, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.txt").write_text("tree\nnot really\n")
    r = client.post("/v1/model/reload", json={"model_dir": str(broken)})
    assert r.status_code == 422
    detail = r.json()["detail"][0]
    assert detail["loc"] == ["body", "model_dir"] and "does not load" in detail["msg"]
    missing = client.post("/v1/model/reload", json={"model_dir": str(tmp_path / "absent")})
    assert missing.status_code == 422 and "no model at" in missing.json()["detail"][0]["msg"]
    assert client.post("/v1/model/reload", json={"model_dir": ""}).status_code == 422
    assert client.post("/v1/model/reload", json={"model_dir": "x", "extra": 1}).status_code == 422
    assert client.get("/v1/model").json()["version"] == "default"
