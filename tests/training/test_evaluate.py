"""training.evaluate: the replay judgement of a model on the last part of a trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.core.bundle import DEFAULT_MODEL_DIR, model_identity
from tests.conftest import trace_slice
from training import evaluate


def test_every_policy_is_judged_on_the_same_window_with_the_gaps_closed(tmp_path: Path) -> None:
    trace = trace_slice(tmp_path, "conversation_first60", 600)
    r = evaluate(DEFAULT_MODEL_DIR, trace, "default", router="sticky", train_fraction=0.7)
    assert list(r["policies"]) == [
        "none",
        "lookahead",
        "heuristic",
        "clairvoyant",
        "oracle",
        "learned",
    ]
    assert (r["trace"], r["scenario"], r["router"]) == (trace.name, "default", "sticky")
    s = r["policies"]
    assert len({p["requests"] for p in s.values()}) == 1  # one judged window for all
    gap = s["oracle"]["byte_hit_rate"] - s["none"]["byte_hit_rate"]
    assert gap > 0
    assert r["gap_closed"] == round(
        (s["learned"]["byte_hit_rate"] - s["none"]["byte_hit_rate"]) / gap, 4
    )
    assert r["gap_closed_by_a_perfect_model"] == round(
        (s["clairvoyant"]["byte_hit_rate"] - s["none"]["byte_hit_rate"]) / gap, 4
    )
    gap = s["oracle"]["byte_hit_rate_unshared"] - s["none"]["byte_hit_rate_unshared"]
    assert gap > 0
    assert r["gap_closed_unshared"] == round(
        (s["learned"]["byte_hit_rate_unshared"] - s["none"]["byte_hit_rate_unshared"]) / gap, 4
    )
    assert r["gap_closed_by_a_perfect_model_unshared"] == round(
        (s["clairvoyant"]["byte_hit_rate_unshared"] - s["none"]["byte_hit_rate_unshared"]) / gap,
        4,
    )


def test_without_the_three_policies_there_is_no_gap_to_report(tmp_path: Path) -> None:
    trace = trace_slice(tmp_path, "synthetic", 300)
    r = evaluate(DEFAULT_MODEL_DIR, trace, policies=("none", "heuristic"))
    assert list(r["policies"]) == ["none", "heuristic"] and "gap_closed" not in r


def test_the_result_names_the_model_and_the_split(tmp_path: Path) -> None:
    trace = trace_slice(tmp_path, "synthetic", 300)
    r = evaluate(DEFAULT_MODEL_DIR, trace, policies=("none", "learned"), train_fraction=0.6)
    named = model_identity(DEFAULT_MODEL_DIR)
    assert named["card_sha256"] is not None
    assert (r["model"], r["train_fraction"]) == (named, 0.6)
    learned = r["policies"]["learned"]
    assert learned["model"] == {**named, "serving": "learned (default)"}
    assert learned["measure_from_seconds"] == pytest.approx(r["judged_from_seconds"], abs=1e-3)
    assert "model" not in r["policies"]["none"]  # it ran no model
