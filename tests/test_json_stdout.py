"""Every `--json` prints one JSON object alone on stdout (issue 30): each command run as a real
process (library output below Python, such as LightGBM's from Dask workers, reaches the file
descriptor, not Python's sys.stdout), its whole stdout parsed by json.loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from app.core.bundle import DEFAULT_MODEL_DIR
from kvprefetch_cli import cli
from sim.commands import events_from_trace
from tests.conftest import small_model_dir, trace_slice

REPO = Path(__file__).resolve().parents[1]

# The --json commands whose own tests already run them as a process through kvprefetch_cli's main
# and require exactly one JSON object on stdout (tests/bench/conftest.py run_bench), or that need a
# server this test does not start: where each is tested.
TESTED_ELSEWHERE = {
    "bench ingest": "tests/bench/test_bench_smoke.py",
    "bench vllm-intake": "tests/bench/test_bench_vllm_intake.py",
    "bench load": "tests/bench/test_bench_load.py",
    "bench redis-io": "tests/bench/test_bench_redis_io.py",
    "bench planner": "tests/bench/test_bench_planner.py",
    "bench train-fleet": "tests/bench/test_bench_train_fleet.py",
    "bench mooncake": "tests/client/agent/test_mooncake_bench.py",
    "compile-model": "tests/predict/test_predictors_fast.py",
}

# A targets run over one small case, not issue 14's dozens: the case list is all that is swapped.
TARGETS_SMALL = (
    "import sys; import sim.targets as t; "
    "case = t.Case(sys.argv[1], 'sticky', ('none', 'learned', 'clairvoyant', 'oracle')); "
    "t.cases = lambda: [case]; "
    "from kvprefetch_cli import main; sys.argv = ['kvprefetch', *sys.argv[2:]]; main()"
)


def json_commands(group: Any, prefix: str = "") -> Iterator[str]:
    """The paths of the commands under `group` (a click group) with a --json option."""
    for name, command in group.commands.items():
        path = f"{prefix}{name}"
        if hasattr(command, "commands"):
            yield from json_commands(command, path + " ")
        elif any("--json" in getattr(p, "opts", ()) for p in command.params):
            yield path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("json-stdout")
    trace = trace_slice(folder, "synthetic", 300)
    log = folder / "synthetic300.events.jsonl"
    events_from_trace(trace, log, "default", "sticky", "none", None)
    # bench predict compiles its model cold: a small one (the bundled one takes minutes).
    return {"dir": folder, "trace": trace, "log": log, "small_model": small_model_dir(folder / "m")}


def cases(i: dict[str, Path]) -> dict[str, list[str]]:
    """Each --json command with cheap inputs: the arguments after the program."""
    trace, log, out = str(i["trace"]), str(i["log"]), i["dir"]
    return {
        "replay": ["replay", "--trace", trace, "--policy", "learned"],
        "replay --compare": ["replay", "--trace", trace, "--compare", "none,learned"],
        "targets": ["targets", "--traces", str(out), "--seeds", "1", "--jobs", "1"],
        "evaluate": [
            "evaluate",
            "--models",
            str(DEFAULT_MODEL_DIR),
            "--trace",
            trace,
            "--jobs",
            "1",
        ],
        "train": ["train", "--events", log, "--out", str(out / "m"), "--max-rounds", "20"],
        "train --dask": [
            "train",
            "--events",
            log,
            "--out",
            str(out / "m-dask"),
            "--max-rounds",
            "20",
            "--quiet",
            "--dask",
            "local:2",
        ],
        "bench memory": ["bench", "memory", "--sessions", "200", "--jobs", "1"],
        "bench replay": ["bench", "replay", "--trace", trace, "--rounds", "1"],
        "bench predict": [
            "bench",
            "predict",
            "--model",
            str(i["small_model"]),
            "--sessions",
            "50",
            "--rounds",
            "1",
            "--pass-sessions",
            "60,90",
        ],
        "bench plan": [
            "bench",
            "plan",
            "--sessions",
            "100",
            "--instances",
            "2",
            "--ticks",
            "2",
            "--page",
            "8",
            "--pass-sessions",
            "100",
        ],
    }


CASE_NAMES = list(cases({"dir": Path(), "trace": Path(), "log": Path(), "small_model": Path()}))


def module_cases(i: dict[str, Path]) -> dict[str, list[str]]:
    """Each `python -m` tool with a --json flag, with cheap inputs: the arguments after `-m`."""
    return {
        "training.formulations": ["training.formulations", "--events", str(i["log"])],
        "training.thresholds": [
            "training.thresholds",
            "--model",
            str(DEFAULT_MODEL_DIR),
            "--trace",
            str(i["trace"]),
            "--window",
            "0.6",
            "1.0",
            "--setting",
            "{}",
        ],
    }


MODULE_NAMES = list(
    module_cases({"dir": Path(), "trace": Path(), "log": Path(), "small_model": Path()})
)


def test_every_json_command_is_covered() -> None:
    found = set(json_commands(typer.main.get_command(cli)))
    covered = {name.split(" --")[0] for name in CASE_NAMES} | set(TESTED_ELSEWHERE)
    assert found == covered
    for name, test_file in TESTED_ELSEWHERE.items():
        source = (REPO / test_file).read_text()
        # run_bench adds --json itself.
        asks_json = '"--json"' in source or "run_bench(" in source
        assert f'"{name.split()[-1]}"' in source and asks_json, test_file


def test_every_json_module_is_covered() -> None:
    # The modules whose own argument parser takes --json (kvprefetch_cli's commands are found
    # above).
    found = {
        ".".join(path.relative_to(REPO).with_suffix("").parts)
        for folder in ("training", "sim", "bench")
        for path in (REPO / folder).rglob("*.py")
        if 'add_argument("--json"' in path.read_text()
    }
    assert found == set(MODULE_NAMES)


@pytest.mark.parametrize("name", MODULE_NAMES)
def test_module_json_alone_on_stdout(name: str, inputs: dict[str, Path]) -> None:
    command = [sys.executable, "-m", *module_cases(inputs)[name], "--json"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)  # the whole of stdout: nothing before or after
    assert doc


@pytest.mark.parametrize("name", CASE_NAMES)
def test_json_alone_on_stdout(name: str, inputs: dict[str, Path]) -> None:
    args = [*cases(inputs)[name], "--json"]
    if name == "targets":
        command = [sys.executable, "-c", TARGETS_SMALL, inputs["trace"].name, *args]
    else:
        command = [sys.executable, "-m", "kvprefetch_cli", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)  # the whole of stdout: nothing before or after the object
    assert isinstance(doc, dict) and doc
    if name.startswith("train"):
        # The card's command is the one typed, not `python -m kvprefetch_cli`'s words.
        out = Path(args[args.index("--out") + 1])
        card = json.loads((out / "card.json").read_text())
        assert card["command"].startswith("kvprefetch train --events ")
