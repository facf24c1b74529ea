"""Experiment tracking and the model registry with MLflow (the 'mlflow' extra: mlflow-skinny).

- log_training_run(model_dir, params, card, uri): one run per trained model: its parameters, its
  validation metrics (overall, per horizon `h<N>s/...`, per part), the card, importance and
  calibration plots, and the model directory (artifact `model/`, which the service loads as is).
- log_comparison(comparison, uri): an evaluation of several models on one split (COMPARISON_SHAPE).
- register(model_dir, name, slot, uri): a registered model version of a model directory, with the
  alias of the service's slot it is meant for ("serving" or "shadow"); fetch(name, ref, dst, uri)
  brings a version back to a directory that KVP_MODEL_DIR or PUT /v1/model/shadow loads.

The store: `uri`, else $MLFLOW_TRACKING_URI, else DEFAULT_TRACKING_URI, a SQLite file under var/
(MLflow 3 refuses its old ./mlruns file store unless told otherwise, and the registry needs a
database). mlflow is imported inside the functions: the service never needs the extra.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from app.core.bundle import model_identity
from app.core.errors import MissingExtraError

DEFAULT_TRACKING_URI = "sqlite:///var/mlflow/mlflow.db"
DEFAULT_EXPERIMENT = "kvprefetch"
# The registry's aliases are the service's slots. Stages (Staging, Production) are deprecated
# since MLflow 2.9 in favour of aliases; a caller that still speaks in stages gets these.
SLOTS = ("serving", "shadow")
SLOT_OF_STAGE = {"Production": "serving", "Staging": "shadow"}
# MLflow's limits: a param value's length, and params per log_batch call.
MAX_PARAM_CHARS = 6000
PARAMS_PER_BATCH = 100
TAG_PREFIX = "kvprefetch."

COMPARISON_SHAPE = """{
  "split": {...},                       # how the data was cut: logged as params split.<key>
  "models": [                           # one nested run per model
    {"identity": {"dir": str, "card_sha256": str | None, "model_sha256": str | None},
     "metrics": {name: number | {name: number | {...}}}},   # nested names joined with "/"
    ...
  ],
  ...                                   # anything else: kept in comparison.json only
}"""


def require_mlflow() -> Any:
    """The mlflow module, or MissingExtraError naming the extra that brings it."""
    try:
        import mlflow
    except ImportError:
        raise MissingExtraError(
            "experiment tracking needs MLflow, which is in the 'mlflow' extra: "
            "pip install 'kvprefetch[mlflow]'"
        ) from None
    return mlflow


def tracking_uri(uri: str | None = None) -> str:
    """The store used: `uri`, else $MLFLOW_TRACKING_URI, else DEFAULT_TRACKING_URI."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def _client(uri: str | None) -> Any:
    mlflow = require_mlflow()
    resolved = tracking_uri(uri)
    db = _sqlite_path(resolved)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    return mlflow.MlflowClient(tracking_uri=resolved, registry_uri=resolved)


def _sqlite_path(uri: str) -> Path | None:
    # sqlite:///relative.db and sqlite:////absolute.db (SQLAlchemy's forms)
    prefix = "sqlite:///"
    return Path(uri[len(prefix) :]) if uri.startswith(prefix) else None


def _experiment_id(client: Any, name: str, uri: str | None) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    # Without a location, a SQLite store puts artifacts in ./mlruns of whatever the working
    # directory is: beside the database instead, so the store is one folder.
    db = _sqlite_path(tracking_uri(uri))
    location = (db.parent.resolve() / "artifacts").as_uri() if db is not None else None
    return str(client.create_experiment(name, artifact_location=location))


def flat_metrics(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a nested metrics dict, names joined with "/"; the card's per_horizon
    keys become h<seconds>s (h15s/brier), and its parts keep their names (below/h15s/auc)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key == "per_horizon" and isinstance(value, dict):
            for horizon, sub in value.items():
                out.update(flat_metrics(sub, f"{prefix}h{horizon}s/"))
        elif key == "parts" and isinstance(value, dict):
            for part, sub in value.items():
                out.update(flat_metrics(sub, f"{prefix}{part}/"))
        elif isinstance(value, dict):
            out.update(flat_metrics(value, f"{prefix}{key}/"))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = float(value)
    return out


def flat_params(params: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Params as MLflow keeps them (strings): nested dicts joined with ".", lists as JSON,
    values cut to MLflow's limit (the card artifact keeps them whole)."""
    out: dict[str, str] = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out.update(flat_params(value, f"{prefix}{key}."))
            continue
        text = json.dumps(value) if isinstance(value, list | tuple) else str(value)
        out[f"{prefix}{key}"] = text[:MAX_PARAM_CHARS]
    return out


def _log(client: Any, run_id: str, params: dict[str, str], metrics: dict[str, float]) -> None:
    from mlflow.entities import Metric, Param

    items = list(params.items())
    for start in range(0, len(items), PARAMS_PER_BATCH):
        chunk = items[start : start + PARAMS_PER_BATCH]
        client.log_batch(run_id, params=[Param(k, v) for k, v in chunk])
    stamp_ms = int(time.time() * 1000)
    points = [Metric(k, v, stamp_ms, 0) for k, v in metrics.items()]
    for start in range(0, len(points), 1000):
        client.log_batch(run_id, metrics=points[start : start + 1000])


def _identity_tags(identity: dict[str, Any]) -> dict[str, str]:
    return {f"{TAG_PREFIX}{k}": str(v) for k, v in identity.items() if v is not None}


def log_training_run(
    model_dir: Path | str,
    params: dict[str, Any] | None = None,
    card: dict[str, Any] | None = None,
    uri: str | None = None,
    *,
    experiment: str = DEFAULT_EXPERIMENT,
    run_name: str | None = None,
) -> str:
    """Log one trained model as a finished run; its id. `card`: the model's card.json (read from
    model_dir when None); `params`: the command's own options (events, seed, max_rounds...),
    logged beside the card's LightGBM params and data.* (theirs win on a clash)."""
    model_dir = Path(model_dir)
    if card is None:
        card = json.loads((model_dir / "card.json").read_text())
    client = _client(uri)
    identity = model_identity(model_dir)
    tags = {
        **_identity_tags(identity),
        f"{TAG_PREFIX}kind": "training",
        f"{TAG_PREFIX}git_commit": str(card.get("git_commit")),
        **{f"{TAG_PREFIX}{k}_version": str(v) for k, v in card.get("versions", {}).items()},
    }
    run = client.create_run(
        _experiment_id(client, experiment, uri), run_name=run_name or model_dir.name, tags=tags
    )
    run_id = str(run.info.run_id)
    try:
        logged = {
            **flat_params(card.get("params", {})),
            **flat_params(card.get("data", {}), "data."),
            **flat_params(params or {}),
        }
        metrics = flat_metrics(card.get("metrics_valid", {}))
        if "tuning" in card:
            metrics["tuning/best_inner_log_loss"] = float(card["tuning"]["best_inner_log_loss"])
        _log(client, run_id, logged, metrics)
        client.log_artifacts(run_id, str(model_dir), "model")
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            (folder / "card.json").write_text(json.dumps(card, indent=2) + "\n")
            client.log_artifact(run_id, str(folder / "card.json"))
            _log_plots(client, run_id, card, folder)
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")
    return run_id


def _log_plots(client: Any, run_id: str, card: dict[str, Any], folder: Path) -> None:
    from training.card_plots import plot_calibration, plot_importance

    plots = folder / "plots"
    plots.mkdir()
    if card.get("feature_importance_gain"):
        plot_importance(card, plots / "importance.png")
    if card.get("calibration_valid"):
        plot_calibration(card, plots / "calibration.png")
    client.log_artifacts(run_id, str(plots), "plots")


def log_comparison(
    comparison: dict[str, Any],
    uri: str | None = None,
    *,
    experiment: str = DEFAULT_EXPERIMENT,
    run_name: str = "comparison",
) -> str:
    """Log an evaluation of several models (COMPARISON_SHAPE): a parent run with the split as
    params and the whole comparison as comparison.json, and one nested run per model, named by
    its directory, tagged with its identity (and kvprefetch.training_run_id, the run that trained
    it, where one was logged) and holding its metrics; the parent's id."""
    models = _checked_models(comparison)
    client = _client(uri)
    experiment_id = _experiment_id(client, experiment, uri)
    split = flat_params(comparison.get("split") or {}, "split.")
    parent = client.create_run(
        experiment_id, run_name=run_name, tags={f"{TAG_PREFIX}kind": "comparison"}
    )
    parent_id = str(parent.info.run_id)
    _log(client, parent_id, {**split, "models": str(len(models))}, {})
    client.log_dict(parent_id, comparison, "comparison.json")
    for entry in models:
        identity = entry["identity"]
        trained_by = _training_run(client, identity)
        child = client.create_run(
            experiment_id,
            run_name=Path(str(identity["dir"])).name,
            tags={
                "mlflow.parentRunId": parent_id,
                f"{TAG_PREFIX}kind": "comparison_model",
                **_identity_tags(identity),
                # The run that trained this model, where one was logged: its params and data.
                **({f"{TAG_PREFIX}training_run_id": trained_by} if trained_by else {}),
            },
        )
        _log(client, str(child.info.run_id), split, flat_metrics(entry.get("metrics") or {}))
        client.set_terminated(str(child.info.run_id), "FINISHED")
    client.set_terminated(parent_id, "FINISHED")
    return parent_id


def _checked_models(comparison: dict[str, Any]) -> list[dict[str, Any]]:
    models = comparison.get("models")
    if not isinstance(models, list) or not models:
        raise ValueError(f"a comparison needs a non-empty 'models' list: {COMPARISON_SHAPE}")
    for i, entry in enumerate(models):
        identity = entry.get("identity") if isinstance(entry, dict) else None
        if not isinstance(identity, dict) or "dir" not in identity:
            raise ValueError(f"models[{i}] has no identity with a 'dir': {COMPARISON_SHAPE}")
    return models


def slot_alias(slot: str) -> str:
    """The registry alias of a service slot ("serving", "shadow"), or of a legacy stage name
    (Production -> serving, Staging -> shadow)."""
    alias = SLOT_OF_STAGE.get(slot.capitalize(), slot)
    if alias not in SLOTS:
        raise ValueError(
            f"unknown slot {slot!r}: one of {', '.join(SLOTS)} "
            f"(or the stages {', '.join(SLOT_OF_STAGE)})"
        )
    return alias


def training_run_of(model_dir: Path | str, uri: str | None = None) -> str | None:
    """The newest training run logged for this model (same card and model.txt hashes)."""
    return _training_run(_client(uri), model_identity(model_dir))


def _training_run(client: Any, identity: dict[str, Any]) -> str | None:
    hashes = {k: identity.get(k) for k in ("model_sha256", "card_sha256")}
    if hashes["model_sha256"] is None:
        return None
    experiments = [e.experiment_id for e in client.search_experiments()]
    found = " and ".join(f"tags.`{TAG_PREFIX}{k}` = '{v}'" for k, v in hashes.items() if v)
    runs = client.search_runs(
        experiments,
        filter_string=f"tags.`{TAG_PREFIX}kind` = 'training' and {found}",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return str(runs[0].info.run_id) if runs else None


def register(
    model_dir: Path | str,
    name: str,
    slot: str | None = None,
    uri: str | None = None,
) -> dict[str, Any]:
    """Register a model directory as a new version of `name` (its training run is found by the
    model's hashes, or logged now), and point the slot's alias at it when `slot` is given
    (an alias names one version: the previous holder loses it). Returns name, version, aliases,
    source and run_id."""
    alias = slot_alias(slot) if slot is not None else None
    run_id = training_run_of(model_dir, uri) or log_training_run(model_dir, uri=uri)
    client = _client(uri)
    if not client.search_registered_models(filter_string=f"name = '{name}'"):
        client.create_registered_model(name)
    source = f"{client.get_run(run_id).info.artifact_uri}/model"
    version = client.create_model_version(
        name, source, run_id=run_id, tags=_identity_tags(model_identity(model_dir))
    )
    if alias is not None:
        client.set_registered_model_alias(name, alias, version.version)
    return _version_dict(client.get_model_version(name, version.version))


def promote(name: str, uri: str | None = None) -> dict[str, Any]:
    """As the service's promote: the shadow's version becomes serving and the shadow alias is
    removed. The promoted version, as register returns it."""
    client = _client(uri)
    version = client.get_model_version_by_alias(name, "shadow")
    client.set_registered_model_alias(name, "serving", version.version)
    client.delete_registered_model_alias(name, "shadow")
    return _version_dict(client.get_model_version(name, version.version))


def _version_dict(version: Any) -> dict[str, Any]:
    return {
        "name": version.name,
        "version": int(version.version),
        "aliases": list(version.aliases),
        "source": version.source,
        "run_id": version.run_id,
    }


def fetch(name: str, ref: str | int, dst: Path | str, uri: str | None = None) -> Path:
    """Download a registered version (`ref`: a version number, or a slot/alias such as "shadow")
    into `dst`, which then holds model.txt and card.json: a directory the service loads
    (KVP_MODEL_DIR, or PUT /v1/model/shadow when dst lies under its models root)."""
    mlflow = require_mlflow()
    client = _client(uri)
    if isinstance(ref, int) or str(ref).isdigit():
        version = client.get_model_version(name, str(ref))
    else:
        version = client.get_model_version_by_alias(name, slot_alias(str(ref)))
    # The version's own artifact location: a models:/ URI would be resolved against the
    # process-wide registry URI, not this store's.
    source = client.get_model_version_download_uri(name, version.version)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    # A folder's download lands in a subfolder named as it: its files are moved up into dst.
    with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:
        got = Path(
            mlflow.artifacts.download_artifacts(
                artifact_uri=source, dst_path=tmp, tracking_uri=tracking_uri(uri)
            )
        )
        for item in got.iterdir():
            item.replace(dst / item.name)
    model_uri = f"models:/{name}/{version.version}"
    if not (dst / "model.txt").is_file():
        raise ValueError(f"{model_uri} holds no model.txt: not a kvprefetch model")
    return dst


def versions(name: str, uri: str | None = None) -> list[dict[str, Any]]:
    """Every version of `name`, oldest first, with its aliases: the registry's history."""
    client = _client(uri)
    found = client.search_model_versions(f"name = '{name}'")
    # A search leaves the aliases out: each version is read whole.
    numbers = sorted(int(v.version) for v in found)
    return [_version_dict(client.get_model_version(name, str(n))) for n in numbers]
