"""Installable anywhere: the project's two wheels in a fresh venv outside the checkout serve with
the bundled model and replay every shipped scenario as the checkout does. The venv holds the two
wheels; their third-party dependencies are borrowed from the test run's venv (tests/fresh_venv.py
says why); the light client's test installs its dependencies from the index."""

from __future__ import annotations

import json
import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import httpx
import pytest

from app.core.bundle import DEFAULT_MODEL_DIR, SCENARIO_DIR
from tests.conftest import trace_slice
from tests.fresh_venv import REPO, build_wheels, clean_env, make_venv, run, serving

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

# Enough of the conversation trace for the scenarios to differ (tight-hbm stalls on it).
TRACE_REQUESTS = 300
# What only the simulator, training and the benches need: never in the base install's requirements.
NOT_IN_BASE = {"matplotlib", "scikit-learn", "pandas", "dask"}


def _replay(
    kvprefetch: list[str],
    trace: Path,
    scenario: str,
    policy: str,
    *,
    cwd: Path,
    env: dict[str, str],
) -> dict[str, object]:
    done = run(
        [
            *kvprefetch,
            "replay",
            "--trace",
            str(trace),
            "--scenario",
            scenario,
            "--policy",
            policy,
            "--json",
        ],
        cwd=cwd,
        env=env,
    )
    result = json.loads(done.stdout)
    del result["wall_seconds"]  # the one figure that is the machine's, not the replay's
    return dict(result)


def test_the_wheels_serve_the_bundled_model_and_replay_the_shipped_scenarios(
    tmp_path: Path,
) -> None:
    wheels = build_wheels(tmp_path / "build", server=True)
    assert sorted(w.name.split("-")[0] for w in wheels) == ["kvprefetch", "kvprefetch_client"]
    bin_dir = make_venv(tmp_path / "venv", wheels, borrow_deps=True)
    work = tmp_path / "work"  # outside the checkout: nothing of it is on the path
    work.mkdir()
    env = clean_env()

    # The installed package finds the wheel's copies, inside the venv, and they are the
    # checkout's files.
    script = (
        "from app.core.bundle import DEFAULT_MODEL_DIR, SCENARIO_DIR; "
        "print(DEFAULT_MODEL_DIR); print(SCENARIO_DIR)"
    )
    where = run([str(bin_dir / "python"), "-c", script], cwd=work, env=env).stdout.split()
    checkout_dirs = (DEFAULT_MODEL_DIR, SCENARIO_DIR)
    for installed, checkout in zip(map(Path, where), checkout_dirs, strict=True):
        assert installed.is_relative_to(tmp_path / "venv"), installed
        names = sorted(p.name for p in checkout.iterdir())
        assert sorted(p.name for p in installed.iterdir()) == names
        for name in names:
            assert (installed / name).read_bytes() == (checkout / name).read_bytes(), name

    service_env = clean_env(
        KVP_STORE="memory", KVP_HOST="127.0.0.1", KVP_DATA_DIR=str(tmp_path / "data")
    )
    with serving([str(bin_dir / "kvprefetch"), "serve"], cwd=work, env=service_env) as url:
        model = httpx.get(f"{url}/v1/model", timeout=5).json()
    # The heuristic (version null) serves when the model is missing or does not load.
    assert (model["predictor"], model["version"]) == ("learned (default)", "default")

    trace = trace_slice(work, "conversation_first60", TRACE_REQUESTS)
    checkout_env = clean_env(PYTHONPATH=f"{REPO}:{REPO / 'client'}")
    scenarios = sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))
    assert scenarios, "no shipped scenario"
    # Every scenario without a model (cheap), and the bundled model's policy on the default one
    # (the learned replay takes several times as long).
    for scenario, policy in [*((s, "none") for s in scenarios), ("default", "learned")]:
        installed_result = _replay(
            [str(bin_dir / "kvprefetch")], trace, scenario, policy, cwd=work, env=env
        )
        assert (installed_result["scenario"], installed_result["policy"]) == (scenario, policy)
        assert installed_result["requests"] == TRACE_REQUESTS
        checkout_result = _replay(
            [sys.executable, "-m", "kvprefetch_cli"],
            trace,
            scenario,
            policy,
            cwd=work,
            env=checkout_env,
        )
        # The same model wherever it lies: its hashes agree, its directory is the wheel's copy.
        for result in (installed_result, checkout_result):
            if "model" in result:
                result["model"].pop("dir")
        assert installed_result == checkout_result, (scenario, policy)


def test_the_base_wheel_is_the_service_and_its_command_is_kvprefetch_cli(tmp_path: Path) -> None:
    (wheel,) = [
        w for w in build_wheels(tmp_path / "build", server=True) if w.name.startswith("kvprefetch-")
    ]
    with zipfile.ZipFile(wheel) as whl:
        info = next(n.split("/")[0] for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(whl.read(f"{info}/METADATA").decode())
        entry_points = whl.read(f"{info}/entry_points.txt").decode()
        assert "kvprefetch_cli/__main__.py" in whl.namelist()
    base, extras = set(), set()
    for requirement in metadata.get_all("Requires-Dist") or []:
        name = re.match(r"[A-Za-z0-9._-]+", requirement)
        assert name is not None, requirement
        normalised = name.group().lower().replace("_", "-")
        (extras if "extra ==" in requirement else base).add(normalised)
    assert {"fastapi", "lightgbm", "typer", "kvprefetch-client"} <= base
    assert not base & NOT_IN_BASE, base & NOT_IN_BASE
    assert extras >= NOT_IN_BASE
    assert {"sim", "training", "bench", "all"} <= set(metadata.get_all("Provides-Extra") or [])
    scripts = entry_points.split("[console_scripts]")[1].split("[")[0]
    assert [line.replace(" ", "") for line in scripts.split("\n") if line.strip()] == [
        "kvprefetch=kvprefetch_cli:main"
    ]
