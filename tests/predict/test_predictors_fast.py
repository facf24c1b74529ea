"""The learned predictor's fast paths: a FeatureTable instead of views, and the compiled model.

The compiled model (lleaves, the `fast` extra) must answer what the Booster answers: within 1e-6
on the bundled model, over random rows with NaNs and over real feature rows. Without lleaves those
tests skip and the predictor must fall back to the Booster.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import numpy as np
import pytest

from app.core.bundle import DEFAULT_MODEL_DIR
from app.predict import compiled
from app.predict.feature_table import FeatureTable, feature_matrix
from app.predict.features import FEATURES
from app.predict.predictors import HORIZON_GRID, LearnedPredictor, ModelError, probe_rows
from tests.predict.test_features import START_TS, random_view

needs_lleaves = pytest.mark.skipif(
    not compiled.available(), reason="lleaves is not installed (the fast extra)"
)


@pytest.fixture(scope="module")
def cache_dir() -> Path:
    # The service's own cache (~/.cache/kvprefetch/lleaves): the bundled model's 1,152 trees take
    # one to two minutes to compile, once a machine, and every start of the service on it (the
    # e2e tests' too) reads the same file. Cold compiles and wrong caches are tested on a small
    # model in a directory of their own below.
    return compiled.default_cache_dir()


@pytest.fixture(scope="module")
def booster_model() -> LearnedPredictor:
    return LearnedPredictor(DEFAULT_MODEL_DIR, backend="booster")


@pytest.fixture(scope="module")
def compiled_model(cache_dir: Path) -> LearnedPredictor:
    if not compiled.available():
        pytest.skip("lleaves is not installed (the fast extra)")
    return LearnedPredictor(DEFAULT_MODEL_DIR, backend="compiled", cache_dir=cache_dir)


def views_and_now(seed: int, n: int = 400) -> tuple[list, float]:  # type: ignore[type-arg]
    rng = random.Random(seed)
    now = START_TS + rng.uniform(0, 1e5)
    return [random_view(rng, i, now=now) for i in range(n)], now


def test_booster_backend_keeps_the_public_api(booster_model: LearnedPredictor) -> None:
    assert booster_model.backend == "booster" and booster_model.compiled is None
    names = booster_model.feature_names
    assert booster_model.version == "default" and booster_model.card["features"] == list(names)
    assert set(names) <= set(FEATURES)
    views, now = views_and_now(1, 50)
    x = feature_matrix(views, now, HORIZON_GRID)
    # The model reads its own columns of the service's matrix, by name.
    own = x[:, [FEATURES.index(n) for n in names]]
    np.testing.assert_array_equal(booster_model.model_input(x), own)
    np.testing.assert_array_equal(
        booster_model.p_from_matrix(x), booster_model.booster.predict(own, num_threads=1)
    )
    assert booster_model.p_from_matrix(np.zeros((0, len(FEATURES)))).shape == (0,)
    assert booster_model.p_within(views[:1], now, HORIZON_GRID).shape == (1, len(HORIZON_GRID))


@pytest.mark.parametrize("horizons", [(30.0, 300.0, 900.0), HORIZON_GRID])
def test_table_path_equals_the_views_path(
    booster_model: LearnedPredictor, horizons: tuple[float, ...]
) -> None:
    views, now = views_and_now(2)
    table = FeatureTable.from_views(views)
    p = booster_model.p_within(views, now, horizons)
    assert p.shape == (len(views), len(horizons))
    np.testing.assert_allclose(
        booster_model.p_within_table(table, now, horizons), p, rtol=0, atol=1e-12
    )
    closed = [i for i, v in enumerate(views) if v.state == "closed"]
    assert closed and not p[closed].any()
    rows = table.rows_of([v.session_id for v in views[10:30]])
    np.testing.assert_allclose(
        booster_model.p_within_table(table, now, horizons, rows), p[10:30], rtol=0, atol=1e-12
    )
    assert booster_model.p_within_table(FeatureTable(), now, horizons).shape == (0, len(horizons))


@needs_lleaves
def test_compiled_model_answers_as_the_booster(
    compiled_model: LearnedPredictor, booster_model: LearnedPredictor
) -> None:
    assert compiled_model.backend == "lleaves"
    rows = [probe_rows(4000, seed=s) for s in (1, 2)]
    views, now = views_and_now(3)
    rows += [feature_matrix(views, now + dt, HORIZON_GRID) for dt in (0.0, 90.0, 1800.0)]
    for x in rows:
        assert np.isnan(x).any()
        expected = booster_model.booster.predict(booster_model.model_input(x), num_threads=1)
        np.testing.assert_allclose(compiled_model.p_from_matrix(x), expected, rtol=0, atol=1e-6)
    np.testing.assert_allclose(
        compiled_model.p_within(views, now, HORIZON_GRID),
        booster_model.p_within(views, now, HORIZON_GRID),
        rtol=0,
        atol=1e-6,
    )
    one = feature_matrix(views[:1], now, HORIZON_GRID[:1])
    np.testing.assert_allclose(
        compiled_model.p_from_matrix(one), booster_model.p_from_matrix(one), atol=1e-6
    )


@needs_lleaves
def test_compiled_model_is_cached_and_a_wrong_cache_is_refused(
    compiled_model: LearnedPredictor, cache_dir: Path, tmp_path: Path
) -> None:
    cached = LearnedPredictor(DEFAULT_MODEL_DIR, cache_dir=cache_dir)
    assert (
        cached.backend == "lleaves" and cached.compiled is not None and cached.compiled.from_cache
    )
    # None of this process's: the service's cache may hold another process's compile under way.
    assert list(cache_dir.glob(f"*.{os.getpid()}.*.partial")) == []
    # Another model's machine code under this model's key: it answers differently, so the
    # predictor serves with the Booster and drops the file, and the next start compiles afresh.
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.txt").write_text(tiny_model_text())
    wrong = LearnedPredictor(other, backend="compiled", cache_dir=tmp_path / "cache")
    assert wrong.compiled is not None
    bad_cache = tmp_path / "bad"
    bad_cache.mkdir()
    key_file = bad_cache / cached.compiled.cache_file.name
    key_file.write_bytes(wrong.compiled.cache_file.read_bytes())
    fallback = LearnedPredictor(DEFAULT_MODEL_DIR, cache_dir=bad_cache)
    assert fallback.backend == "booster" and not key_file.exists()
    with pytest.raises(ModelError, match="does not compile"):
        key_file.write_bytes(wrong.compiled.cache_file.read_bytes())
        LearnedPredictor(DEFAULT_MODEL_DIR, backend="compiled", cache_dir=bad_cache)


def test_auto_falls_back_to_the_booster_without_lleaves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "available", lambda: False)
    assert LearnedPredictor(DEFAULT_MODEL_DIR).backend == "booster"


def test_a_compile_failure_leaves_the_booster_unless_compiled_was_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("LLVM says no")

    monkeypatch.setattr(compiled, "available", lambda: True)
    monkeypatch.setattr(compiled, "compile_model", broken)
    assert LearnedPredictor(DEFAULT_MODEL_DIR).backend == "booster"
    with pytest.raises(ModelError, match="LLVM says no"):
        LearnedPredictor(DEFAULT_MODEL_DIR, backend="compiled")


def tiny_model_text() -> str:
    """A small model over the service's features, different from the bundled one."""
    import lightgbm as lgb

    rng = np.random.default_rng(5)
    x = probe_rows(2000, seed=9)
    y = (rng.random(len(x)) < 0.3).astype(float)
    booster = lgb.train(
        {"objective": "binary", "num_leaves": 4, "verbose": -1, "seed": 1},
        lgb.Dataset(x, y, feature_name=list(FEATURES)),
        num_boost_round=5,
    )
    return str(booster.model_to_string())


@needs_lleaves
def test_compiled_in_the_background_the_booster_serves_until_it_lands(tmp_path: Path) -> None:
    """The service's start never waits on a first compile: the Booster answers meanwhile, the
    compiled model takes over once built and checked, and a later start finds it cached."""
    model_dir = tmp_path / "small"
    model_dir.mkdir()
    (model_dir / "model.txt").write_text(tiny_model_text())
    cache = tmp_path / "cache"
    # What a service stopped mid-compile left: dropped by the next compile once stale.
    cache.mkdir()
    stale, fresh = cache / "old.o.1.x.partial", cache / "new.o.2.y.partial"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"half")
    hour_ago = time.time() - compiled.STALE_PARTIAL_SECONDS - 60
    os.utime(stale, (hour_ago, hour_ago))
    model = LearnedPredictor(model_dir, cache_dir=cache, compile_in_background=True)
    x = probe_rows(500, seed=5)
    expected = model.booster.predict(model.model_input(x), num_threads=1)
    np.testing.assert_allclose(model.p_from_matrix(x), expected, rtol=0, atol=1e-6)
    assert model.wait_compiled(timeout_seconds=600)
    assert model.backend == "lleaves" and not model.compiled.from_cache  # type: ignore[union-attr]
    assert not stale.exists() and fresh.exists()  # another process's may still be writing
    np.testing.assert_allclose(model.p_from_matrix(x), expected, rtol=0, atol=1e-6)
    again = LearnedPredictor(model_dir, cache_dir=cache, compile_in_background=True)
    assert again.backend == "lleaves" and again.compiled.from_cache  # type: ignore[union-attr]


@needs_lleaves
def test_the_compile_model_command_fills_the_cache_a_start_then_reads(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    from tests.conftest import REPO, small_model_dir

    model_dir = small_model_dir(tmp_path / "model")
    cache_root = tmp_path / "cache"
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_root)}

    def compile_model(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvprefetch_cli", "compile-model", *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )

    first, second = (compile_model("--model-dir", str(model_dir), "--json") for _ in range(2))
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    made, read = json.loads(first.stdout), json.loads(second.stdout)
    assert (made["from_cache"], read["from_cache"]) == (False, True)
    assert made["trees"] == 5 and made["cache_file"] == read["cache_file"]
    cache_dir = cache_root / "kvprefetch" / "lleaves"
    assert Path(made["cache_file"]).parent == cache_dir
    assert compiled.is_cached(model_dir / "model.txt", cache_dir)
    missing = compile_model("--model-dir", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "no model at" in missing.stderr, missing.stderr
