"""Scoring live sessions: the service's predictor beside the raw LightGBM Booster, in one run.

    kvprefetch bench predict [--sessions 10000] [--rounds 7] [--model DIR]
        [--pass-sessions 10000,100000] [--redis-url URL] [--json]

Two horizon sets: what a planner tick asks (PLANNER_HORIZONS, 3) and the whole HORIZON_GRID (9,
the horizons a hint or a finish reads). For each, medians over rounds of:

- `service_p_within`: `LearnedPredictor.p_within(views, now, horizons)`, the call that takes
  SessionViews: the features in bulk (app.predict.feature_table.feature_matrix) and the model;
- `table_p_within`: `LearnedPredictor.p_within_table(table, now, horizons)`, a tick of a caller that
  keeps a FeatureTable current as sessions change (so no views to convert): the 20 ms target;
- its parts: `table_matrix` (the time-dependent columns and the horizons, numpy) and the model
  alone on that matrix: `compiled` (lleaves, when installed) and `booster_1_thread`,
  `booster_2_threads` (the raw Booster);
- `features_from_views` (the bulk features alone) and `features_reference` (the per-session Python
  reference, `session_features`, what the service ran before: the same numbers);
- `table_from_views`: building a FeatureTable from every view at once (a restart).

`service` (the service's own path, beside the table path, at each of `pass_sessions`, in the same
run): the Scorer's real pass over N live sessions of a real MemoryStore, as the service runs it
(KVP_SCORE_ALL_LIVE: the table kept current from events, every live session advised, the ledger,
the scheduler's intake), with the serving model and with a shadow too; the table path alone
(`table_p_within_ms`, at the advisor's horizons); and the page path it replaced (views read from
the store, `pages_path_live_ms`): bench/scoring.py. With `redis_url`, `service_redis`: the same
pass over a RedisStore (at the smallest N).

`single_session_ms`: one session at the full grid (what one session costs on a finish) through
the service, the Booster and the compiled model alone, and `table_upsert` (what a session change
costs the table). `compiled_load_seconds`: compiling the model into an empty cache, then loading
that cache as a later start does. `ratios` divide medians of this run; every figure's rounds are
interleaved with the others'. `load_average_1m`: the machine's load before and after.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._util import info, machine

TARGET_MS_FOR_10K = 20.0
# What the planner will ask each tick: the prefetch lead, the keep horizon, the end of the grid.
PLANNER_HORIZONS: tuple[float, ...] = (30.0, 300.0, 900.0)


def _sessions(n: int, seed: int) -> list[Any]:
    from app.state.base import RequestView, SessionView

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
        out.append(
            SessionView(
                session_id=f"s{i}",
                state="idle",
                turns=turns,
                first_seen_ts=0.0,
                last_activity_ts=last + 20.0,
                closed_ts=None,
                instance_id=f"gpu-{i % 16}",
                context_tokens=prompt + 300,
                context_bytes=0,
                block_hashes=list(range(prompt // 512 + 1)),
                block_tokens=512,
                recent_arrivals_ts=arrivals,
                inter_turn_gaps_seconds=gaps,
                last_request=RequestView(
                    request_id=f"r{i}",
                    instance_id=f"gpu-{i % 16}",
                    routed_ts=last,
                    started_ts=last + 0.5,
                    finished_ts=last + 20.0,
                    prompt_tokens=prompt,
                    output_tokens=300,
                    context_tokens=prompt + 300,
                ),
                resident_blocks={},
            )
        )
    return out


def _medians_ms(fns: dict[str, Any], rounds: int) -> dict[str, float]:
    """Median ms of each function, interleaved round by round, so a burst of load on a shared
    machine lands on every figure alike instead of on whichever ran during it. A quick function
    runs several times a round (up to ~50 ms of it), so its median rests on more samples."""
    repeats = {}
    for name, fn in fns.items():
        t = time.perf_counter()
        fn()  # warm: first-call allocations and caches are not what a running service pays
        repeats[name] = max(1, min(20, int(0.05 / max(time.perf_counter() - t, 1e-6))))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(repeats[name]):
                t = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t) * 1000)
    return {name: round(statistics.median(ts), 3) for name, ts in times.items()}


def _reference_matrix(views: list[Any], now: float, horizons: tuple[float, ...]) -> Any:
    """feature_matrix as it was before the FeatureTable: session_features per view, rows of
    lists."""
    import numpy as np

    from app.predict.features import FEATURES, deployment_features, session_features
    from app.predict.tool_durations import TOOL_FEATURES

    shared = deployment_features(None)  # the deployment's features, NaN as feature_matrix's
    no_tool = [float("nan")] * len(TOOL_FEATURES)  # no call in flight, as feature_matrix's
    rows = []
    for view in views:
        base = session_features(view, now)
        for h in horizons:
            rows.append([*base, *shared, *no_tool, float(h)])
    return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(FEATURES))


def _ratio(a: float | None, b: float | None) -> float | None:
    # Three significant digits: fixed decimals round a small ratio (a tiny --sessions) to 0.
    return float(f"{a / b:.3g}") if a is not None and b else None


def _batch(
    model: Any, views: list[Any], now: float, horizons: tuple[float, ...], rounds: int
) -> dict[str, Any]:
    from app.predict.feature_table import FeatureTable, feature_matrix

    table = FeatureTable.from_views(views)
    x = model.model_input(table.matrix(now, horizons))
    compiled = model.compiled
    fns = {
        "service_p_within": lambda: model.p_within(views, now, horizons),
        "table_p_within": lambda: model.p_within_table(table, now, horizons),
        "table_matrix": lambda: table.matrix(now, horizons),
        "compiled": (lambda: compiled.predict(x)) if compiled else None,
        "booster_1_thread": lambda: model.booster.predict(x, num_threads=1),
        "booster_2_threads": lambda: model.booster.predict(x, num_threads=2),
        "features_from_views": lambda: feature_matrix(views, now, horizons),
        "features_reference": lambda: _reference_matrix(views, now, horizons),
        "table_from_views": lambda: FeatureTable.from_views(views),
    }
    measured = _medians_ms({k: f for k, f in fns.items() if f is not None}, rounds)
    ms: dict[str, float | None] = {k: measured.get(k) for k in fns}
    before = (
        measured["features_reference"] + measured["booster_1_thread"]
    )  # the service's path until now
    return {
        "horizons": list(horizons),
        "rows": int(x.shape[0]),
        "batch_ms": ms,
        "ratios": {
            "table_p_within_over_target": _ratio(ms["table_p_within"], TARGET_MS_FOR_10K),
            "booster_1_thread_over_compiled": _ratio(ms["booster_1_thread"], ms["compiled"]),
            "booster_1_thread_over_2_threads": _ratio(
                ms["booster_1_thread"], ms["booster_2_threads"]
            ),
            "features_reference_over_from_views": _ratio(
                ms["features_reference"], ms["features_from_views"]
            ),
            "reference_path_over_service_p_within": _ratio(before, ms["service_p_within"]),
            "reference_path_over_table_p_within": _ratio(before, ms["table_p_within"]),
        },
    }


def _service(pass_sessions: tuple[int, ...], rounds: int, redis_url: str | None) -> dict[str, Any]:
    """The Scorer's pass at each size (bench/scoring.py), and over Redis at the smallest."""
    from bench import scoring

    out: dict[str, Any] = {}
    for n in pass_sessions:
        info(f"the service's pass over {n:,} live sessions of a MemoryStore, {rounds} rounds")
        out[str(n)] = scoring.measure(n, rounds=rounds)
    if redis_url is None or not pass_sessions:
        return {"memory": out}
    import uuid

    from app.state.redis import RedisStore

    n = min(pass_sessions)
    prefix = f"kvp-bench-{uuid.uuid4().hex[:8]}"
    store = RedisStore.from_url(
        redis_url, prefix=prefix, bytes_per_token=4096, block_tokens=scoring.BLOCK_TOKENS
    )
    try:
        info(f"the service's pass over {n:,} live sessions of a RedisStore, {rounds} rounds")
        scoring.build_store(n, into=store)
        redis = scoring.measure(n, rounds=rounds, store=store, pages=False)
    finally:
        store.clear()
        store.close()
    return {"memory": out, "redis": {str(n): redis}}


def run(
    *,
    sessions: int = 10_000,
    rounds: int = 7,
    model_dir: Path | None = None,
    seed: int = 0,
    pass_sessions: tuple[int, ...] = (10_000, 100_000),
    redis_url: str | None = None,
) -> dict[str, Any]:
    from app.core.bundle import DEFAULT_MODEL_DIR
    from app.predict.feature_table import FeatureTable, feature_matrix
    from app.predict.predictors import HORIZON_GRID, LearnedPredictor

    model_dir = model_dir or DEFAULT_MODEL_DIR
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kvp-bench-predict-") as cache:
        info("compiling the model into an empty cache (lleaves, when installed)")
        cold = LearnedPredictor(model_dir, cache_dir=Path(cache))
        model = LearnedPredictor(model_dir, cache_dir=Path(cache))  # what a later start loads
        load = (
            {
                "compile": round(cold.compiled.load_seconds, 3),
                "from_cache": round(model.compiled.load_seconds, 3),
            }
            if model.compiled and cold.compiled
            else None
        )
        views = _sessions(sessions, seed)
        now = max(v.last_activity_ts for v in views) + 30.0
        sets = {"planner": PLANNER_HORIZONS, "grid": tuple(HORIZON_GRID)}
        result: dict[str, Any] = {
            "sessions": sessions,
            "model": model.version,
            "trees": model.booster.num_trees(),
            "backend": model.backend,
            "compiled_load_seconds": load,
        }
        for name, horizons in sets.items():
            info(
                f"scoring {sessions} sessions x {len(horizons)} horizons ({name}), {rounds} rounds"
            )
            result[name] = _batch(model, views, now, horizons, rounds)
        one = views[:1]
        x_one = model.model_input(feature_matrix(one, now, HORIZON_GRID))
        table = FeatureTable.from_views(views)
        compiled = model.compiled
        singles = {
            "service_p_within": lambda: model.p_within(one, now, HORIZON_GRID),
            "compiled": (lambda: compiled.predict(x_one)) if compiled else None,
            "booster_1_thread": lambda: model.booster.predict(x_one, num_threads=1),
            "table_upsert": lambda: table.upsert(one[0]),
        }
        measured = _medians_ms({k: f for k, f in singles.items() if f is not None}, rounds * 20)
        result["single_session_ms"] = {
            "horizons": len(HORIZON_GRID),
            **{k: measured.get(k) for k in singles},
        }
    result["service"] = _service(pass_sessions, rounds, redis_url)
    tick = result["planner"]["batch_ms"]["table_p_within"]
    result["target"] = {
        "ms_for_10000_sessions": TARGET_MS_FOR_10K,
        "measured_by": "planner.batch_ms.table_p_within",
        "horizons": list(PLANNER_HORIZONS),
        "met": tick <= TARGET_MS_FOR_10K if sessions == 10_000 else None,
    }
    result["rounds"] = rounds
    # Other jobs on a shared machine inflate every figure; the ratios, measured interleaved, less.
    result["load_average_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return {**result, **machine()}
