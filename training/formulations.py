"""Which question to learn, judged on one time split: the evidence behind training/DESIGN.md.

    python -m training.formulations --events LOG [--events LOG ...] [--valid-fraction 0.5]
                                    [--drop-weakest K] [--json]

Three ways to learn "when does this session send its next request", each trained on the same
rows (the decision points of training/dataset.py: a finish, and 20 s to 20 min into the silence
after it) and judged on P(next request within h) for the horizons the planner reads:

- classifier (today): P(within h | features, h), one binary model over the training horizons
  (training.dataset.HORIZONS), monotone in h; a row whose log ends before h has passed is dropped.
- regression (LRB-style): log(1 + seconds to the next request), a row with no return seen
  capped at LRB_CAP_SECONDS; P(within h) from the distribution of its residuals on held-out rows.
- hazard (discrete time): one row per decision and interval of HAZARD_EDGES_SECONDS while the
  session has not returned, label "returns in this interval";
  P(within h) = 1 - prod(1 - hazard) over the intervals up to h.

Beside them: `classifier+` (today's classifier also trained at the judged horizons) and
`base_rate` (the training part's share of returns within h, a floor every model must beat).

Split by time, never at random: within each log, decision points in the last `valid_fraction` of
its time span are judged, the rest train; the last INNER_VALID_FRACTION of the training part stops
the boosting early (and fits the regression's residuals), so the judged rows steer nothing. A
judged row counts at horizon h only when its log runs h seconds past it: the log's end is the
only censoring and it is known up front, so dropping those rows picks by time, not by outcome.

Differences from today's classifier come with 95% intervals from resampling whole sessions (a
session's rows at successive checkpoints are not independent). `--drop-weakest K` also retrains
the classifier without each of its K weakest features (by gain) and prints what the judged
metrics lose, the same way, to tell useful features from noise.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightgbm as lgb
import numpy as np
import pandas as pd
from sklearn.metrics import brier_score_loss, log_loss, roc_auc_score

from app.predict.features import HORIZON_FEATURE, SESSION_FEATURES
from training.dataset import HORIZONS, load_events, rows_from_events
from training.train import DEFAULT_PARAMS
from training.tune import INNER_VALID_FRACTION

# What the planner reads today: the prefetch lead, the keep horizon, and "returns at all".
EVAL_HORIZONS: tuple[float, ...] = (30.0, 300.0, 900.0)
# Interval edges of the hazard model; every evaluated horizon must be one.
HAZARD_EDGES_SECONDS: tuple[float, ...] = (0.0, 15.0, 30.0, 60.0, 120.0, 180.0, 300.0, 600.0, 900.0)
BIN_FEATURE = "bin_start_seconds"
# LRB's "no next request seen" target: an hour, well past every horizon the planner reads.
LRB_CAP_SECONDS = 3600.0
# A half: the shared traces span 35 and 17 minutes, and a 900 s answer is known only for
# decisions at least 900 s before a log's end. The last 20% (train's default) leaves none.
VALID_FRACTION = 0.5
# Probabilities are clipped here before the log loss, for every formulation alike: the
# regression's step-shaped distribution gives exact zeros and ones.
PROB_FLOOR = 1e-6
# Resamples of sessions behind each printed interval; enough for stable 95% bounds at 4 decimals.
BOOTSTRAP_RESAMPLES = 1000
FORMULATIONS = ("classifier", "regression", "hazard")
# Not a formulation: today's classifier, also trained at the horizons the planner reads, to tell
# what the formulation costs from what the choice of training horizons costs.
PLANNER_TRAINING_HORIZONS: tuple[float, ...] = tuple(sorted({*HORIZONS, *EVAL_HORIZONS}))


@dataclass(frozen=True)
class Split:
    fit: pd.DataFrame  # trains
    stop: pd.DataFrame  # stops boosting early; the regression's residuals
    valid: pd.DataFrame  # judged


def decision_points(logs: Sequence[Path | str]) -> pd.DataFrame:
    """One row per decision point: SESSION_FEATURES, time_to_next_seconds (inf: none seen),
    time_fraction, and window_seconds, how long the log runs past the decision."""
    frames = []
    for log in logs:
        path = Path(log)
        events = load_events(path)
        rows = rows_from_events(events, log_name=path.name, horizons=(0.0,))  # one row per decision
        rows["window_seconds"] = events[-1].ts - rows.decision_ts
        frames.append(rows.drop(columns=[HORIZON_FEATURE]))
    data = pd.concat(frames, ignore_index=True)
    if data.empty:
        raise ValueError("the logs hold no finished request to learn from")
    return data


def split(
    points: pd.DataFrame,
    valid_fraction: float = VALID_FRACTION,
    inner_valid_fraction: float = INNER_VALID_FRACTION,
) -> Split:
    cut = 1.0 - valid_fraction
    inner_cut = cut * (1.0 - inner_valid_fraction)
    tf = points.time_fraction
    parts = Split(points[tf < inner_cut], points[(tf >= inner_cut) & (tf < cut)], points[tf >= cut])
    if parts.fit.empty or parts.stop.empty or parts.valid.empty:
        raise ValueError(
            f"splitting {len(points)} decision points at {inner_cut:.0%} and {cut:.0%} of the time "
            "span leaves a part empty: use longer logs"
        )
    return parts


def _params(objective: str, features: Sequence[str], seed: int) -> dict[str, Any]:
    params = {k: v for k, v in DEFAULT_PARAMS.items() if not k.startswith("monotone")}
    params.update(objective=objective, seed=seed)
    if objective == "binary" and HORIZON_FEATURE in features:
        # Today's formulation: asking about a longer wait can only add returns.
        params["monotone_constraints"] = [1 if f == HORIZON_FEATURE else 0 for f in features]
        params["monotone_constraints_method"] = DEFAULT_PARAMS["monotone_constraints_method"]
    return params


def _fit(
    params: dict[str, Any],
    features: Sequence[str],
    fit: tuple[np.ndarray, np.ndarray],
    stop: tuple[np.ndarray, np.ndarray],
) -> lgb.Booster:
    dfit = lgb.Dataset(fit[0], label=fit[1], feature_name=list(features), free_raw_data=False)
    dstop = lgb.Dataset(stop[0], label=stop[1], reference=dfit)
    return lgb.train(
        params,
        dfit,
        num_boost_round=1000,
        valid_sets=[dstop],
        valid_names=["stop"],
        callbacks=[lgb.early_stopping(50, verbose=False)],
    )


def _with_column(
    points: pd.DataFrame, features: Sequence[str], name: str, value: float
) -> np.ndarray:
    x = points[[f for f in features if f != name]].to_numpy(dtype=np.float64)
    if name not in features:
        return x
    return np.insert(x, list(features).index(name), value, axis=1)


# --- classifier (today) -----------------------------------------------------------------------


def _horizon_rows(
    points: pd.DataFrame, features: Sequence[str], horizons: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for h in horizons:
        known = points[points.window_seconds >= h]  # as training/dataset.py: the answer is known
        xs.append(_with_column(known, features, HORIZON_FEATURE, h))
        ys.append((known.time_to_next_seconds <= h).to_numpy(dtype=np.float64))
    return np.concatenate(xs), np.concatenate(ys)


def classifier(
    parts: Split,
    seed: int = 0,
    features: Sequence[str] | None = None,
    horizons: Sequence[float] = HORIZONS,
) -> tuple[np.ndarray, lgb.Booster]:
    """P(within h) for h in EVAL_HORIZONS on the judged rows, shape (rows, horizons); the
    booster."""
    features = list(features or (*SESSION_FEATURES, HORIZON_FEATURE))
    booster = _fit(
        _params("binary", features, seed),
        features,
        _horizon_rows(parts.fit, features, horizons),
        _horizon_rows(parts.stop, features, horizons),
    )
    p = np.column_stack(
        [
            booster.predict(
                _with_column(parts.valid, features, HORIZON_FEATURE, h),
                num_iteration=booster.best_iteration,
            )
            for h in EVAL_HORIZONS
        ]
    )
    # The planner reads the horizons through a running maximum (app/decide/advisor.py).
    return np.maximum.accumulate(p, axis=1), booster


# --- regression (LRB-style) -------------------------------------------------------------------


def _log_wait(points: pd.DataFrame) -> np.ndarray:
    seen = points.time_to_next_seconds.to_numpy() <= points.window_seconds.to_numpy()
    wait = np.where(seen, points.time_to_next_seconds.to_numpy(), LRB_CAP_SECONDS)
    return np.log1p(np.minimum(wait, LRB_CAP_SECONDS))


def regression(parts: Split, seed: int = 0) -> tuple[np.ndarray, lgb.Booster]:
    features = list(SESSION_FEATURES)
    x_stop, y_stop = parts.stop[features].to_numpy(), _log_wait(parts.stop)
    booster = _fit(
        _params("regression", features, seed),
        features,
        (parts.fit[features].to_numpy(), _log_wait(parts.fit)),
        (x_stop, y_stop),
    )
    residuals = np.sort(y_stop - booster.predict(x_stop, num_iteration=booster.best_iteration))
    predicted = booster.predict(
        parts.valid[features].to_numpy(), num_iteration=booster.best_iteration
    )
    # P(log1p(T) <= log1p(h)) = P(residual <= log1p(h) - prediction), from the held-out residuals.
    return np.column_stack(
        [
            np.searchsorted(residuals, np.log1p(h) - predicted, side="right") / len(residuals)
            for h in EVAL_HORIZONS
        ]
    ), booster


# --- discrete-time hazard ---------------------------------------------------------------------


def _interval_rows(points: pd.DataFrame, features: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    wait, window = points.time_to_next_seconds.to_numpy(), points.window_seconds.to_numpy()
    for lo, hi in zip(HAZARD_EDGES_SECONDS[:-1], HAZARD_EDGES_SECONDS[1:]):
        event = (wait > lo) & (wait <= hi) & (wait <= window)
        # At risk: not back by `lo`; counted when the log shows the whole interval or the return.
        at_risk = (wait > lo) & ((window >= hi) | event)
        xs.append(_with_column(points[at_risk], features, BIN_FEATURE, lo))
        ys.append(event[at_risk].astype(np.float64))
    return np.concatenate(xs), np.concatenate(ys)


def hazard(parts: Split, seed: int = 0) -> tuple[np.ndarray, lgb.Booster]:
    features = [*SESSION_FEATURES, BIN_FEATURE]
    booster = _fit(
        _params("binary", features, seed),
        features,
        _interval_rows(parts.fit, features),
        _interval_rows(parts.stop, features),
    )
    hazards = np.column_stack(
        [
            booster.predict(
                _with_column(parts.valid, features, BIN_FEATURE, lo),
                num_iteration=booster.best_iteration,
            )
            for lo in HAZARD_EDGES_SECONDS[:-1]
        ]
    )
    p_within_edge = 1.0 - np.cumprod(1.0 - hazards, axis=1)
    at = [
        HAZARD_EDGES_SECONDS.index(h) - 1 for h in EVAL_HORIZONS
    ]  # column j: within the end of interval j
    return p_within_edge[:, at], booster


# --- judging ----------------------------------------------------------------------------------

Judged = dict[float, tuple[np.ndarray, np.ndarray]]  # horizon -> (rows that count, labels)


def judged_rows(valid: pd.DataFrame) -> Judged:
    """Per horizon: which judged rows count (the log runs h past them) and their labels."""
    return {
        h: ((valid.window_seconds >= h).to_numpy(), (valid.time_to_next_seconds <= h).to_numpy())
        for h in EVAL_HORIZONS
    }


def scores(p: np.ndarray, judged: Judged) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for j, (h, (mask, label)) in enumerate(judged.items()):
        y, q = label[mask].astype(np.float64), np.clip(p[mask, j], PROB_FLOOR, 1.0 - PROB_FLOOR)
        both = 0 < y.sum() < len(y)
        out[str(int(h))] = {
            "brier": round(float(brier_score_loss(y, q)), 4) if len(y) else None,
            "log_loss": round(float(log_loss(y, q, labels=[0, 1])), 4) if len(y) else None,
            "auc": round(float(roc_auc_score(y, q)), 4) if both else None,
        }
    return out


def base_rates(parts: Split, valid_rows: int) -> np.ndarray:
    """The training part's share of returns within each horizon, for every judged row alike."""
    train = pd.concat([parts.fit, parts.stop])
    rates = [
        float((train[train.window_seconds >= h].time_to_next_seconds <= h).mean())
        if (train.window_seconds >= h).any()
        else np.nan
        for h in EVAL_HORIZONS
    ]
    return np.tile(np.nan_to_num(np.asarray(rates), nan=0.5), (valid_rows, 1))


def _losses(p: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    q = np.clip(p, PROB_FLOOR, 1.0 - PROB_FLOOR)
    return {"brier": (q - y) ** 2, "log_loss": -(y * np.log(q) + (1.0 - y) * np.log(1.0 - q))}


def paired_differences(
    p: np.ndarray, p_reference: np.ndarray, judged: Judged, sessions: np.ndarray, seed: int = 0
) -> dict[str, dict[str, list[float] | None]]:
    """Per horizon, Brier and log loss of `p` minus those of `p_reference` on the same judged rows:
    [difference, 2.5th percentile, 97.5th percentile] over BOOTSTRAP_RESAMPLES resamples of whole
    sessions (a session's rows at successive checkpoints are not independent)."""
    out: dict[str, dict[str, list[float] | None]] = {}
    for j, (h, (mask, label)) in enumerate(judged.items()):
        if not mask.any():
            out[str(int(h))] = {"brier": None, "log_loss": None}
            continue
        y = label[mask].astype(np.float64)
        _, group = np.unique(sessions[mask], return_inverse=True)
        rows_per = np.bincount(group).astype(np.float64)
        ours, theirs = _losses(p[mask, j], y), _losses(p_reference[mask, j], y)
        # The same resamples for every metric and every model compared: the differences are paired.
        draws = np.random.default_rng(seed).integers(
            0, len(rows_per), size=(BOOTSTRAP_RESAMPLES, len(rows_per))
        )
        out[str(int(h))] = {}
        for metric in ("brier", "log_loss"):
            diff_per = np.bincount(group, weights=ours[metric] - theirs[metric])
            resampled = diff_per[draws].sum(axis=1) / rows_per[draws].sum(axis=1)
            out[str(int(h))][metric] = [
                round(float(diff_per.sum() / rows_per.sum()), 4),
                *(round(float(v), 4) for v in np.percentile(resampled, [2.5, 97.5])),
            ]
    return out


def feature_check(
    parts: Split,
    judged: Judged,
    booster: lgb.Booster,
    p_all: np.ndarray,
    sessions: np.ndarray,
    weakest: int,
    seed: int = 0,
) -> dict[str, Any]:
    """Gain importance of the classifier, and what its judged metrics lose without each of its
    `weakest` features (retrained without it; positive: worse without)."""
    names = booster.feature_name()
    gain = booster.feature_importance(importance_type="gain")
    total = float(gain.sum()) or 1.0
    share = {
        n: round(float(g) / total, 4) for n, g in sorted(zip(names, gain), key=lambda kv: -kv[1])
    }
    dropped = {}
    for name in [n for n in reversed(share) if n != HORIZON_FEATURE][:weakest]:
        p, _ = classifier(parts, seed, features=[f for f in names if f != name])
        dropped[name] = paired_differences(p, p_all, judged, sessions, seed)
    return {"gain_share": share, "without": dropped}


def compare(
    logs: Sequence[Path | str],
    *,
    valid_fraction: float = VALID_FRACTION,
    seed: int = 0,
    drop_weakest: int = 0,
) -> dict[str, Any]:
    parts = split(decision_points(logs), valid_fraction)
    judged = judged_rows(parts.valid)
    fitted = {
        "classifier": classifier(parts, seed),
        "regression": regression(parts, seed),
        "hazard": hazard(parts, seed),
        "classifier+": classifier(parts, seed, horizons=PLANNER_TRAINING_HORIZONS),
    }
    results = {name: scores(p, judged) for name, (p, _) in fitted.items()}
    results["base_rate"] = scores(base_rates(parts, len(parts.valid)), judged)
    sessions = (parts.valid.log + "/" + parts.valid.session_id).to_numpy()
    reference = fitted["classifier"][0]
    out: dict[str, Any] = {
        "logs": [Path(log).name for log in logs],
        "valid_fraction": valid_fraction,
        "inner_valid_fraction": INNER_VALID_FRACTION,
        "seed": seed,
        "decision_points": {
            "fit": len(parts.fit),
            "stop": len(parts.stop),
            "valid": len(parts.valid),
        },
        "judged": {
            str(int(h)): {
                "rows": int(m.sum()),
                "positive_rate": round(float(y[m].mean()), 4) if m.any() else None,
            }
            for h, (m, y) in judged.items()
        },
        "results": results,
        "best_iteration": {name: int(b.best_iteration) for name, (_, b) in fitted.items()},
        "minus_classifier": {
            name: paired_differences(p, reference, judged, sessions, seed)
            for name, (p, _) in fitted.items()
            if name != "classifier"
        },
    }
    if drop_weakest:
        out["features"] = feature_check(
            parts, judged, fitted["classifier"][1], reference, sessions, drop_weakest, seed
        )
    return out


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def _interval(d: list[float] | None) -> str:
    return "-" if d is None else f"{d[0]:+.4f} [{d[1]:+.4f}, {d[2]:+.4f}]"


def render(out: dict[str, Any]) -> str:
    lines = [
        f"logs: {', '.join(out['logs'])}",
        f"split by time: the last {out['valid_fraction']:.0%} of each log judged; the last "
        f"{out['inner_valid_fraction']:.0%} of the rest stops boosting; seed {out['seed']}",
        "decision points: " + ", ".join(f"{k} {v:,}" for k, v in out["decision_points"].items()),
        "",
        f"{'formulation':<12} {'horizon_s':>9} {'rows':>7} {'pos_rate':>8} {'brier':>7} "
        f"{'log_loss':>8} "
        f"{'auc':>7}",
    ]
    for name, per_h in out["results"].items():
        for h, m in per_h.items():
            j = out["judged"][h]
            rate = "-" if j["positive_rate"] is None else f"{j['positive_rate']:.4f}"
            lines.append(
                f"{name:<12} {h:>9} {j['rows']:>7,} {rate:>8} {_fmt(m['brier']):>7} "
                f"{_fmt(m['log_loss']):>8} {_fmt(m['auc']):>7}"
            )
    lines += [
        "",
        "classifier+: the classifier also trained at the judged horizons "
        f"({', '.join(f'{h:g}' for h in PLANNER_TRAINING_HORIZONS)} s); base_rate: the training "
        "part's "
        "share of returns within h, for every row",
        "best iteration: " + ", ".join(f"{k} {v}" for k, v in out["best_iteration"].items()),
    ]
    lines += [
        "",
        "minus the classifier, on the same rows (negative: better than today's); "
        "[95% interval, resampling sessions]:",
        f"{'formulation':<12} {'horizon_s':>9} {'brier':>27} {'log_loss':>27}",
    ]
    for name, per_h in out["minus_classifier"].items():
        lines += [
            f"{name:<12} {h:>9} {_interval(d['brier']):>27} {_interval(d['log_loss']):>27}"
            for h, d in per_h.items()
        ]
    if "features" in out:
        gain = out["features"]["gain_share"]
        lines += [
            "",
            "classifier gain share: " + ", ".join(f"{k} {v:.4f}" for k, v in gain.items()),
            "",
            "retrained without one feature, minus the classifier with all (positive: the feature "
            "helps):",
            f"{'without':<22} {'horizon_s':>9} {'brier':>27} {'log_loss':>27}",
        ]
        for name, per_h in out["features"]["without"].items():
            lines += [
                f"{name:<22} {h:>9} {_interval(d['brier']):>27} {_interval(d['log_loss']):>27}"
                for h, d in per_h.items()
            ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m training.formulations",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--events", type=Path, action="append", required=True, help="an event log (repeat)"
    )
    parser.add_argument("--valid-fraction", type=float, default=VALID_FRACTION)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--drop-weakest",
        type=int,
        default=0,
        metavar="K",
        help="also retrain the classifier without each of its K weakest features",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    out = compare(
        args.events,
        valid_fraction=args.valid_fraction,
        seed=args.seed,
        drop_weakest=args.drop_weakest,
    )
    sys.stdout.write((json.dumps(out) if args.json else render(out)) + "\n")


if __name__ == "__main__":
    main()
