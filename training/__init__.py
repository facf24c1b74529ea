"""Training the arrival model from the service's event logs. For notebooks (run from the repo root;
make an event log first: `kvprefetch events-from-trace
--trace ../shared/traces/mooncake_synthetic.jsonl --out var/synthetic.events.jsonl`):

    from pathlib import Path
    from training import build_dataset, evaluate, load_model, save_model, train

    df = build_dataset(["var/synthetic.events.jsonl"])  # one row per (decision point, horizon)
    model = train(df, {"num_leaves": 63}, seed=0)       # time split inside: the last 20% validates
    print(model.metrics["brier"], model.metrics["auc"], model.importance)
    save_model(model, Path("models/mine"))              # models/mine/{model.txt, card.json}
    df["p_mine"] = load_model("models/mine").predict(df)  # load_model(): the bundled model
    # replay: learned vs baselines
    evaluate("models/mine", "../shared/traces/mooncake_synthetic.jsonl")

- build_dataset(logs) -> DataFrame: app.predict.features.FEATURES (the last is horizon_seconds),
  then training.dataset.META_COLUMNS: `label` (the next request came within the horizon) and
  `time_fraction` (where the row lies in its log's time span, less its horizon at the end: the
  split is by time, never at random, and every horizon has its last share validated).
  `df.attrs["logs"]`: each log's path, SHA-256 and span, for the card's lineage.
- train(df, params=None, *, valid_fraction=0.2, seed=0, num_boost_round=1000,
  progress=None) -> TrainedModel: booster, metrics (validation Brier, log loss, AUC, per
  horizon), calibration, gain importance, params, data. `params` override
  training.train.DEFAULT_PARAMS.
- save_model(model, out_dir, extra=None, command=None): model.txt and card.json (with `extra`
  merged in; lineage: the logs' paths, hashes and span, rows per horizon, the command and the
  code version: docs/data-science/training.md).
- load_model(model_dir=None) -> ArrivalModel: a saved model (None: the bundled one, models/default);
  its predict(frame) gives P(within horizon) for each row of a frame with the FEATURES columns
  (extra columns ignored; a missing one is a ValueError naming it), as the service computes it.
- evaluate(model_dir, trace, scenario="default", train_fraction=0.7): replays the trace under the
  learned policy and the baselines, counting only requests after `train_fraction` of its span; for
  an honest judgement train on the first `train_fraction` only, as training/bundle.py does.

Every function is silent. For progress bars (what `kvprefetch train` draws on stderr):

    from training.progress import rich_bars

    with rich_bars() as progress:                      # any callable(task, done, total) will do
        df = build_dataset(["var/synthetic.events.jsonl"], progress)
        model = train(df, progress=progress)

Hyper-parameter search (`pip install 'kvprefetch[tune]'`), scored on an inner time split of the
training part so the validation metrics stay honest:

    from training.tune import tune

    result = tune(df, 20, seed=0)                      # 20 Optuna TPE trials, deterministic
    model = train(df, result.best_params, seed=0)
    save_model(model, Path("models/tuned"), extra={"tuning": result.card()})

A worked example, from a trace to two models compared in replay:
docs/notebooks/quickstart.ipynb.

Why this formulation (and not a regression of the wait, or a hazard model): training/DESIGN.md,
whose numbers `python -m training.formulations` prints.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from training.arrival_model import ArrivalModel, load_model
    from training.dataset import build_dataset
    from training.evaluate import evaluate
    from training.train import TrainedModel, save_model, train

__all__ = [
    "ArrivalModel",
    "TrainedModel",
    "build_dataset",
    "evaluate",
    "load_model",
    "save_model",
    "train",
]
# Each name above -> its module, imported on first use: the command line imports training.cli
# (whose commands import the rest when they run) without pandas or scikit-learn, which only the
# 'training' extra brings.
_HOMES = {
    "ArrivalModel": "training.arrival_model",
    "load_model": "training.arrival_model",
    "build_dataset": "training.dataset",
    "evaluate": "training.evaluate",
    "TrainedModel": "training.train",
    "save_model": "training.train",
    "train": "training.train",
}


class _Package(ModuleType):
    def __getattr__(self, name: str) -> Any:
        home = _HOMES.get(name)
        if home is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        super().__setattr__(name, value)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        # Loading training.train or training.evaluate binds the module to its package's
        # attribute: here `train` and `evaluate` are the functions, as `from training import
        # train` has always given.
        if name in _HOMES and isinstance(value, ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
