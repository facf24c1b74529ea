"""One contract, every predictor found (tests/implementations.py: every class under app/ or
client/ that declares `Predictor`): the heuristic, and the learned model (the bundled one, on
the Booster, reading the deployment's signals and tool calls in flight). A new predictor needs a
factory in FACTORIES below (test_every_predictor_has_a_factory says so).

What the protocol promises (app/predict/predictors.py), and the advisor and the scoring loop rely
on: a (sessions, horizons) matrix of probabilities in [0, 1], non-decreasing in the horizon (the
learned model is trained monotone in it), 0 for a closed session, each row the session's own
(asking about fewer sessions changes none). A `TablePredictor` also answers from a FeatureTable
what it answers from the views (app/decide/table_advice.py takes that path when it can).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest

from app.core.bundle import DEFAULT_MODEL_DIR
from app.predict.feature_table import FeatureTable
from app.predict.features import DeploymentSignals
from app.predict.predictors import (
    HORIZON_GRID,
    HeuristicPredictor,
    LearnedPredictor,
    Predictor,
    TablePredictor,
)
from app.predict.tool_durations import ToolDurations
from app.state.base import SessionView
from tests.implementations import factory_of, here, missing_factories, params
from tests.predict.test_features import START_TS, random_view
from tests.predict.test_tool_durations import runs, started

NOW = START_TS + 86_400.0
SESSIONS = 300
# The grid the advisor reads, and a fine one over it (unevenly spaced, past its last horizon).
FINE = tuple(float(h) for h in np.geomspace(0.5, 2000.0, 41))


def views(seed: int = 1, n: int = SESSIONS) -> list[SessionView]:
    """Sessions in every shape the store produces (closed ones included), as of NOW."""
    rng = random.Random(seed)
    return [random_view(rng, i, now=NOW) for i in range(n)]


def _tools() -> ToolDurations:
    """Run times of two tools, and a call in flight in every third session (started 0 to 90 s
    before NOW)."""
    rng = random.Random(7)
    t = ToolDurations()
    t.observe(runs("bash", [rng.lognormvariate(1.5, 1.0) for _ in range(40)], t0=NOW - 3600))
    t.observe(runs("search", [rng.uniform(0.5, 4.0) for _ in range(40)], t0=NOW - 3000))
    t.observe(
        sorted(
            (
                started(f"s{i}", NOW - rng.uniform(0, 90), rng.choice(["bash", "search"]))
                for i in range(0, SESSIONS, 3)
            ),
            key=lambda e: e.ts,
        )
    )
    return t


def _learned() -> LearnedPredictor:
    return LearnedPredictor(
        DEFAULT_MODEL_DIR, backend="booster", deployment=DeploymentSignals(), tools=_tools()
    )


# One per implementation found (test_every_predictor_has_a_factory checks).
FACTORIES: dict[type, Callable[[], Predictor]] = {
    HeuristicPredictor: HeuristicPredictor,
    LearnedPredictor: _learned,
}


def test_every_predictor_has_a_factory() -> None:
    missing = missing_factories(Predictor, FACTORIES, here(__file__))
    assert not missing, "\n".join(missing)


@pytest.fixture(params=params(Predictor))
def predictor(request: pytest.FixtureRequest) -> Predictor:
    return factory_of(Predictor, FACTORIES, request.param, request)()


@pytest.fixture(params=params(TablePredictor))
def table_predictor(request: pytest.FixtureRequest) -> TablePredictor:
    built = factory_of(Predictor, FACTORIES, request.param, request)()
    assert isinstance(built, TablePredictor)
    return built


def test_a_predictor_has_a_name(predictor: Predictor) -> None:
    assert isinstance(predictor.name, str) and predictor.name


@pytest.mark.parametrize("horizons", [HORIZON_GRID, FINE], ids=["grid", "fine"])
def test_probabilities_per_session_and_horizon_in_0_1(
    predictor: Predictor, horizons: tuple[float, ...]
) -> None:
    for seed in (1, 2):
        p = predictor.p_within(views(seed), NOW, horizons)
        assert p.shape == (SESSIONS, len(horizons))
        assert np.isfinite(p).all() and (p >= 0.0).all() and (p <= 1.0).all()
        assert p.any()  # not a matrix of zeros: some session is expected back
    assert predictor.p_within([], NOW, horizons).shape == (0, len(horizons))


@pytest.mark.parametrize("horizons", [HORIZON_GRID, FINE], ids=["grid", "fine"])
def test_more_time_is_never_less_likely(predictor: Predictor, horizons: tuple[float, ...]) -> None:
    for seed in (1, 2, 3):
        p = predictor.p_within(views(seed), NOW, horizons)
        rows, cols = np.nonzero(np.diff(p, axis=1) < 0)
        assert not len(rows), [
            (f"s{r}", horizons[c], horizons[c + 1], p[r, c], p[r, c + 1])
            for r, c in zip(rows[:5], cols[:5])
        ]


def test_a_closed_session_is_not_coming_back(predictor: Predictor) -> None:
    sessions = views(2)
    closed = [i for i, v in enumerate(sessions) if v.state == "closed"]
    assert closed
    p = predictor.p_within(sessions, NOW, HORIZON_GRID)
    assert not p[closed].any()


def test_each_row_is_its_sessions_own(predictor: Predictor) -> None:
    sessions = views(3)
    p = predictor.p_within(sessions, NOW, HORIZON_GRID)
    np.testing.assert_array_equal(predictor.p_within(sessions, NOW, HORIZON_GRID), p)
    np.testing.assert_allclose(
        predictor.p_within(sessions[40:90], NOW, HORIZON_GRID), p[40:90], rtol=0, atol=1e-12
    )
    np.testing.assert_allclose(
        predictor.p_within(sessions[::-1], NOW, HORIZON_GRID), p[::-1], rtol=0, atol=1e-12
    )


@pytest.mark.parametrize("horizons", [HORIZON_GRID, FINE], ids=["grid", "fine"])
def test_a_table_predictor_answers_from_the_table_as_from_the_views(
    table_predictor: TablePredictor, horizons: tuple[float, ...]
) -> None:
    sessions = views(4)
    p = table_predictor.p_within(sessions, NOW, horizons)
    table = FeatureTable.from_views(sessions)
    np.testing.assert_allclose(
        table_predictor.p_within_table(table, NOW, horizons), p, rtol=0, atol=1e-12
    )
    rows = table.rows_of([v.session_id for v in sessions[10:60]])
    matrices: dict[bytes, np.ndarray] = {}
    first = table_predictor.p_within_table(table, NOW, horizons, rows, matrices=matrices)
    np.testing.assert_allclose(first, p[10:60], rtol=0, atol=1e-12)
    # Asked again with what the first call left to share: the same answer.
    again = table_predictor.p_within_table(table, NOW, horizons, rows, matrices=matrices)
    np.testing.assert_array_equal(again, first)
    empty = table_predictor.p_within_table(FeatureTable(), NOW, horizons)
    assert empty.shape == (0, len(horizons))
