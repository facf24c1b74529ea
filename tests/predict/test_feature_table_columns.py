"""The FeatureTable's advisor columns and the caller's marks follow upserts, removals and growth."""

from __future__ import annotations

import math
import random

import numpy as np

from app.core.bundle import DEFAULT_MODEL_DIR
from app.predict.feature_table import STATE_CODES, FeatureTable
from app.predict.predictors import LearnedPredictor
from app.state.base import SessionView
from tests.predict.test_features import START_TS, random_view


def expected_columns(view: SessionView) -> tuple[int, int, float, float]:
    signal = view.signals[-1].ts if view.signals else math.nan
    return STATE_CODES[view.state], len(view.block_hashes), view.last_activity_ts, signal


def held_columns(table: FeatureTable, session_id: str) -> tuple[int, int, float, float]:
    rows = table.rows_of([session_id])
    state, blocks, last = table.advisor_columns(rows)
    return int(state[0]), int(blocks[0]), float(last[0]), float(table.signal_ts(rows)[0])


def same(a: tuple[int, int, float, float], b: tuple[int, int, float, float]) -> bool:
    return a[:3] == b[:3] and (a[3] == b[3] or (math.isnan(a[3]) and math.isnan(b[3])))


def test_advisor_columns_and_marks_follow_upserts_removals_and_growth() -> None:
    rng = random.Random(5)
    table = FeatureTable(capacity=2, marks=2)
    current: dict[str, SessionView] = {}
    marked: dict[str, float] = {}
    now = START_TS
    for step in range(2000):
        sid = f"s{rng.randrange(120)}"
        if sid in current and rng.random() < 0.3:
            table.remove(sid)
            del current[sid]
            marked.pop(sid, None)
        elif sid in current and rng.random() < 0.3:
            row = table.row(sid)
            assert row is not None
            table.marks[row] = [step, -step]  # the caller's own note, carried with the row
            marked[sid] = float(step)
        else:
            view = random_view(rng, int(sid[1:]), now=now)
            current[sid] = view
            marked.pop(sid, None)  # a changed session: its marks are reset
            if rng.random() < 0.5:
                table.upsert(view)
            else:
                table.upsert_many([view])
        now += rng.uniform(0, 3)
    assert sorted(table.session_ids) == sorted(current) and table.removals > 0
    for sid, view in current.items():
        assert same(held_columns(table, sid), expected_columns(view)), sid
        row = table.row(sid)
        assert row is not None
        if sid in marked:
            assert table.marks[row].tolist() == [marked[sid], -marked[sid]]
        else:
            assert np.isnan(table.marks[row]).all()
    rows = np.arange(len(table))
    assert table.ids_of(rows) == table.session_ids
    assert table.row("never-seen") is None


def test_models_share_one_feature_matrix_per_rows_and_time() -> None:
    rng = random.Random(3)
    views = [random_view(rng, i, now=START_TS) for i in range(80)]
    table = FeatureTable.from_views(views)
    model = LearnedPredictor(DEFAULT_MODEL_DIR)
    rows = np.arange(0, 80, 3)
    now, horizons = START_TS + 30.0, (5.0, 30.0, 300.0)
    matrices: dict[bytes, np.ndarray] = {}
    first = model.p_within_table(table, now, horizons, rows, matrices=matrices)
    assert len(matrices) == 1
    (x,) = matrices.values()
    x[:] = 0.0  # a second model asked the same reads the shared matrix, not a fresh one
    second = model.p_within_table(table, now, horizons, rows, matrices=matrices)
    assert len(matrices) == 1
    expected = model.p_from_matrix(x).reshape(len(rows), len(horizons))
    expected[table.closed(rows)] = 0.0
    assert np.array_equal(second, expected) and not np.array_equal(second, first)
    alone = model.p_within_table(table, now, horizons, rows)
    assert np.array_equal(first, alone)
