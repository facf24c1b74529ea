"""training/tracking.py and `kvprefetch train --mlflow`, against a real MLflow store (SQLite
under tmp_path, no server), read back with MlflowClient."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from app.core.bundle import DEFAULT_MODEL_DIR, model_identity
from app.predict.predictors import LearnedPredictor
from kvprefetch_cli import cli
from sim.commands import events_from_trace
from tests.conftest import trace_slice
from training import build_dataset, save_model, train
from training.tracking import (
    fetch,
    log_comparison,
    log_training_run,
    promote,
    register,
    versions,
)

mlflow = pytest.importorskip("mlflow")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One store for the module: creating its tables takes seconds."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    """The synthetic trace's first 600 requests: with half validating, two horizons are
    validated, each with returns (300 requests validate one, without any)."""
    folder = tmp_path_factory.mktemp("log600")
    log = folder / "synthetic600.events.jsonl"
    events_from_trace(trace_slice(folder, "synthetic", 600), log, "default", "sticky", "none", None)
    return build_dataset([log])


@pytest.fixture(scope="module")
def model_dir(rows: pd.DataFrame, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = train(rows, valid_fraction=0.5, seed=0, num_boost_round=30)
    return save_model(model, tmp_path_factory.mktemp("models") / "tiny")


def client(store: str) -> mlflow.MlflowClient:
    return mlflow.MlflowClient(tracking_uri=store, registry_uri=store)


def artifacts(c: mlflow.MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    return {f.path for f in c.list_artifacts(run_id, path)}


def test_a_training_run_holds_params_metrics_per_horizon_card_plots_and_model(
    store: str, model_dir: Path
) -> None:
    card = json.loads((model_dir / "card.json").read_text())
    run_id = log_training_run(model_dir, {"seed": 0, "max_rounds": 30}, card, store)
    c = client(store)
    run = c.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny"
    params, metrics, tags = run.data.params, run.data.metrics, run.data.tags
    assert params["max_rounds"] == "30" and params["learning_rate"] == "0.05"
    assert params["data.rows_train"] == str(card["data"]["rows_train"])
    valid = card["metrics_valid"]
    assert metrics["brier"] == valid["brier"] and metrics["auc"] == valid["auc"]
    horizons = valid["per_horizon"]
    # The card's horizons, each logged, and no other.
    assert horizons
    assert {k for k in metrics if k.startswith("h") and k.endswith("s/brier")} == {
        f"h{h}s/brier" for h in horizons
    }
    for horizon, m in horizons.items():
        assert metrics[f"h{horizon}s/brier"] == m["brier"]
        assert metrics[f"h{horizon}s/rows"] == m["rows"]
        assert metrics[f"h{horizon}s/auc"] == m["auc"]
    assert tags["kvprefetch.model_sha256"] == model_identity(model_dir)["model_sha256"]
    assert artifacts(c, run_id) >= {"card.json", "model", "plots"}
    assert artifacts(c, run_id, "model") == {"model/card.json", "model/model.txt"}
    assert artifacts(c, run_id, "plots") == {"plots/importance.png", "plots/calibration.png"}
    plot = Path(c.download_artifacts(run_id, "plots/calibration.png", str(model_dir.parent)))
    assert plot.read_bytes().startswith(b"\x89PNG")
    logged_card = json.loads(Path(c.download_artifacts(run_id, "card.json")).read_text())
    assert logged_card == card


def comparison(model_dir: Path, other: Path) -> dict[str, object]:
    return {
        "split": {"trace": "synthetic.jsonl", "holdout": 0.3, "until_seconds": 1484.7},
        "models": [
            {
                "identity": model_identity(model_dir),
                "metrics": {"byte_hit_rate": 0.51, "per_horizon": {"15": {"brier": 0.04}}},
            },
            {"identity": model_identity(other), "metrics": {"byte_hit_rate": 0.49}},
        ],
        "baselines": {"none": {"byte_hit_rate": 0.45}},
    }


def test_a_comparison_is_a_parent_run_with_one_nested_run_per_model(
    store: str, model_dir: Path, tmp_path: Path
) -> None:
    other = tmp_path / "bundled"
    other.mkdir()
    (other / "model.txt").write_text("stand-in")
    log_training_run(model_dir, uri=store)
    logged = comparison(model_dir, other)
    parent_id = log_comparison(logged, store)
    c = client(store)
    parent = c.get_run(parent_id)
    assert parent.data.params["split.holdout"] == "0.3" and parent.data.params["models"] == "2"
    assert json.loads(Path(c.download_artifacts(parent_id, "comparison.json")).read_text()) == (
        logged
    )
    children = c.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'"
    )
    by_name = {r.info.run_name: r for r in children}
    assert set(by_name) == {"tiny", "bundled"}
    tiny = by_name["tiny"].data
    assert tiny.metrics == {"byte_hit_rate": 0.51, "h15s/brier": 0.04}
    assert tiny.tags["kvprefetch.card_sha256"] == model_identity(model_dir)["card_sha256"]
    trained_by = c.get_run(tiny.tags["kvprefetch.training_run_id"])
    assert trained_by.data.tags["kvprefetch.kind"] == "training"
    assert (
        trained_by.data.tags["kvprefetch.model_sha256"] == model_identity(model_dir)["model_sha256"]
    )
    assert "kvprefetch.training_run_id" not in by_name["bundled"].data.tags  # never logged
    assert tiny.params["split.trace"] == "synthetic.jsonl"
    assert by_name["bundled"].data.metrics == {"byte_hit_rate": 0.49}


def test_a_comparison_without_model_identities_is_refused(store: str) -> None:
    with pytest.raises(ValueError, match="identity"):
        log_comparison({"models": [{"metrics": {"brier": 0.1}}]}, store)
    with pytest.raises(ValueError, match="non-empty 'models'"):
        log_comparison({"split": {}}, store)


def test_registered_versions_carry_slot_aliases_and_fetch_to_a_loadable_dir(
    store: str, model_dir: Path, tmp_path: Path
) -> None:
    first = register(model_dir, "arrival", "serving", store)
    assert first["version"] == 1 and first["aliases"] == ["serving"]
    # The model's training run is found by its hashes: the second registration logs none.
    assert client(store).get_run(first["run_id"]).data.tags["kvprefetch.kind"] == "training"
    second = register(model_dir, "arrival", "Staging", store)  # a legacy stage: the shadow slot
    assert second["aliases"] == ["shadow"] and second["run_id"] == first["run_id"]

    shadow = fetch("arrival", "shadow", tmp_path / "models" / "arrival-shadow", store)
    assert (shadow / "model.txt").read_bytes() == (model_dir / "model.txt").read_bytes()
    assert LearnedPredictor(shadow).version == "arrival-shadow"
    assert (fetch("arrival", 1, tmp_path / "v1", store) / "card.json").is_file()

    promoted = promote("arrival", store)
    assert promoted["version"] == 2 and promoted["aliases"] == ["serving"]
    history = list(versions("arrival", store))
    assert [(v["version"], v["aliases"]) for v in history] == [(1, []), (2, ["serving"])]
    with pytest.raises(ValueError, match="unknown slot"):
        register(model_dir, "arrival", "Archived", store)


def test_registering_an_unlogged_model_logs_its_run(
    store: str, rows: pd.DataFrame, tmp_path: Path
) -> None:
    fresh = save_model(train(rows, seed=1, num_boost_round=5), tmp_path / "fresh")
    version = register(fresh, "fresh", None, store)
    assert version["aliases"] == []
    run = client(store).get_run(version["run_id"])
    assert run.data.tags["kvprefetch.model_sha256"] == model_identity(fresh)["model_sha256"]


def test_train_mlflow_logs_the_written_model(store: str, tiny_log: Path, tmp_path: Path) -> None:
    out = tmp_path / "m"
    args = ["train", "--events", str(tiny_log), "--out", str(out), "--max-rounds", "20"]
    result = CliRunner().invoke(cli, [*args, "--json", "--mlflow-uri", store])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)
    c = client(store)
    sha = model_identity(out)["card_sha256"]
    [run] = c.search_runs(
        [c.get_experiment_by_name("kvprefetch").experiment_id],
        f"tags.`kvprefetch.card_sha256` = '{sha}'",
    )
    assert run.data.metrics["brier"] == metrics["brier"]
    assert run.data.params["max_rounds"] == "20" and run.data.params["tune"] == "0"
    assert run.data.tags["kvprefetch.kind"] == "training"
    # The artifacts lie beside the database, not in the working directory's ./mlruns.
    db = Path(store.removeprefix("sqlite:///"))
    assert run.info.artifact_uri.startswith((db.parent / "artifacts").as_uri())


def test_train_mlflow_without_the_extra_names_it(
    tiny_log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)
    out = tmp_path / "m"
    result = CliRunner().invoke(
        cli, ["train", "--events", str(tiny_log), "--out", str(out), "--mlflow"]
    )
    assert result.exit_code != 0 and "kvprefetch[mlflow]" in "".join(
        result.output.replace("│", "").split()
    )
    assert not out.exists()


def test_the_registry_commands_register_fetch_promote_and_list(
    store: str, model_dir: Path, tmp_path: Path
) -> None:
    def run(*args: str) -> str:
        result = CliRunner().invoke(cli, ["registry", *args, "--mlflow-uri", store])
        assert result.exit_code == 0, result.output
        assert result.stderr == ""  # no progress bars, no INFO lines
        return result.stdout

    name = ["--name", "cli-arrival"]
    first = json.loads(run("register", str(model_dir), *name, "--slot", "serving"))
    assert first["version"] == 1 and first["aliases"] == ["serving"]
    assert json.loads(run("register", str(model_dir), *name, "--slot", "shadow"))["version"] == 2
    out = tmp_path / "models" / "fetched"
    assert run("fetch", "shadow", "--out", str(out), *name).strip() == str(out)
    assert LearnedPredictor(out).version == "fetched"
    assert json.loads(run("promote", *name))["aliases"] == ["serving"]
    listed = [json.loads(line) for line in run("list", *name).splitlines()]
    assert [(v["version"], v["aliases"]) for v in listed] == [(1, []), (2, ["serving"])]
    refused = CliRunner().invoke(
        cli, ["registry", "fetch", "shadow", "--out", str(out), *name, "--mlflow-uri", store]
    )
    assert refused.exit_code != 0 and "shadow" in refused.output  # promote cleared the shadow


def test_evaluate_mlflow_logs_the_comparison_with_a_run_per_model(
    store: str, model_dir: Path, tmp_path: Path
) -> None:
    """`kvprefetch evaluate --mlflow-uri`: the comparison's split as params, and per model a
    nested run named by its directory, with its replay's and its held-out rows' metrics."""
    trace = trace_slice(tmp_path, "synthetic", 300)
    result = CliRunner().invoke(
        cli,
        [
            "evaluate",
            "--models",
            f"{DEFAULT_MODEL_DIR},{model_dir}",
            "--trace",
            str(trace),
            "--jobs",
            "1",
            "--json",
            "--mlflow-uri",
            store,
        ],
    )
    assert result.exit_code == 0, result.output
    compared = json.loads(result.stdout)
    c = client(store)
    parents = c.search_runs(
        [e.experiment_id for e in c.search_experiments()], "tags.`kvprefetch.kind` = 'comparison'"
    )
    parent = next(
        r
        for r in parents
        if r.data.params.get("split.measure_from_seconds")
        == str(compared["split"]["measure_from_seconds"])
        and r.data.params.get("split.trace") == trace.name
    )
    children = c.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    by_name = {r.info.run_name: r.data.metrics for r in children}
    assert set(by_name) == {DEFAULT_MODEL_DIR.name, model_dir.name}
    for m in compared["models"]:
        logged = by_name[Path(m["model"]["dir"]).name]
        assert logged["byte_hit_rate"] == pytest.approx(m["byte_hit_rate"])
        assert logged["prediction/brier"] == pytest.approx(m["prediction"]["brier"])


def test_the_registry_commands_load_no_training_code(tmp_path: Path) -> None:
    # In a process of its own (this one has imported training): the registry's commands need
    # MLflow alone, not LightGBM or scikit-learn (1.5 s of each command's start).
    import subprocess

    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from kvprefetch_cli import cli\n"
        "r = CliRunner().invoke(cli, ['registry', 'list', '--mlflow-uri', sys.argv[1]])\n"
        "assert r.exit_code == 0, r.output\n"
        "print(sorted(m for m in ('lightgbm', 'sklearn', 'training.train') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, f"sqlite:///{tmp_path / 'mlflow.db'}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
