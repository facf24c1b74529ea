"""Features: online (the service's live state over HTTP) equals offline (training rows)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import orjson
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.config import Settings
from app.engine.eventlog import encode_events
from app.engine.features import FEATURES, SESSION_FEATURES, feature_matrix, session_features
from app.engine.state.base import SessionView
from sim.replay import replay
from sim.scenario import load_scenario
from sim.traces import load_trace
from tests.conftest import TRACES
from training.dataset import load_events, rows_from_events


def small_log(tmp_path: Path, requests: int = 300) -> Path:
    trace = load_trace(TRACES / "mooncake_synthetic.jsonl")[:requests]
    result = replay(trace, load_scenario("default"), keep_events=True)
    path = tmp_path / "events.jsonl"
    path.write_bytes(encode_events(result.events))
    return path


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_offline_rows_equal_features_read_from_the_running_service(tmp_path: Path) -> None:
    events = load_events(small_log(tmp_path))
    rows = rows_from_events(events, log_name="events.jsonl")
    assert len(rows) > 100
    sample = rows.drop_duplicates(["session_id", "decision_ts"]).sample(n=40, random_state=7).sort_values("decision_ts")
    with TestClient(create_app(Settings(data_dir=tmp_path / "svc", log_fsync=False))) as client:
        i = 0
        for _, row in sample.iterrows():
            batch = []
            while i < len(events) and events[i].ts <= row.decision_ts:
                batch.append(orjson.loads(events[i].__pydantic_serializer__.to_json(events[i])))
                i += 1
            for k in range(0, len(batch), 1000):
                assert client.post("/v1/events", json={"events": batch[k:k + 1000]}).status_code == 200
            view = SessionView.model_validate(client.get(f"/v1/sessions/{row.session_id}").json())
            online = session_features(view, row.decision_ts)
            offline = [row[name] for name in SESSION_FEATURES]
            mismatched = [n for n, a, b in zip(SESSION_FEATURES, online, offline) if not same(a, b)]
            assert not mismatched, f"{row.session_id} at {row.decision_ts}: {mismatched}"


def test_labels_look_ahead_and_censored_rows_are_dropped(tmp_path: Path) -> None:
    events = load_events(small_log(tmp_path))
    rows = rows_from_events(events, log_name="x")
    end = events[-1].ts
    assert (rows.decision_ts + rows.horizon_seconds <= end).all()
    assert ((rows.time_to_next_seconds <= rows.horizon_seconds) == (rows.label == 1)).all()
    assert set(rows.horizon_seconds.unique()) <= {15.0, 60.0, 180.0, 600.0}


def test_feature_matrix_is_sessions_by_horizons() -> None:
    view = SessionView(session_id="s", state="idle", turns=3, first_seen_ts=0.0, last_activity_ts=100.0,
                       closed_ts=None, instance_id="g", context_tokens=900, context_bytes=0, block_hashes=[1],
                       block_tokens=512, recent_arrivals_ts=[0.0, 30.0, 90.0], inter_turn_gaps_seconds=[30.0, 60.0],
                       last_request=None, resident_blocks={})
    x = feature_matrix([view, view], 130.0, [15.0, 60.0])
    assert x.shape == (4, len(FEATURES))
    assert list(x[:, -1]) == [15.0, 60.0, 15.0, 60.0]
    f = dict(zip(FEATURES, x[0]))
    assert (f["idle_seconds"], f["since_arrival_seconds"], f["gap_median_seconds"]) == (30.0, 40.0, 45.0)
    assert f["idle_over_gap_median"] == 30.0 / 45.0
    assert np.isnan(f["last_prompt_tokens"])
