"""Predictors and the planner: advice in the transfer layers' vocabulary (keep, demote,
prefetch)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from app.core.bundle import DEFAULT_MODEL_DIR
from app.decide.advisor import GRID_SECONDS, Advisor
from app.decide.routing import SameInstanceEstimate
from app.predict.features import FEATURES
from app.predict.predictors import (
    HORIZON_GRID,
    HeuristicPredictor,
    LearnedPredictor,
    ModelError,
)
from app.state.base import SessionView


def view(
    session_id: str,
    *,
    state: str = "idle",
    last: float = 100.0,
    gaps: list[float] | None = None,
    blocks: list[int] | None = None,
) -> SessionView:
    gaps = gaps or []
    arrivals = [last - sum(gaps[i:]) for i in range(len(gaps))] + [last]
    return SessionView(
        session_id=session_id,
        state=state,
        turns=len(arrivals),
        first_seen_ts=arrivals[0],
        last_activity_ts=last,
        closed_ts=None,
        instance_id="gpu-0",
        context_tokens=1000,
        context_bytes=0,
        block_hashes=blocks if blocks is not None else [1, 2],
        block_tokens=512,
        recent_arrivals_ts=arrivals,
        inter_turn_gaps_seconds=gaps,
        last_request=None,
        resident_blocks={},
    )


class Fixed:
    """P(within h) = the session's fixed chance, for every h at or past its due time."""

    name = "fixed"

    def __init__(self, chances: dict[str, tuple[float, float]]) -> None:
        self.chances = chances  # session -> (p, due in seconds)

    def p_within(
        self, sessions: Sequence[SessionView], now: float, horizons: Sequence[float]
    ) -> np.ndarray:
        return np.array(
            [
                [p if h >= due else 0.0 for h in horizons]
                for p, due in (self.chances[s.session_id] for s in sessions)
            ]
        )


def test_planner_keeps_demotes_prefetches_and_leaves_the_rest_to_lru() -> None:
    planner = Advisor(
        Fixed(
            {
                "soon": (0.9, 10.0),
                "later": (0.3, 200.0),
                "maybe": (0.15, 800.0),
                "gone": (0.05, 5.0),
            }
        )
    )
    advice = {
        a.session_id: a
        for a in planner.advise([view(s) for s in ("soon", "later", "maybe", "gone")], 100.0)
    }
    assert {s: a.retention for s, a in advice.items()} == {
        "soon": "keep",
        "later": "keep",
        "maybe": "lru",
        "gone": "demote",
    }
    assert {s for s, a in advice.items() if a.prefetch} == {"soon"}
    assert advice["soon"].keep_seconds == 300.0 and advice["maybe"].keep_seconds == 0.0
    assert (advice["later"].p_keep, advice["later"].p_soon, advice["later"].p_return) == (
        0.3,
        0.0,
        0.3,
    )
    assert advice["soon"].block_hashes == (1, 2)


def test_planner_scores_only_idle_recent_sessions_with_a_context() -> None:
    planner = Advisor(Fixed(dict.fromkeys(("a", "b", "c", "d"), (0.9, 0.0))))
    sessions = [
        view("a"),
        view("b", state="running"),
        view("c", last=-5000.0),
        view("d", blocks=[]),
    ]
    assert [a.session_id for a in planner.advise(sessions, 100.0)] == ["a"]
    assert planner.advise([], 0.0) == []


class Recording(Fixed):
    def __init__(self, chances: dict[str, tuple[float, float]]) -> None:
        super().__init__(chances)
        self.asked: list[tuple[float, ...]] = []

    def p_within(
        self, sessions: Sequence[SessionView], now: float, horizons: Sequence[float]
    ) -> np.ndarray:
        self.asked.append(tuple(horizons))
        return super().p_within(sessions, now, horizons)


def test_planner_asks_its_three_horizons_and_the_curve_grid_below_the_lead() -> None:
    predictor = Recording({"a": (0.9, 0.0)})
    Advisor(
        predictor, lead_seconds=20.0, keep_horizon_seconds=200.0, return_horizon_seconds=1000.0
    ).advise([view("a")], 100.0)
    grid = tuple(h for h in GRID_SECONDS if h < 20.0)
    assert predictor.asked == [tuple(sorted({*grid, 20.0, 200.0, 1000.0}))]
    with pytest.raises(
        ValueError, match="lead_seconds <= keep_horizon_seconds <= return_horizon_seconds"
    ):
        Advisor(predictor, lead_seconds=400.0)


def test_a_router_that_moves_sessions_makes_keeping_worth_less() -> None:
    routes = SameInstanceEstimate(prior=1.0, prior_weight=1.0, half_life_returns=1e9)
    planner = Advisor(Fixed({"a": (0.9, 10.0)}), routes=routes)
    assert planner.advise([view("a")], 100.0)[0].retention == "keep"
    for i in range(99):
        routes.observe("gpu-0", f"gpu-{1 + i % 3}")  # never back on the same instance
    advice = planner.advise([view("a")], 100.0)[0]
    assert advice.p_keep == pytest.approx(0.9 * routes.p_same)
    assert (advice.retention, advice.prefetch) == ("demote", False)


def test_heuristic_expects_the_median_gap_and_gives_up_three_gaps_late() -> None:
    h = HeuristicPredictor()
    sessions = [
        view("due", last=100.0, gaps=[50.0, 70.0]),
        view("late", last=100.0, gaps=[9.0]),
        view("new", last=100.0),
    ]
    p = h.p_within(sessions, 130.0, [15.0, 60.0, 600.0])
    assert p[0].tolist() == [0.0, 0.6, 0.6]  # due at 160: within 60 s of 130, not within 15
    assert p[1].tolist() == [0.0, 0.0, 0.0]  # 30 s since its last turn on a 9 s habit: gone
    assert p[2].tolist() == [
        0.0,
        0.0,
        0.4,
    ]  # no gap yet: due at 200 by the 100 s prior, a lower chance
    closed = view("closed", state="closed")
    assert h.p_within([closed], 100.0, [600.0]).tolist() == [[0.0]]


def test_the_bundled_model_loads_and_answers_for_every_horizon() -> None:
    model = LearnedPredictor(DEFAULT_MODEL_DIR)
    assert model.version == "default" and model.card["features"] == list(model.feature_names)
    assert set(model.feature_names) <= set(FEATURES)
    sessions = [view("a", gaps=[30.0, 40.0]), view("b"), view("c", state="closed")]
    p = model.p_within(sessions, 130.0, HORIZON_GRID)
    assert p.shape == (3, len(HORIZON_GRID))
    assert ((p >= 0) & (p <= 1)).all() and p[2].tolist() == [0.0] * len(HORIZON_GRID)


def test_a_model_that_is_missing_or_computes_other_features_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no model at"):
        LearnedPredictor(tmp_path)
    (tmp_path / "model.txt").write_text("not a model")
    with pytest.raises(ModelError, match="does not load"):
        LearnedPredictor(tmp_path)
    import lightgbm as lgb

    x = np.random.default_rng(0).random((200, 2))
    booster = lgb.train(
        {"objective": "binary", "verbose": -1},
        lgb.Dataset(x, label=(x[:, 0] > 0.5).astype(int), feature_name=["idle_seconds", "other"]),
        num_boost_round=2,
    )
    booster.save_model(str(tmp_path / "model.txt"))
    with pytest.raises(ModelError, match="was trained on features"):
        LearnedPredictor(tmp_path)


def test_a_return_due_within_seconds_is_needed_at_once_and_a_vague_one_later() -> None:
    # "signalled": all of its chance comes within 2 s (a signal with a short lead); "vague": the
    # same chance spread over the lead (due at 30 s).
    planner = Advisor(Fixed({"signalled": (0.9, 2.0), "vague": (0.9, 30.0)}))
    advice = {a.session_id: a for a in planner.advise([view("signalled"), view("vague")], 100.0)}
    assert advice["signalled"].needed_in_seconds is not None
    assert advice["vague"].needed_in_seconds is not None
    assert advice["signalled"].needed_in_seconds <= 0.2 * 2.0
    assert advice["vague"].needed_in_seconds > 10.0 * advice["signalled"].needed_in_seconds
    assert advice["vague"].needed_in_seconds <= 30.0


def test_a_queued_request_s_context_is_fetched_at_once_without_asking_the_model() -> None:
    predictor = Recording({"idle": (0.0, 0.0)})
    advice = {
        a.session_id: a
        for a in Advisor(predictor).advise(
            [view("idle"), view("waiting", state="queued"), view("busy", state="running")], 100.0
        )
    }
    assert set(advice) == {"idle", "waiting"}
    waiting = advice["waiting"]
    assert waiting.queued and waiting.prefetch and waiting.retention == "lru"
    assert (waiting.p_soon, waiting.needed_in_seconds) == (1.0, 0.0)
    assert not advice["idle"].queued
    assert len(predictor.asked) == 1  # for the idle session alone


def test_a_long_idle_session_is_scored_again_when_a_signal_comes() -> None:
    from app.state.base import SignalView

    planner = Advisor(Fixed({"back": (0.9, 10.0)}))
    quiet = view("back", last=-5000.0)
    assert planner.advise([quiet], 100.0) == []  # idle past what the planner looks at
    signalled = quiet.model_copy(update={"signals": [SignalView(ts=98.0, kind="opened")]})
    (advice,) = planner.advise([signalled], 100.0)
    assert advice.prefetch
    stale = quiet.model_copy(update={"signals": [SignalView(ts=20.0, kind="opened")]})
    assert planner.advise([stale], 100.0) == []  # a signal older than the lead says little


def test_a_fresh_signal_is_at_least_as_sure_as_its_kind_has_been_here() -> None:
    """The model under-reads a kind far more reliable in this deployment than in its training
    (it saw `opened` mostly as a false alarm): the deployment's record for the kind is a floor,
    for a signal this idle spell within the lead, and an unreliable kind lifts nothing."""
    from app.predict.features import DeploymentSignals
    from app.state.base import SignalView

    deployment = DeploymentSignals(window_seconds=1e12)
    for i in range(40):  # here, opened is always followed; typing, one time in ten
        deployment.signal(f"o{i}", 10.0 * i, "opened")
        deployment.arrival(f"o{i}", 10.0 * i + 3.0)
        deployment.signal(f"t{i}", 10.0 * i, "typing")
        if i % 10 == 0:
            deployment.arrival(f"t{i}", 10.0 * i + 3.0)
    planner = Advisor(Fixed({"s": (0.2, 10.0)}), deployment=deployment)
    quiet = view("s", last=950.0)

    def advice_with(kind: str, ts: float) -> tuple[float, bool, float | None]:
        v = quiet.model_copy(update={"signals": [SignalView(ts=ts, kind=kind)]})
        (a,) = planner.advise([v], 1000.0)
        return a.p_soon, a.prefetch, a.needed_in_seconds

    p, prefetch, needed_in = advice_with("opened", 998.0)
    assert p == deployment.followed_lower_bound("opened") and 0.9 < p < 1.0
    assert prefetch and needed_in == 0.0  # fetched at once
    assert advice_with("typing", 998.0)[:2] == (0.2, False)  # the model's own reading stands
    assert advice_with("opened", 900.0)[:2] == (0.2, False)  # older than the lead
    assert advice_with("opened", 940.0)[:2] == (0.2, False)  # before the last request: spent
    assert (
        Advisor(Fixed({"s": (0.2, 10.0)}))
        .advise(
            [quiet.model_copy(update={"signals": [SignalView(ts=998.0, kind="opened")]})], 1000.0
        )[0]
        .p_soon
        == 0.2
    )  # no deployment record: no floor


def test_a_signal_keeps_a_resident_context_until_the_turn_it_announces() -> None:
    """A context already resident has nothing to fetch: the signal's floor lifts its keep too, so
    it is pinned rather than left to LRU in the seconds before the turn."""
    from app.predict.features import DeploymentSignals
    from app.state.base import SignalView

    deployment = DeploymentSignals(window_seconds=1e12)
    for i in range(40):
        deployment.signal(f"o{i}", 10.0 * i, "opened")
        deployment.arrival(f"o{i}", 10.0 * i + 3.0)
    planner = Advisor(Fixed({"s": (0.05, 10.0)}), deployment=deployment)
    quiet = view("s", last=950.0)
    (unsignalled,) = planner.advise([quiet], 1000.0)
    assert unsignalled.retention != "keep"
    signalled = quiet.model_copy(update={"signals": [SignalView(ts=998.0, kind="opened")]})
    (a,) = planner.advise([signalled], 1000.0)
    assert a.retention == "keep" and a.keep_seconds > 0
    assert a.p_keep >= a.p_soon == deployment.followed_lower_bound("opened")
    assert a.p_return >= a.p_keep


def test_a_router_that_spreads_returns_prices_a_prefetch_lower_but_does_not_void_it() -> None:
    """Least-loaded routing over four instances: a return lands on the last instance about one
    time in four, still the likeliest single place. A session surely back soon is a prefetch
    candidate there, worth its routed chance (`p_soon`); the bar is on it being back at all."""
    routes = SameInstanceEstimate(prior=1.0, prior_weight=1.0, half_life_returns=1e9)
    for i in range(400):
        routes.observe("gpu-0", f"gpu-{i % 4}")  # a quarter back on the same instance
    assert routes.last_is_likeliest and routes.p_same == pytest.approx(0.25, abs=0.01)
    planner = Advisor(Fixed({"a": (0.9, 1.0), "b": (0.3, 1.0)}), routes=routes)
    advice = {a.session_id: a for a in planner.advise([view("a"), view("b")], 100.0)}
    a = advice["a"]
    assert a.prefetch and a.p_routed == pytest.approx(routes.p_same)
    assert a.p_soon == pytest.approx(0.9 * routes.p_same) and a.p_back_soon == pytest.approx(0.9)
    assert not advice["b"].prefetch  # not likely back at all: below prefetch_min_p (0.35)


def test_a_session_whose_tool_call_is_in_flight_is_advised_by_its_tools_run_times() -> None:
    """The model (and a signal's floor) read a session as back within seconds; its `build` call,
    which takes 100 to 200 s here, has run 10 s: nothing to prefetch within the lead, and kept
    only as surely as the call returns within the keep horizon. Near its usual end the call
    is back within the lead: prefetched. A session with no call in flight keeps the model's."""
    from app.predict.features import DeploymentSignals
    from app.predict.tool_durations import ToolDurations
    from app.state.base import SignalView
    from kvprefetch_client.events import SessionSignal

    def signal(session: str, ts: float, kind: str) -> SessionSignal:
        return SessionSignal(
            event_id=f"{session}-{kind}-{ts}", ts=ts, session_id=session, kind=kind, tool="build"
        )

    tools = ToolDurations()
    for k in range(20):
        tools.observe([signal(f"x{k}", 10.0 * k, "tool_started")])
        tools.observe([signal(f"x{k}", 10.0 * k + 100.0 + 5.0 * k, "tool_finished")])
    tools.observe([signal("s", 990.0, "tool_started")])
    deployment = DeploymentSignals(window_seconds=1e12)
    for i in range(40):  # a tool_started signal has always been followed here
        deployment.signal(f"o{i}", 10.0 * i, "tool_started")
        deployment.arrival(f"o{i}", 10.0 * i + 3.0)
    planner = Advisor(Fixed({"s": (0.9, 1.0), "t": (0.9, 1.0)}), tools=tools, deployment=deployment)
    signalled = [SignalView(ts=990.0, kind="tool_started")]
    s = view("s", last=980.0).model_copy(update={"signals": signalled})
    a, b = planner.advise([s, view("t", last=980.0)], 1000.0)
    build = tools.distribution("build")
    assert a.p_soon == pytest.approx(build.p_within(planner.lead_seconds, 10.0))
    assert a.p_soon == 0.0
    assert not a.prefetch
    assert a.p_keep == pytest.approx(build.p_within(planner.keep_horizon_seconds, 10.0))
    assert (b.p_soon, b.prefetch) == (0.9, True)  # the model's own
    (late,) = planner.advise([s], 990.0 + 180.0)
    assert late.p_soon == pytest.approx(build.p_within(planner.lead_seconds, 180.0))
    assert late.p_soon > 0.5
    assert late.prefetch and 0.0 < late.needed_in_seconds < planner.lead_seconds
