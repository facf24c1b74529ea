"""Training learns from signals: decision points at signals, follow-through on the model card,
and a kind that cries wolf is learned to be unreliable."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.ingest.eventlog import encode_events
from app.predict.feature_table import feature_matrix
from app.predict.features import DeploymentSignals
from app.state import MemoryStore
from app.state.base import SessionView, SignalView
from kvprefetch_client.events import (
    Event,
    RequestFinished,
    RequestRouted,
    SessionSignal,
)
from training import dataset
from training.dataset import build_dataset, rows_from_events, signal_follow_through
from training.train import save_model, train


def chat_with_signals(sessions: int = 120, seed: int = 0) -> list[Event]:
    """Conversations whose returns are announced by `typing` 2-8 s ahead (80% of them), and
    `opened` signals that are mostly false alarms (the user looks and leaves)."""
    rng = random.Random(seed)
    events: list[Event] = []
    n = 0

    def add(e: type, **fields: object) -> None:
        nonlocal n
        n += 1
        events.append(e(event_id=f"e{n}", **fields))

    for s in range(sessions):
        sid = f"s{s}"
        t = rng.uniform(0, 600)
        turns = rng.randint(3, 8)
        for turn in range(turns):
            rid = f"{sid}-r{turn}"
            add(
                RequestRouted,
                ts=t,
                session_id=sid,
                request_id=rid,
                instance_id="gpu-0",
                prompt_tokens=1000 * (turn + 1),
            )
            t += rng.uniform(2, 10)
            add(
                RequestFinished,
                ts=t,
                session_id=sid,
                request_id=rid,
                instance_id="gpu-0",
                output_tokens=200,
            )
            gap = rng.lognormvariate(np.log(120.0), 1.0)
            if turn == turns - 1:
                gap = 1e5  # gone: the opened below is the last word, a false alarm
            if rng.random() < 0.6:  # a false alarm early in the silence, far from the return
                when = rng.uniform(0, max(gap - 70.0, 0.0))
                if gap - when > 70.0:
                    add(SessionSignal, ts=t + when, session_id=sid, kind="opened")
            if rng.random() < 0.8 and turn < turns - 1:
                add(SessionSignal, ts=t + gap - rng.uniform(2, 8), session_id=sid, kind="typing")
            t += gap
    events.sort(key=lambda e: e.ts)
    return events


def test_signals_are_decision_points_and_their_follow_through_is_counted() -> None:
    events = chat_with_signals(40)
    counts = signal_follow_through(events)
    assert counts["typing"]["followed"] == counts["typing"]["signals"] > 0
    assert counts["opened"]["followed"] == 0 < counts["opened"]["signals"]
    rows = rows_from_events(events, log_name="x")
    anchors = set(rows.anchor)
    assert {"finish", "signal:typing", "signal:opened"} <= anchors
    at_typing = rows[(rows.anchor == "signal:typing") & (rows.checkpoint_seconds == 0.0)]
    assert (at_typing.signals_this_spell >= 1).all()
    assert (at_typing.since_typing_signal_seconds == 0.0).all()
    assert (at_typing.time_to_next_seconds <= 8.0).all()


def test_the_replays_views_are_the_stores_own_at_each_decision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """rows_from_events keeps a session's view until that session's next event: every view it
    reads features from is the one the store gives at that moment."""
    stores: list[MemoryStore] = []

    class Store(MemoryStore):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            stores.append(self)

    checked: list[float] = []
    features = dataset.session_features

    def checking(view: SessionView, now: float) -> list[float]:
        assert view == stores[-1].sessions([view.session_id], resident=False)[0]
        checked.append(now)
        return features(view, now)

    monkeypatch.setattr(dataset, "MemoryStore", Store)
    monkeypatch.setattr(dataset, "session_features", checking)
    rows = rows_from_events(chat_with_signals(60, seed=3), log_name="x")
    assert len(checked) > 200 and len(rows) >= len(checked)


def test_a_kind_that_cries_wolf_is_learned_to_be_unreliable(tmp_path: Path) -> None:
    log = tmp_path / "chat.jsonl"
    events = chat_with_signals(400, seed=1)
    log.write_bytes(encode_events(events))
    # What a deployment sending these signals says of itself, as the service would at the end.
    deployment = DeploymentSignals()
    deployment.observe(events)
    data = build_dataset([log])
    model = train(data, num_boost_round=200, early_stopping_rounds=20)
    card = save_model(model, tmp_path / "m") / "card.json"
    seen = json.loads(card.read_text())["data"]["signals"]
    assert seen["typing"]["followed_share"] == 1.0 and seen["opened"]["followed_share"] == 0.0

    # Sessions of every habit, asked 1 s after a `typing` and 1 s after an `opened`.
    rng = random.Random(3)
    p = {}
    for kind in ("typing", "opened"):
        rows = []
        for i in range(50):
            gaps = [rng.lognormvariate(np.log(120.0), 1.0) for _ in range(rng.randint(1, 6))]
            arrivals = list(np.cumsum([1000.0, *gaps]))
            now = arrivals[-1] + rng.uniform(20, 300)
            view = SessionView(
                session_id=f"s{i}",
                state="idle",
                turns=len(arrivals),
                first_seen_ts=arrivals[0],
                last_activity_ts=arrivals[-1] + 5.0,
                closed_ts=None,
                instance_id="gpu-0",
                context_tokens=1000 * len(arrivals),
                context_bytes=0,
                block_hashes=[],
                block_tokens=512,
                recent_arrivals_ts=arrivals,
                inter_turn_gaps_seconds=gaps,
                last_request=None,
                resident_blocks={},
                signals=[SignalView(ts=now - 1.0, kind=kind)],
            )
            rows.append(feature_matrix([view], now, (15.0,), deployment.features())[0])
        p[kind] = float(model.booster.predict(np.asarray(rows)).mean())
    assert p["typing"] > 2 * p["opened"], p
