"""`kvprefetch evaluate`: several models judged side by side on the held-out end of one trace.

The trace is split by time, never at random: its first `1 - holdout` of the time span is what the
models may have trained on, and every replay counts only the requests arriving in the last
`holdout` (training/evaluate.py's `judged_from_seconds`; the earlier part warms the cluster up).

The baselines (training/evaluate.py's BASELINES) do not depend on the model, so each is replayed
once per signal seed (a policy that reads no signal, sim/targets.py's SEED_FREE, once in all);
each model is replayed as `learned` with its directory, once per seed. Without `signals` nothing
is drawn at random: every policy is replayed once, whatever `seeds` says.

Beside the replays, the models' calibration on the held-out part: the events of the `none`
replay (what routers and engines would have posted, as `kvprefetch events-from-trace` writes
them) become training rows (training/dataset.py), and each model predicts the rows whose decision
point lies in the held-out part.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from app.core.bundle import model_identity
from app.predict.features import FEATURES, HORIZON_FEATURE
from sim.replay import replay
from sim.report import byte_hit_rate_series
from sim.scenario import Scenario, load_scenario
from sim.signals import parse_signal_overrides, with_signals
from sim.targets import SEED_FREE
from sim.traces import load_trace
from training.dataset import rows_from_events
from training.evaluate import BASELINES, judged_from_seconds

# What the comparison reports of each replay, as the mean over seeds with the standard deviation.
METRICS = (
    "byte_hit_rate",
    "byte_hit_rate_unshared",
    "hit_rate",
    "stall_seconds_total",
    "ttft_seconds_p50",
    "ttft_seconds_p99",
    "task_seconds_mean",
    "bytes_prefetched",
    "bytes_prefetched_unused",
    "gap_closed",
)
# The margins, paired seed by seed, of each model against the first model and against `none`.
MARGIN_METRICS = ("byte_hit_rate", "stall_seconds_total", "ttft_seconds_p99", "bytes_prefetched")
# Replays that take longest (the planner scores sessions): started first, so the pool's last
# minutes are not one long replay.
SLOW = frozenset({"learned", "heuristic", "clairvoyant"})

# progress(done, total): replays finished so far.
ReplayProgress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class Unit:
    """One replay: `policy` (a baseline, or `learned` with models[model]) under signal `seed`
    (None: no signals, or a policy that reads none); `rows`: also build the held-out rows from its
    events (the first `none` replay only)."""

    policy: str
    model: int | None = None
    seed: int | None = None
    rows: bool = False


@dataclass(frozen=True, slots=True)
class Setup:
    """What every replay of one comparison shares (sent to the pool's processes)."""

    trace: Path
    scenario: Scenario
    router: str
    signals: str | None
    models: tuple[str, ...]
    measure_from_seconds: float
    window_seconds: float


def units(
    models: Sequence[str], baselines: Sequence[str], seeds: Sequence[int], signals: str | None
) -> list[Unit]:
    """Each baseline once per seed (once in all where signals are off or it reads none), each
    model once per seed; the first `none` also builds the held-out rows."""

    def seeded(policy: str) -> bool:
        return signals is not None and policy not in SEED_FREE

    out: list[Unit] = []
    for policy in ("none", *(b for b in baselines if b != "none")):
        draws: Sequence[int | None] = seeds if seeded(policy) else [None]
        out += [Unit(policy, None, s, rows=policy == "none" and not out) for s in draws]
    draws = seeds if seeded("learned") else [None]
    out += [Unit("learned", i, s) for i in range(len(models)) for s in draws]
    return out


def _scenario_for(setup: Setup, seed: int | None) -> Scenario:
    if setup.signals is None:
        return setup.scenario
    overrides = parse_signal_overrides(setup.signals)
    # A seed-free policy's one replay draws under seed 0: its summary's signal counts are those.
    overrides["seed"] = 0 if seed is None else seed
    return setup.scenario.model_copy(
        update={"signals": with_signals(setup.scenario.signals, overrides)}
    )


def run_unit(unit: Unit, setup: Setup) -> dict[str, Any]:
    """One replay's summary, its byte hit rate per window of the held-out part, and (for the
    rows unit) the held-out rows built from its events."""
    trace = load_trace(setup.trace)
    result = replay(
        trace,
        _scenario_for(setup, unit.seed),
        policy=unit.policy,
        router=setup.router,
        model_dir=None if unit.model is None else setup.models[unit.model],
        measure_from_seconds=setup.measure_from_seconds,
        keep_events=unit.rows,
    )
    out: dict[str, Any] = {
        "summary": result.summary,
        "series": byte_hit_rate_series(
            result.requests, setup.window_seconds, setup.measure_from_seconds
        ),
        "rows": None,
    }
    if unit.rows:
        # Event-time order as training reads a log (training/dataset.py's load_events).
        events = sorted(result.events, key=lambda e: e.ts)
        rows = rows_from_events(
            events,
            log_name=setup.trace.name,
            bytes_per_token=setup.scenario.bytes_per_token,
            block_tokens=setup.scenario.block_tokens,
        )
        held_out = rows[rows.decision_ts >= setup.measure_from_seconds]
        out["rows"] = held_out[[*FEATURES, "label"]].reset_index(drop=True)
    return out


def _sd(values: Sequence[float]) -> float | None:
    # The sample standard deviation: the seeds are a sample of the draws a deployment might see.
    return statistics.stdev(values) if len(values) >= 2 else None


def _gap(summary: Mapping[str, Any], none: Mapping[str, Any], oracle: Mapping[str, Any] | None):
    if oracle is None:
        return None
    gap = oracle["byte_hit_rate"] - none["byte_hit_rate"]
    return (summary["byte_hit_rate"] - none["byte_hit_rate"]) / gap if gap > 0 else None


def _aggregate(per_seed: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """The mean and standard deviation over seeds of each of METRICS."""
    out: dict[str, Any] = {}
    for metric in METRICS:
        values = [s[metric] for s in per_seed.values() if s.get(metric) is not None]
        out[metric] = statistics.fmean(values) if values else None
        out[f"{metric}_sd"] = _sd(values)
    return out


def _margins(
    mine: Mapping[int, Mapping[str, Any]], theirs: Mapping[int, Mapping[str, Any]]
) -> dict[str, dict[str, float | None]]:
    """Per MARGIN_METRICS, the mean and standard deviation over seeds of mine less theirs, seed
    by seed (the same trace and signal draw for both)."""
    out = {}
    for metric in MARGIN_METRICS:
        diffs = [mine[s][metric] - theirs[s][metric] for s in mine]
        out[metric] = {"mean": statistics.fmean(diffs), "sd": _sd(diffs)}
    return out


def prediction_metrics(model_dir: str, rows: pd.DataFrame) -> dict[str, Any]:
    """Brier score, log loss and AUC of the model's P on held-out rows, overall and per horizon,
    and its calibration table (training/train.py's, ten bins of predicted P)."""
    from sklearn.metrics import brier_score_loss, log_loss, roc_auc_score

    from app.predict.predictors import LearnedPredictor
    from training.train import calibration_table

    if rows.empty:
        return {"rows": 0, "brier": None, "auc": None, "per_horizon": {}, "calibration": []}
    predictor = LearnedPredictor(model_dir, backend="booster")
    p = np.asarray(predictor.p_from_matrix(rows[list(FEATURES)].to_numpy(dtype=np.float64)))
    y = rows.label.to_numpy()

    def scores(yy: np.ndarray, pp: np.ndarray) -> dict[str, Any]:
        return {
            "rows": len(yy),
            "positive_rate": round(float(yy.mean()), 4),
            "brier": round(float(brier_score_loss(yy, pp)), 5),
            "log_loss": round(float(log_loss(yy, pp, labels=[0, 1])), 5),
            "auc": round(float(roc_auc_score(yy, pp)), 4) if 0 < yy.sum() < len(yy) else None,
        }

    horizons = rows[HORIZON_FEATURE].to_numpy()
    return {
        **scores(y, p),
        "per_horizon": {
            str(int(h)): scores(y[horizons == h], p[horizons == h]) for h in np.unique(horizons)
        },
        "calibration": calibration_table(y, p),
    }


def _labels(models: Sequence[str]) -> list[str]:
    """Each model's name in tables and plots: its directory's name, numbered where two share one."""
    names = [Path(m).name or str(m) for m in models]
    return [
        f"{n}#{names[:i].count(n) + 1}" if names.count(n) > 1 else n for i, n in enumerate(names)
    ]


def _run_all(
    todo: Sequence[Unit], setup: Setup, jobs: int, progress: ReplayProgress | None
) -> dict[Unit, dict[str, Any]]:
    """Every unit's result: one after another here with `jobs` 1, else over a process pool (one
    replay a task, the slow ones first, as sim/targets.py)."""
    done: dict[Unit, dict[str, Any]] = {}
    if progress is not None:
        progress(0, len(todo))
    if jobs <= 1:
        for unit in todo:
            done[unit] = run_unit(unit, setup)
            if progress is not None:
                progress(len(done), len(todo))
        return done
    order = sorted(todo, key=lambda u: not (u.rows or u.policy in SLOW))
    # Spawned, not forked: a fork of a process that has run LightGBM (its OpenMP threads, a
    # notebook's training) can hang in the child.
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        futures: dict[Future[dict[str, Any]], Unit] = {
            pool.submit(run_unit, u, setup): u for u in order
        }
        for future in as_completed(futures):
            done[futures[future]] = future.result()
            if progress is not None:
                progress(len(done), len(todo))
    return done


def compare(
    models: Sequence[Path | str],
    trace: Path | str,
    *,
    holdout: float = 0.3,
    scenario: str | Scenario = "default",
    router: str = "sticky",
    signals: str | None = None,
    seeds: int = 1,
    baselines: Sequence[str] = BASELINES,
    jobs: int = 2,
    window_seconds: float = 60.0,
    plots_dir: Path | str | None = None,
    progress: ReplayProgress | None = None,
) -> dict[str, Any]:
    """Judge `models` (model directories) against `baselines` on the last `holdout` of `trace`'s
    time span; `signals` (e.g. "coverage=0.5,lead_median=5,false_alarms=1") drawn under seeds
    0..`seeds`-1; `jobs` replays at a time; `plots_dir`: also write the plots (write_plots).
    `progress(done, total)` hears of each finished replay. Returns a JSON-ready dict:

        {
          "trace": "t.jsonl", "trace_path": "/abs/t.jsonl", "scenario": "default",
          "router": "sticky", "signals": null | "coverage=...",
          "seeds": [0, 1, 2],                    # the signal seeds ([0] without signals)
          "split": {"holdout": 0.3, "measure_from_seconds": 1484.7,
                    "trace_start_seconds": 0.0, "trace_end_seconds": 3599.0,
                    "held_out_rows": 10974},   # rows the prediction metrics are computed on
          "baselines": {"none": ENTRY, "lookahead": ENTRY, ...},
          "models": [MODEL, ...],                # in the order given; the first is the reference
          "replays": 8,                          # replays run in all
          "wall_seconds": 61.2,
        }

    ENTRY, per replayed policy: for each of METRICS `<metric>` (the mean over seeds; gap_closed is
    (x - none) / (oracle - none) on byte hit rate, None without oracle) and `<metric>_sd` (the
    sample standard deviation over seeds, None with one replay), and `per_seed`, a list of
    {"seed": S or null, **the replay's summary (sim/replay.py), "gap_closed": G}.

    MODEL: ENTRY's fields and also "label" (the directory's name, numbered if two share it),
    "model" (app.core.bundle.model_identity: "dir", "card_sha256", "model_sha256"),
    "margin_vs_none" and "margin_vs_first": per MARGIN_METRICS {"mean": M, "sd": SD}, the
    model's value less the other's, paired seed by seed (the first model's margin_vs_first is 0),
    and "prediction": on the held-out rows, {"rows", "positive_rate", "brier", "log_loss", "auc",
    "per_horizon": {"15": {same five}, ...}, "calibration": [{"bin_low", "bin_high", "rows",
    "mean_predicted", "observed_rate"}, ...]}.
    """
    started = time.perf_counter()
    if not models:
        raise ValueError("at least one model to compare")
    if not 0 < holdout < 1:
        raise ValueError(f"holdout {holdout:g}: a share of the trace's time span, in (0, 1)")
    if seeds < 1:
        raise ValueError("at least one seed")
    unknown = sorted(set(baselines) - set(BASELINES))
    if unknown:
        raise ValueError(f"unknown baseline(s) {', '.join(unknown)}; choose from {BASELINES}")
    from app.predict.predictors import LearnedPredictor

    model_dirs = tuple(str(m) for m in models)
    for m in model_dirs:
        LearnedPredictor(m, backend="booster")  # ModelError now, not after minutes of replays
    if signals is not None:
        with_signals(load_scenario("default").signals, parse_signal_overrides(signals))
    trace_path = Path(trace).resolve()
    requests = load_trace(trace_path)
    scen = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    measure_from = judged_from_seconds(requests, 1 - holdout)
    seed_list = list(range(seeds)) if signals is not None else [0]
    setup = Setup(trace_path, scen, router, signals, model_dirs, measure_from, window_seconds)
    todo = units(model_dirs, baselines, seed_list, signals)
    done = _run_all(todo, setup, jobs, progress)

    def by_seed(policy: str, model: int | None) -> dict[int, dict[str, Any]]:
        """The summaries of one policy (or model) per seed; a once-replayed one under each."""
        mine = {
            u.seed: r["summary"] for u, r in done.items() if (u.policy, u.model) == (policy, model)
        }
        return {s: mine[s] if s in mine else mine[None] for s in seed_list}

    none = by_seed("none", None)
    oracle = by_seed("oracle", None) if "oracle" in baselines else None

    def entry(policy: str, model: int | None) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
        per_seed = {
            s: {**summary, "gap_closed": _gap(summary, none[s], oracle[s] if oracle else None)}
            for s, summary in by_seed(policy, model).items()
        }
        replayed = {u.seed for u in done if (u.policy, u.model) == (policy, model)}
        listed = [
            {"seed": s, **per_seed[s if s is not None else seed_list[0]]}
            for s in sorted(replayed, key=lambda x: -1 if x is None else x)
        ]
        return {**_aggregate(per_seed), "per_seed": listed}, per_seed

    out_baselines = {}
    for policy in ("none", *(b for b in baselines if b != "none")):
        out_baselines[policy] = entry(policy, None)[0]
    rows = next(r["rows"] for u, r in done.items() if u.rows)
    labels = _labels(model_dirs)
    out_models = []
    first: dict[int, dict[str, Any]] = {}
    for i, (label, model_dir) in enumerate(zip(labels, model_dirs)):
        fields, per_seed = entry("learned", i)
        first = first or per_seed
        out_models.append(
            {
                "label": label,
                "model": model_identity(model_dir),
                **fields,
                "margin_vs_none": _margins(per_seed, none),
                "margin_vs_first": _margins(per_seed, first),
                "prediction": prediction_metrics(model_dir, rows),
            }
        )
    result: dict[str, Any] = {
        "trace": trace_path.name,
        "trace_path": str(trace_path),
        "scenario": scen.name,
        "router": router,
        "signals": signals,
        "seeds": seed_list,
        "split": {
            "holdout": holdout,
            "measure_from_seconds": round(measure_from, 3),
            "trace_start_seconds": requests[0].arrival_seconds,
            "trace_end_seconds": requests[-1].arrival_seconds,
            "held_out_rows": len(rows),
        },
        "baselines": out_baselines,
        "models": out_models,
        "replays": len(done),
    }
    if plots_dir is not None:
        series = {
            label: done[Unit("learned", i, seed_list[0] if signals is not None else None)]["series"]
            for i, label in enumerate(labels)
        }
        for policy in ("none", "oracle"):
            unit = next((u for u in done if u.policy == policy), None)
            if unit is not None:
                series[policy] = done[unit]["series"]
        result["plots"] = [str(p) for p in write_plots(result, series, Path(plots_dir))]
    result["wall_seconds"] = round(time.perf_counter() - started, 3)
    return result


# -- plots ------------------------------------------------------------------------------------

HIT_RATE_PNG = "byte_hit_rate_over_time.png"
CALIBRATION_PNG = "calibration.png"
PER_HORIZON_PNG = "per_horizon.png"


def _figure(columns: int = 1) -> tuple[Any, list[Any]]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9 if columns == 1 else 12, 5), dpi=110, layout="constrained")
    return fig, [fig.add_subplot(1, columns, c + 1) for c in range(columns)]


def _style(i: int) -> dict[str, object]:
    from sim.report import STYLES

    linestyle, width = STYLES[i % len(STYLES)]
    return {"color": f"C{i % 10}", "linestyle": linestyle, "linewidth": width}


def write_plots(
    result: Mapping[str, Any],
    series: Mapping[str, Sequence[tuple[float, float]]],
    out_dir: Path,
    window_seconds: float = 60.0,
) -> list[Path]:
    """Three PNGs overlaying the models: their byte hit rate per window of the held-out part
    beside none's and oracle's (`series`: label -> byte_hit_rate_series, of the first seed),
    their calibration on the held-out rows, and their Brier score and AUC per horizon."""
    from sim.report import plot_byte_hit_rate_series

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / HIT_RATE_PNG, out_dir / CALIBRATION_PNG, out_dir / PER_HORIZON_PNG]
    plot_byte_hit_rate_series(
        list(series.items()), paths[0], window_seconds, legend_title="model or policy"
    )

    fig, (ax,) = _figure()
    ax.plot([0, 1], [0, 1], color="grey", linewidth=1, label="perfectly calibrated")
    for i, m in enumerate(result["models"]):
        table = m["prediction"]["calibration"]
        ax.plot(
            [b["mean_predicted"] for b in table],
            [b["observed_rate"] for b in table],
            marker="o",
            label=f"{m['label']} (Brier {m['prediction']['brier']})",
            **_style(i),
        )
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("predicted P(next request within the horizon), mean per bin of 0.1")
    ax.set_ylabel("observed share of rows whose next request came")
    ax.set_title(f"Calibration on the held-out rows ({result['split']['held_out_rows']:,})")
    ax.grid(alpha=0.3)
    ax.legend(title="model")
    fig.savefig(paths[1])

    fig, axes = _figure(2)
    for ax, metric, name in zip(axes, ("brier", "auc"), ("Brier score (lower is better)", "AUC")):
        for i, m in enumerate(result["models"]):
            per = m["prediction"]["per_horizon"]
            hs = sorted(per, key=float)
            ax.plot(
                [float(h) for h in hs],
                [math.nan if per[h][metric] is None else per[h][metric] for h in hs],
                marker="o",
                label=m["label"],
                **_style(i),
            )
        ax.set_xscale("log")
        horizons = sorted(
            {float(h) for m in result["models"] for h in m["prediction"]["per_horizon"]}
        )
        ax.set_xticks(horizons, [f"{h:g}" for h in horizons])
        ax.minorticks_off()
        ax.set_xlabel("horizon (seconds)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(title="model")
    fig.suptitle("Per horizon, on the held-out rows")
    fig.savefig(paths[2])
    return paths


# -- the table --------------------------------------------------------------------------------

HEADERS = (
    "model or policy",
    "byte hit rate",
    "vs none",
    "vs first model",
    "gap closed",
    "stall s",
    "TTFT p99 s",
    "prefetched GB",
    "Brier",
    "AUC",
)


def _cell(mean: float | None, sd: float | None, fmt: str) -> str:
    if mean is None:
        return ""
    return format(mean, fmt) + ("" if sd is None else f" ± {format(sd, fmt.lstrip('+'))}")


def table_rows(result: Mapping[str, Any]) -> list[list[str]]:
    """One row per model (first) and baseline: the means ± standard deviations over seeds, the
    models' margins paired seed by seed, and their prediction scores on the held-out rows."""
    out = []
    for m in result["models"]:
        vs_none, vs_first = (
            m["margin_vs_none"]["byte_hit_rate"],
            m["margin_vs_first"]["byte_hit_rate"],
        )
        out.append(
            [
                m["label"],
                _cell(m["byte_hit_rate"], m["byte_hit_rate_sd"], ".4f"),
                _cell(vs_none["mean"], vs_none["sd"], "+.4f"),
                _cell(vs_first["mean"], vs_first["sd"], "+.4f"),
                _cell(m["gap_closed"], m["gap_closed_sd"], ".1%"),
                _cell(m["stall_seconds_total"], m["stall_seconds_total_sd"], ",.1f"),
                _cell(m["ttft_seconds_p99"], m["ttft_seconds_p99_sd"], ".3f"),
                _cell(m["bytes_prefetched"] / 1e9, _scaled(m["bytes_prefetched_sd"]), ",.0f"),
                "" if m["prediction"]["brier"] is None else f"{m['prediction']['brier']:.4f}",
                "" if m["prediction"]["auc"] is None else f"{m['prediction']['auc']:.3f}",
            ]
        )
    for policy, b in result["baselines"].items():
        out.append(
            [
                policy,
                _cell(b["byte_hit_rate"], b["byte_hit_rate_sd"], ".4f"),
                "",
                "",
                _cell(b["gap_closed"], b["gap_closed_sd"], ".1%"),
                _cell(b["stall_seconds_total"], b["stall_seconds_total_sd"], ",.1f"),
                _cell(b["ttft_seconds_p99"], b["ttft_seconds_p99_sd"], ".3f"),
                _cell(b["bytes_prefetched"] / 1e9, _scaled(b["bytes_prefetched_sd"]), ",.0f"),
                "",
                "",
            ]
        )
    return out


def _scaled(sd: float | None) -> float | None:
    return None if sd is None else sd / 1e9


def title(result: Mapping[str, Any]) -> str:
    split = result["split"]
    seeds = result["seeds"]
    drawn = (
        f"signals {result['signals']}, mean ± sd over seeds {', '.join(map(str, seeds))}"
        if result["signals"]
        else "signals off"
    )
    return (
        f"{result['trace']}: judged from {split['measure_from_seconds']:g} s (the last "
        f"{split['holdout']:.0%} of its time span); scenario {result['scenario']}, router "
        f"{result['router']}, {drawn}"
    )


def markdown(result: Mapping[str, Any]) -> str:
    lines = [
        title(result),
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "|".join("---" for _ in HEADERS) + "|",
        *("| " + " | ".join(row) + " |" for row in table_rows(result)),
        "",
        "Models: "
        + "; ".join(
            f"{m['label']} = {m['model']['dir']} (card {str(m['model']['card_sha256'])[:12]})"
            for m in result["models"]
        ),
    ]
    return "\n".join(lines)


def rich_table(result: Mapping[str, Any]) -> Any:
    """The same table for a terminal; its cells fold rather than end in an ellipsis."""
    from rich.table import Table

    table = Table(title=title(result))
    for h in HEADERS:
        table.add_column(h, justify="left" if h == HEADERS[0] else "right", overflow="fold")
    for row in table_rows(result):
        table.add_row(*row)
    return table


__all__ = ["BASELINES", "METRICS", "Unit", "compare", "markdown", "rich_table", "units"]


def for_tracking(result: dict[str, Any]) -> dict[str, Any]:
    """`compare`'s result in the shape training/tracking.py's log_comparison takes: the split
    (with the trace, scenario, router and signals it was judged under), and per model its
    identity and its metrics: the replay's means, the margins' means, and the held-out rows'
    prediction metrics (their calibration bins stay in the logged comparison.json)."""
    split = {
        **result["split"],
        **{k: result.get(k) for k in ("trace", "scenario", "router", "signals")},
    }
    models = []
    for m in result["models"]:
        metrics: dict[str, Any] = {k: m[k] for k in METRICS if isinstance(m.get(k), int | float)}
        for side in ("margin_vs_none", "margin_vs_first"):
            metrics[side] = {k: v["mean"] for k, v in (m.get(side) or {}).items()}
        prediction = m.get("prediction") or {}
        metrics["prediction"] = {k: v for k, v in prediction.items() if k != "calibration"}
        models.append({"identity": m["model"], "metrics": metrics})
    return {**result, "split": split, "models": models}
