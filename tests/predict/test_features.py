"""Features: online (the service's live state over HTTP) equals offline (training rows)."""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path

import numpy as np
import orjson
import pandas as pd
import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.clock import ManualClock
from app.core.config import Settings
from app.deliver import InProcessSink
from app.engine import Engine
from app.ingest.eventlog import encode_events
from app.predict.feature_table import FeatureTable, feature_matrix
from app.predict.features import (
    DEPLOYMENT_FEATURES,
    FEATURES,
    SESSION_FEATURES,
    session_features,
    tool_features,
)
from app.predict.tool_durations import TOOL_FEATURES, ToolDurations
from app.state import MemoryStore
from app.state.base import RequestView, SessionView, SignalView
from app.state.rules import RECENT_SIGNALS
from kvprefetch_client.events import SIGNAL_KINDS, Event, SessionSignal
from sim.replay import replay
from sim.scenario import load_scenario
from sim.signals import with_signals
from sim.traces import load_trace
from sim.workloads import AgentWorkload, agent_trace
from tests.conftest import TRACES
from training.dataset import HORIZONS, load_events, rows_from_events


def small_log(tmp_path: Path, requests: int = 300, signals: dict[str, float] | None = None) -> Path:
    trace = load_trace(TRACES / "mooncake_synthetic.jsonl")[:requests]
    scenario = load_scenario("default")
    if signals is not None:
        scenario = scenario.model_copy(update={"signals": with_signals(scenario.signals, signals)})
    result = replay(trace, scenario, keep_events=True)
    path = tmp_path / "events.jsonl"
    path.write_bytes(encode_events(result.events))
    return path


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.parametrize(
    "signals", [None, {"coverage": 0.6, "lead_median_seconds": 5.0, "false_alarms": 1.0}]
)
def test_offline_rows_equal_features_read_from_the_running_service(
    tmp_path: Path, signals: dict[str, float] | None
) -> None:
    """Each session's features from its view over HTTP, and the deployment's from the service's
    own DeploymentSignals (what its predictor reads), equal the training rows'."""
    events = load_events(small_log(tmp_path, signals=signals))
    rows = rows_from_events(events, log_name="events.jsonl")
    if signals is None:  # a deployment that sends none says so
        assert (rows.deployment_signalled_arrival_share == 0.0).all()
    else:
        assert (rows.signals_this_spell > 0).any()
        assert (rows.deployment_signalled_arrival_share > 0).any()
    assert len(rows) > 100
    sample = (
        rows.drop_duplicates(["session_id", "decision_ts"])
        .sample(n=40, random_state=7)
        .sort_values("decision_ts")
    )
    with TestClient(create_app(Settings(data_dir=tmp_path / "svc", log_fsync=False))) as client:
        i = 0
        for _, row in sample.iterrows():
            batch = []
            while i < len(events) and events[i].ts <= row.decision_ts:
                batch.append(orjson.loads(events[i].__pydantic_serializer__.to_json(events[i])))
                i += 1
            for k in range(0, len(batch), 1000):
                assert (
                    client.post("/v1/events", json={"events": batch[k : k + 1000]}).status_code
                    == 200
                )
            view = SessionView.model_validate(client.get(f"/v1/sessions/{row.session_id}").json())
            online = session_features(view, row.decision_ts)
            offline = [row[name] for name in SESSION_FEATURES]
            mismatched = [n for n, a, b in zip(SESSION_FEATURES, online, offline) if not same(a, b)]
            assert not mismatched, f"{row.session_id} at {row.decision_ts}: {mismatched}"
            deployment = client.app.state.engine.deployment.features()  # type: ignore[attr-defined]
            offline_deployment = [row[name] for name in DEPLOYMENT_FEATURES]
            assert all(same(a, b) for a, b in zip(deployment, offline_deployment)), row.decision_ts


def agent_log(tmp_path: Path) -> Path:
    """Generated agent tasks replayed closed-loop with every session's tool calls signalled."""
    trace = agent_trace(AgentWorkload(tasks=60, seconds=240.0, seed=5))
    scenario = load_scenario("agents")
    scenario = scenario.model_copy(
        update={"signals": with_signals(scenario.signals, {"tools": 1.0})}
    )
    result = replay(trace, scenario, keep_events=True)
    path = tmp_path / "agents.jsonl"
    path.write_bytes(encode_events(result.events))
    return path


def test_offline_rows_equal_the_services_features_with_tool_calls_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a log of tool_started/tool_finished signals: every FEATURES column of the training
    rows, the tool features included, equals what the service's predictor reads (its store's
    views, its DeploymentSignals and ToolDurations, fed by its ingest), both by the reference
    and by the FeatureTable; under non-default KVP_TOOLS_* settings, which both sides follow."""
    monkeypatch.setenv("KVP_TOOLS_TRACKED", "3")  # of 8 tools: the rest pooled, on both sides
    events = load_events(agent_log(tmp_path))
    assert any(getattr(e, "kind", None) == "tool_finished" for e in events)
    rows = rows_from_events(events, log_name="agents.jsonl")
    with_tool = rows[rows.tool_remaining_p50_seconds.notna()]
    assert len(with_tool) > 100 and (rows.tool_running_seconds.isna()).any()
    assert set(with_tool.tool_runs_seen) != {0.0}
    sample = (
        pd.concat(
            [
                with_tool.sample(n=40, random_state=3),
                rows[rows.tool_running_seconds.isna()].sample(n=10, random_state=3),
            ]
        )
        .drop_duplicates(["session_id", "decision_ts"])
        .sort_values("decision_ts")
    )
    settings = Settings(data_dir=tmp_path / "svc", log_fsync=False)
    engine = Engine(
        settings,
        store=MemoryStore(bytes_per_token=327_680, block_tokens=512),
        clock=ManualClock(events[-1].ts),
        order_sink=InProcessSink(),
        recover=False,
        load_model=False,
    )
    try:
        assert engine.tools.tracked == 3
        i = 0
        for _, row in sample.iterrows():
            k = i
            while i < len(events) and events[i].ts <= row.decision_ts:
                i += 1
            for j in range(k, i, 500):
                assert not engine.ingest(events[j : min(j + 500, i)]).rejected
            engine.drain()
            view = engine.store.session(row.session_id)
            assert view is not None
            offline = np.array([[row[name] for name in FEATURES]])
            h = [row.horizon_seconds]
            deployment = engine.deployment.features()
            online = feature_matrix([view], row.decision_ts, h, deployment, engine.tools)
            assert_same_features(online, offline)
            table = FeatureTable.from_views([view])
            assert_same_features(
                table.matrix(row.decision_ts, h, deployment=deployment, tools=engine.tools),
                offline,
            )
    finally:
        asyncio.run(engine.close())


def test_labels_look_ahead_and_censored_rows_are_dropped(tmp_path: Path) -> None:
    events = load_events(small_log(tmp_path))
    rows = rows_from_events(events, log_name="x")
    end = events[-1].ts
    assert (rows.decision_ts + rows.horizon_seconds <= end).all()
    assert ((rows.time_to_next_seconds <= rows.horizon_seconds) == (rows.label == 1)).all()
    assert set(rows.horizon_seconds.unique()) <= set(HORIZONS)


def test_feature_matrix_is_sessions_by_horizons() -> None:
    view = SessionView(
        session_id="s",
        state="idle",
        turns=3,
        first_seen_ts=0.0,
        last_activity_ts=100.0,
        closed_ts=None,
        instance_id="g",
        context_tokens=900,
        context_bytes=0,
        block_hashes=[1],
        block_tokens=512,
        recent_arrivals_ts=[0.0, 30.0, 90.0],
        inter_turn_gaps_seconds=[30.0, 60.0],
        last_request=None,
        resident_blocks={},
    )
    x = feature_matrix([view, view], 130.0, [15.0, 60.0])
    assert x.shape == (4, len(FEATURES))
    assert list(x[:, -1]) == [15.0, 60.0, 15.0, 60.0]
    f = dict(zip(FEATURES, x[0]))
    assert (f["idle_seconds"], f["since_arrival_seconds"], f["gap_median_seconds"]) == (
        30.0,
        40.0,
        45.0,
    )
    assert f["idle_over_gap_median"] == 30.0 / 45.0
    assert np.isnan(f["last_prompt_tokens"])


# --- The columnar FeatureTable (and feature_matrix in bulk) equals the reference, session_features.

START_TS = (
    1_767_000_000.0  # a unix time: differences of such timestamps are what the service computes
)


def random_view(rng: random.Random, i: int, *, now: float) -> SessionView:
    """A session in any of the shapes the store produces, edge cases over-represented."""
    kind = rng.choice(
        ["none", "one", "two", "many", "many", "many", "zero_median", "late", "unsorted", "old"]
    )
    n_arrivals = {"none": 0, "one": 1, "two": 2}.get(kind, rng.randint(3, 16))
    last_arrival = now - rng.choice([0.0, rng.uniform(0, 60), rng.lognormvariate(5, 1.5)])
    if kind == "late":  # an arrival after `now`: every age clamps at zero in the reference
        last_arrival = now + rng.uniform(0.001, 500)
    if kind == "old":  # decayed counts far down, into underflow
        last_arrival = now - rng.choice([4e4, 4.3e4, 4.4e5, 1e6])
    arrivals = [last_arrival]
    for _ in range(n_arrivals - 1):
        gap = 0.0 if kind == "zero_median" and rng.random() < 0.7 else rng.lognormvariate(4, 1.5)
        arrivals.insert(0, arrivals[0] - gap)
    if kind == "unsorted":
        rng.shuffle(arrivals)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    state = rng.choice(["idle", "idle", "idle", "running", "queued", "closed"])
    last_activity = (arrivals[-1] if arrivals else now - 100) + rng.choice(
        [0.0, rng.uniform(0, 300)]
    )
    last_request = None
    if rng.random() < 0.8:
        routed = rng.choice([None, last_arrival if arrivals else now - 50])
        finished = rng.choice([None, (routed or now) + rng.uniform(-1, 40)])
        last_request = RequestView(
            request_id=f"r{i}",
            instance_id="gpu-0",
            routed_ts=routed,
            started_ts=None,
            finished_ts=finished,
            prompt_tokens=rng.choice([None, rng.randint(1, 200_000)]),
            output_tokens=rng.choice([None, 0, rng.randint(1, 4000)]),
            context_tokens=None,
        )
    return SessionView(
        session_id=f"s{i}",
        state=state,
        turns=max(n_arrivals, rng.randint(0, 40)),
        first_seen_ts=(arrivals[0] if arrivals else now - 100),
        last_activity_ts=last_activity,
        closed_ts=None,
        instance_id=rng.choice([None, "gpu-1"]),
        context_tokens=rng.randint(0, 300_000),
        context_bytes=0,
        block_hashes=[],
        block_tokens=512,
        recent_arrivals_ts=arrivals,
        inter_turn_gaps_seconds=gaps,
        last_request=last_request,
        resident_blocks={},
        signals=random_signals(rng, arrivals, now),
    )


def random_signals(rng: random.Random, arrivals: list[float], now: float) -> list[SignalView]:
    """Half the sessions have signals: before, between and after their arrivals (and after
    `now`), of known and deployment kinds, with and without tools and estimates."""
    if rng.random() < 0.5:
        return []
    anchors = [*arrivals, now] if arrivals else [now]
    signals = []
    for _ in range(rng.randint(1, RECENT_SIGNALS)):
        ts = rng.choice(anchors) - rng.choice([0.0, rng.uniform(0, 120), -rng.uniform(0, 5)])
        kind = rng.choice([*SIGNAL_KINDS, "tool_started", "custom:reopened"])
        signals.append(
            SignalView(
                ts=max(ts, 0.0),
                kind=kind,
                tool=rng.choice([None, "search", "shell"]) if kind == "tool_started" else None,
                expected_in_seconds=rng.choice([None, 0.0, rng.uniform(0, 30)]),
                expected_prompt_tokens=rng.choice([None, rng.randint(0, 50_000)]),
            )
        )
    return sorted(signals, key=lambda s: s.ts)


def reference(
    views: list[SessionView],
    now: float,
    horizons: tuple[float, ...],
    deployment: list[float] | None = None,
    tools: ToolDurations | None = None,
) -> np.ndarray:
    shared = deployment if deployment is not None else [math.nan] * len(DEPLOYMENT_FEATURES)
    return np.asarray(
        [
            [*session_features(v, now), *shared, *tool, h]
            for v in views
            for tool, h in zip(tool_features(tools, v.session_id, now, horizons), horizons)
        ],
        dtype=np.float64,
    ).reshape(-1, len(FEATURES))


def random_tools(rng: random.Random, session_ids: list[str], now: float) -> ToolDurations:
    """Tool calls of some of the sessions, finished (so the tools have runs) and in flight
    (one or several a session, some longer than any run of their tool seen), before `now`."""
    tools = ToolDurations(tracked=2)
    events: list[Event] = []
    n = iter(range(10**6))
    for session_id in rng.sample(session_ids, len(session_ids) // 2):
        for _ in range(rng.randint(1, 3)):
            start = now - rng.uniform(0, 600)
            tool = rng.choice(["bash", "grep", "build", None])
            events.append(signal(session_id, start, "tool_started", tool, next(n)))
            if rng.random() < 0.5:
                back = start + rng.lognormvariate(1, 1)
                events.append(signal(session_id, back, "tool_finished", tool, next(n)))
    tools.observe(sorted(events, key=lambda e: e.ts))
    return tools


def signal(session_id: str, ts: float, kind: str, tool: str | None, n: int) -> SessionSignal:
    return SessionSignal(event_id=f"t{n}", ts=ts, session_id=session_id, kind=kind, tool=tool)


def assert_same_features(fast: np.ndarray, ref: np.ndarray) -> None:
    # rtol 1e-9: a decayed count is rescaled from its value at the newest arrival (one multiply
    # instead of one exp per arrival), equal to the reference within a few ulps. atol 1e-300: below
    # it a double is subnormal and keeps no relative precision, in either computation.
    assert fast.shape == ref.shape
    np.testing.assert_array_equal(np.isnan(fast), np.isnan(ref))
    np.testing.assert_allclose(fast, ref, rtol=1e-9, atol=1e-300)


HORIZON_SETS = [
    (30.0, 300.0, 900.0),
    (5.0, 15.0, 30.0, 60.0, 120.0, 180.0, 300.0, 600.0, 900.0),
    (600.0,),
]


@pytest.mark.parametrize("seed", range(4))
def test_feature_table_and_bulk_feature_matrix_equal_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    now = START_TS + rng.uniform(0, 1e6)
    views = [random_view(rng, i, now=now) for i in range(600)]
    table = FeatureTable.from_views(views)
    one_by_one = FeatureTable(capacity=1)  # grows as it goes
    for view in views:
        one_by_one.upsert(view)
    assert table.session_ids == one_by_one.session_ids == [v.session_id for v in views]
    for at in (now, now + rng.uniform(0, 3600), now - 400):  # the last: many arrivals after `now`
        for horizons in HORIZON_SETS:
            ref = reference(views, at, horizons)
            assert_same_features(table.matrix(at, horizons), ref)
            assert_same_features(one_by_one.matrix(at, horizons), ref)
            assert_same_features(feature_matrix(views, at, horizons), ref)
            assert_same_features(feature_matrix(views[:5], at, horizons), ref[: 5 * len(horizons)])
        # The deployment's, in every row: shares, a rate, and kinds never seen (NaN).
        shared = [rng.random(), rng.uniform(0, 3)]
        shared += [rng.choice([rng.random(), math.nan]) for _ in DEPLOYMENT_FEATURES[2:]]
        ref = reference(views, at, HORIZON_SETS[0], shared)
        assert_same_features(table.matrix(at, HORIZON_SETS[0], deployment=shared), ref)
        assert_same_features(feature_matrix(views, at, HORIZON_SETS[0], shared), ref)
        assert_same_features(feature_matrix(views[:5], at, HORIZON_SETS[0], shared), ref[:15])
        # The tool calls in flight of some sessions: whichever the table walks (the sessions in
        # flight, or the rows asked: fewer than those in flight), the reference's numbers.
        tools = random_tools(rng, [v.session_id for v in views], now)
        ref = reference(views, at, HORIZON_SETS[1], shared, tools)
        x = table.matrix(at, HORIZON_SETS[1], deployment=shared, tools=tools)
        assert_same_features(x, ref)
        assert not np.isnan(x[:, FEATURES.index(TOOL_FEATURES[0])]).all()
        assert_same_features(feature_matrix(views, at, HORIZON_SETS[1], shared, tools), ref)
        k = len(HORIZON_SETS[1])
        assert_same_features(
            feature_matrix(views[:5], at, HORIZON_SETS[1], shared, tools), ref[: 5 * k]
        )
        rows = np.array([rng.randrange(len(views)) for _ in range(400)])  # repeats among them
        few = np.array([3, 1, 3])
        for asked in (rows, few):
            by_row = ref.reshape(len(views), k, -1)[asked].reshape(-1, len(FEATURES))
            assert_same_features(table.matrix(at, HORIZON_SETS[1], asked, shared, tools), by_row)
    assert table.closed().tolist() == [v.state == "closed" for v in views]


def test_feature_table_follows_upserts_and_removals() -> None:
    rng = random.Random(11)
    now = START_TS
    table = FeatureTable(capacity=4)
    current: dict[str, SessionView] = {}
    for _ in range(3000):
        i = rng.randrange(200)
        sid = f"s{i}"
        if sid in current and rng.random() < 0.3:
            assert table.remove(sid)
            del current[sid]
        else:
            view = random_view(rng, i, now=now)
            current[sid] = view
            if rng.random() < 0.5:
                table.upsert(view)
            else:
                table.upsert_many([view, current[rng.choice(list(current))]])
        now += rng.uniform(0, 5)
    assert not table.remove("never-seen")
    assert len(table) == len(current) and sorted(table.session_ids) == sorted(current)
    views = [current[s] for s in table.session_ids]
    assert_same_features(table.matrix(now, HORIZON_SETS[0]), reference(views, now, HORIZON_SETS[0]))
    some = rng.sample(sorted(current), 25)
    rows = table.rows_of(some)
    assert [table.session_ids[r] for r in rows] == some
    some_views = [current[s] for s in some]
    assert_same_features(
        table.matrix(now, HORIZON_SETS[1], rows), reference(some_views, now, HORIZON_SETS[1])
    )
    assert table.closed(rows).tolist() == [v.state == "closed" for v in some_views]


def test_feature_table_edge_cases_read_as_the_reference_says() -> None:
    now = START_TS + 1000
    bare = SessionView(
        session_id="bare",
        state="running",
        turns=0,
        first_seen_ts=now - 10,
        last_activity_ts=now + 5,
        closed_ts=None,
        instance_id=None,
        context_tokens=0,
        context_bytes=0,
        block_hashes=[],
        block_tokens=512,
        recent_arrivals_ts=[],
        inter_turn_gaps_seconds=[],
        last_request=None,
        resident_blocks={},
    )
    zero = bare.model_copy(
        update={
            "session_id": "zero",
            "state": "idle",
            "recent_arrivals_ts": [now - 50, now - 50],
            "inter_turn_gaps_seconds": [0.0],
            "last_activity_ts": now - 40,
        }
    )
    table = FeatureTable.from_views([bare, zero])
    x = table.matrix(now, [60.0])
    f = [dict(zip(FEATURES, row)) for row in x]
    assert f[0]["idle_seconds"] == 0.0 and f[0]["running"] == 1.0  # activity after `now` clamps
    assert np.isnan(f[0]["since_arrival_seconds"]) and np.isnan(f[0]["gap_median_seconds"])
    assert f[0]["arrivals_decayed_60s"] == 0.0 and f[0]["arrivals_decayed_600s"] == 0.0
    assert f[1]["gap_median_seconds"] == 0.0 and np.isnan(
        f[1]["idle_over_gap_median"]
    )  # no division by 0
    assert f[1]["arrivals_decayed_60s"] == pytest.approx(2 * math.exp(-50 / 60), rel=1e-12)
    assert_same_features(x, reference([bare, zero], now, (60.0,)))
    assert table.matrix(now, [60.0], np.zeros(0, dtype=np.intp)).shape == (0, len(FEATURES))
    assert FeatureTable().matrix(now, [60.0]).shape == (0, len(FEATURES))
    assert feature_matrix([], now, [60.0]).shape == (0, len(FEATURES))
