"""The paired judge of a shadow against the serving model (app/observe/judge.py): outcomes, the
Brier scores, the paired standard error and the verdict."""

from __future__ import annotations

import math
import random

import numpy as np

from app.decide.advisor import SessionAdvice
from app.observe.judge import JudgeStats, PairedJudge, verdict
from app.observe.ledger import AdviceLedger
from kvprefetch_client.events import event_adapter

H = 60.0


def test_outcomes_count_once_the_horizon_has_passed() -> None:
    judge = PairedJudge(H)
    judge.pair("back", 0.0, 0.8, 0.6)  # back within the horizon: 1
    judge.pair("late", 0.0, 0.3, 0.1)  # back after it: 0
    judge.pair("gone", 0.0, 0.5, 0.2)  # closed: 0
    judge.pair("quiet", 0.0, 0.4, 0.4)  # nothing within it: 0
    judge.arrived("back", 30.0)
    judge.closed("gone")
    # A return counts only once its horizon has passed, as the zeros do.
    judge.advance(H)
    assert judge.stats().judged == 0
    judge.advance(H + 1.0)
    judge.arrived("late", H + 1.0)  # its pair already counted 0 when the horizon passed
    stats = judge.stats()
    assert stats.judged == 4 and stats.pending == 0
    live = [(0.8 - 1) ** 2, 0.3**2, 0.5**2, 0.4**2]
    shadow = [(0.6 - 1) ** 2, 0.1**2, 0.2**2, 0.4**2]
    assert math.isclose(stats.live_brier or 0, sum(live) / 4)
    assert math.isclose(stats.shadow_brier or 0, sum(shadow) / 4)
    gains = np.array(live) - np.array(shadow)
    assert math.isclose(stats.mean_gain or 0, gains.mean())
    assert math.isclose(stats.gain_se or 0, gains.std(ddof=1) / math.sqrt(4))


def test_one_open_pair_per_session_and_advice_after_the_arrival_is_not_a_forecast() -> None:
    judge = PairedJudge(H)
    judge.pair("s", 0.0, 0.9, 0.1)
    judge.pair("s", 1.0, 0.0, 1.0)  # the first pair is still open: ignored
    judge.arrived("s", 10.0)
    judge.pair("s", 12.0, 0.5, 0.5)  # a new pair after the arrival
    judge.arrived("s", 11.0)  # stamped before that advice (a late event): no outcome of it
    judge.advance(1000.0)
    stats = judge.stats()
    assert stats.judged == 1
    assert math.isclose(stats.live_brier or 0, 0.1**2)
    assert math.isclose(stats.shadow_brier or 0, 0.9**2)


def test_the_paired_standard_error_matches_numpy_on_random_pairs() -> None:
    rng = random.Random(7)
    judge = PairedJudge(H)
    live, shadow = [], []
    for i in range(500):
        p_live, p_shadow, back = rng.random(), rng.random(), rng.random() < 0.3
        judge.pair(f"s{i}", float(i), p_live, p_shadow)
        if back:
            judge.arrived(f"s{i}", i + 10.0)
        y = 1.0 if back else 0.0
        live.append((p_live - y) ** 2)
        shadow.append((p_shadow - y) ** 2)
    judge.advance(10_000.0)
    stats = judge.stats()
    gains = np.array(live) - np.array(shadow)
    assert stats.judged == 500
    assert math.isclose(stats.mean_gain or 0, gains.mean(), rel_tol=1e-9)
    assert math.isclose(stats.gain_se or 0, gains.std(ddof=1) / math.sqrt(500), rel_tol=1e-9)


def _judged(
    p_live: float | list[float], p_shadow: float | list[float], outcomes: list[int]
) -> JudgeStats:
    judge = PairedJudge(H)
    n = len(outcomes)
    lives = p_live if isinstance(p_live, list) else [p_live] * n
    shadows = p_shadow if isinstance(p_shadow, list) else [p_shadow] * n
    for i, (a, b, y) in enumerate(zip(lives, shadows, outcomes)):
        judge.pair(f"s{i}", 0.0, a, b)
        if y:
            judge.arrived(f"s{i}", 1.0)
    judge.advance(2 * H)
    return judge.stats()


def test_keeping_everything_does_not_win() -> None:
    # Three sessions in ten come back. "Keep everything" (p = 1) gets every hit the ledger
    # counts; a calibrated model (p = 0.3) has the better Brier score, and is not replaced by it.
    rng = random.Random(1)
    outcomes = [1 if rng.random() < 0.3 else 0 for _ in range(1000)]
    keep_all_shadow = _judged(0.3, 1.0, outcomes)
    assert verdict(keep_all_shadow, min_judged=100, margin=0.02) == "discard"
    calibrated_shadow = _judged(1.0, 0.3, outcomes)
    assert verdict(calibrated_shadow, min_judged=100, margin=0.02) == "promote"


def test_the_verdict_needs_enough_outcomes_the_margin_and_two_standard_errors() -> None:
    rng = random.Random(3)
    outcomes = [1 if rng.random() < 0.3 else 0 for _ in range(400)]
    better = _judged(0.5, 0.3, outcomes)  # calibrated against a worse constant
    assert better.mean_gain is not None and better.mean_gain > 0
    assert verdict(better, min_judged=100, margin=0.02) == "promote"
    assert verdict(better, min_judged=1000, margin=0.02) == "wait"  # too few outcomes
    # Better, but by less than the margin asks: wait (the caller discards when time is up).
    assert better.live_brier is not None
    share = better.mean_gain / better.live_brier
    assert verdict(better, min_judged=100, margin=share * 1.5) == "wait"
    # Better by the margin on a handful of outcomes, but not by two standard errors: wait.
    noisy = _judged([0.9, 0.1, 0.6, 0.5], [0.1, 0.9, 0.4, 0.5], [0, 0, 0, 1])
    assert noisy.mean_gain is not None and noisy.gain_se is not None
    assert 0 < noisy.mean_gain < 2 * noisy.gain_se
    assert verdict(noisy, min_judged=2, margin=0.0) == "wait"
    # The same models in both slots: never promoted.
    same = _judged(0.3, 0.3, outcomes)
    assert verdict(same, min_judged=100, margin=0.0) == "wait"


def test_pairs_waiting_are_bounded() -> None:
    judge = PairedJudge(H, max_pending=10)
    for i in range(25):
        judge.pair(f"s{i}", float(i), 0.5, 0.5)
    stats = judge.stats()
    assert stats.pending == 10 and stats.dropped == 15
    for i in range(15, 25):
        judge.arrived(f"s{i}", 30.0)
    for i in range(25, 35):
        judge.pair(f"s{i}", 31.0, 0.5, 0.5)
    judge.arrived("s25", 32.0)  # the 11th resolved pair: the oldest resolved one counts early
    stats = judge.stats()
    assert stats.judged == 1 and stats.pending == 9 + 10 and stats.dropped == 15


def _advice(session_id: str, p_keep: float) -> SessionAdvice:
    return SessionAdvice(session_id, "gpu-0", (1,), "keep", 60.0, p_keep, 0.1, 0.9, False)


def test_the_ledger_pairs_the_shadow_with_the_serving_model_of_the_same_tick() -> None:
    ledger = AdviceLedger(judge_horizon_seconds=H)
    ledger.start("shadow")
    ledger.record("live", [_advice("a", 0.9), _advice("b", 0.2)], 0.0)
    ledger.record("shadow", [_advice("a", 0.6), _advice("b", 0.1)], 0.0)
    ledger.record("live", [_advice("c", 0.5)], 1.0)
    ledger.record("shadow", [_advice("c", 0.5)], 2.0)  # another tick's: no pair
    routed = event_adapter.validate_python(
        {
            "type": "request_routed",
            "event_id": "r1",
            "ts": 20.0,
            "session_id": "a",
            "request_id": "a-1",
            "instance_id": "gpu-0",
            "prompt_tokens": 10,
            "block_hashes": [1],
        }
    )
    later = event_adapter.validate_python(
        {"type": "session_closed", "event_id": "c1", "ts": 200.0, "session_id": "zz"}
    )
    ledger.observe([routed, later])
    stats = ledger.judge.stats()
    assert stats.judged == 2
    assert math.isclose(stats.live_brier or 0, ((0.9 - 1) ** 2 + 0.2**2) / 2)
    assert math.isclose(stats.shadow_brier or 0, ((0.6 - 1) ** 2 + 0.1**2) / 2)
    # A model swapped into either slot starts the judge afresh.
    ledger.start("live")
    assert ledger.judge.stats().judged == 0
