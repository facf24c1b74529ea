"""Scoring live sessions: the service's predictor beside the raw LightGBM Booster, in one run.

    kvprefetch bench predict [--sessions 10000] [--rounds 7] [--model DIR] [--json]

What the planner does on a tick is `LearnedPredictor.p_within(views, now, horizons)`: build the
feature matrix from SessionViews (app.engine.features) and call the Booster. This measures, as
medians over rounds: that whole call for `sessions` sessions; its two parts, the features and
the Booster alone on the same matrix; and one session alone (what a single finish costs). The
issue's target is the whole call for 10,000 sessions within 20 ms on 2 cores.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench._util import info, machine

TARGET_MS_FOR_10K = 20.0


def _sessions(n: int, seed: int) -> list[Any]:
    from app.engine.state.base import RequestView, SessionView

    rng = random.Random(seed)
    out = []
    for i in range(n):
        turns = rng.randint(1, 6)
        gaps = [rng.lognormvariate(4.5, 1.0) for _ in range(turns - 1)]
        arrivals = [0.0]
        for g in gaps:
            arrivals.append(arrivals[-1] + g)
        last = arrivals[-1]
        prompt = rng.randint(500, 40_000)
        out.append(SessionView(
            session_id=f"s{i}", state="idle", turns=turns, first_seen_ts=0.0, last_activity_ts=last + 20.0,
            closed_ts=None, instance_id=f"gpu-{i % 16}", context_tokens=prompt + 300, context_bytes=0,
            block_hashes=list(range(prompt // 512 + 1)), block_tokens=512, recent_arrivals_ts=arrivals,
            inter_turn_gaps_seconds=gaps,
            last_request=RequestView(request_id=f"r{i}", instance_id=f"gpu-{i % 16}", routed_ts=last,
                                     started_ts=last + 0.5, finished_ts=last + 20.0, prompt_tokens=prompt,
                                     output_tokens=300, context_tokens=prompt + 300),
            resident_blocks={}))
    return out


def _median_ms(fn: Any, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return round(statistics.median(times), 3)


def run(*, sessions: int = 10_000, rounds: int = 7, model_dir: Path | None = None, seed: int = 0) -> dict[str, Any]:
    from app.engine.features import feature_matrix
    from app.engine.predictor import DEFAULT_MODEL_DIR, HORIZON_GRID, LearnedPredictor

    model = LearnedPredictor(model_dir or DEFAULT_MODEL_DIR)
    views = _sessions(sessions, seed)
    now = max(v.last_activity_ts for v in views) + 30.0
    horizons = HORIZON_GRID
    info(f"scoring {sessions} sessions x {len(horizons)} horizons, {rounds} rounds")
    x = feature_matrix(views, now, horizons)
    one = views[:1]
    x_one = feature_matrix(one, now, horizons)
    return {
        "sessions": sessions,
        "horizons": len(horizons),
        "rows": int(x.shape[0]),
        "model": model.version,
        "trees": model.booster.num_trees(),
        "batch_ms": {
            "service_p_within": _median_ms(lambda: model.p_within(views, now, horizons), rounds),
            "features_only": _median_ms(lambda: feature_matrix(views, now, horizons), rounds),
            "booster_only": _median_ms(lambda: model.booster.predict(x, num_threads=1), rounds),
        },
        "single_session_ms": {
            "service_p_within": _median_ms(lambda: model.p_within(one, now, horizons), rounds * 20),
            "booster_only": _median_ms(lambda: model.booster.predict(x_one, num_threads=1), rounds * 20),
        },
        "target_ms_for_10000_sessions": TARGET_MS_FOR_10K,
        "rounds": rounds,
        **machine(),
    }
