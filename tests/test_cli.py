"""`kvprefetch token` and the bind check of `kvprefetch serve`; the command line put together from
the packages' commands, and what a command does without its extra (a base install)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from app.core.config import Settings
from app.core.extras import EXTRA_MODULES
from app.core.security import Scope, load_tokens
from kvprefetch_cli import cli

REPO = Path(__file__).resolve().parent.parent
# Every command, as users, the docs and the tests type it: moving the code keeps them all.
COMMANDS = {
    "serve", "token", "agent", "connect vllm", "compile-model",
    "replay", "agent-trace", "targets", "events-from-trace", "trace import",
    "train", "evaluate", "log compact",
    "registry register", "registry fetch", "registry promote", "registry list",
    "bench ingest", "bench vllm-intake", "bench memory", "bench replay", "bench predict",
    "bench mooncake", "bench plan", "bench train-fleet", "bench load", "bench redis-io",
    "bench planner",
}  # fmt: skip
# A distribution -> the module it installs, where the two names differ.
MODULE_OF = {"scikit-learn": "sklearn"}
# As a base install: the extras' modules cannot be found or imported (None in sys.modules).
BASE_INSTALL = """
import sys
for name in ("pandas", "sklearn", "matplotlib"):
    sys.modules[name] = None
sys.argv = ["kvprefetch", *sys.argv[1:]]
from kvprefetch_cli import main
main()
"""


def test_token_prints_a_token_and_its_file_entry_with_a_digest_only(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["token", "--name", "router-a", "--scope", "ingest", "--scope", "agent"]
    )
    assert result.exit_code == 0, result.output
    token = result.stdout.strip()
    assert len(token) >= 40
    assert token not in result.stderr
    path = tmp_path / "tokens.toml"
    path.write_text(result.stderr)
    assert tomllib.loads(result.stderr)["tokens"][0]["name"] == "router-a"
    principal = load_tokens(Settings(tokens_file=path)).authenticate(token)
    assert principal is not None and principal.scopes == {Scope.INGEST, Scope.AGENT, Scope.READ}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--name", "a b", "--scope", "ingest"], "letters, digits"),
        (["--name", "a", "--scope", "root"], "ingest, agent or admin"),
        (["--name", "a", "--scope", "read"], "at least one of ingest, agent, admin"),
    ],
)
def test_token_refuses_a_bad_name_or_scope(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["token", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_serve_without_tokens_refuses_a_public_address(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # no .env of the checkout
    for name in ("KVP_INGEST_TOKEN", "KVP_AGENT_TOKEN", "KVP_ADMIN_TOKEN", "KVP_TOKENS_FILE"):
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(cli, ["serve", "--host", "0.0.0.0", "--port", "1"])
    assert result.exit_code == 2
    assert (
        "no tokens are configured, so the service may listen on 127.0.0.1 only, not 0.0.0.0"
        in result.output
    )


def test_serve_judges_an_inherited_socket_by_the_address_it_is_bound_to(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import socket

    monkeypatch.chdir(tmp_path)
    for name in ("KVP_INGEST_TOKEN", "KVP_AGENT_TOKEN", "KVP_ADMIN_TOKEN", "KVP_TOKENS_FILE"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as public:
        public.bind(("0.0.0.0", 0))
        # --host says loopback; the socket handed over is bound to every address. The command
        # owns the descriptor it is given: a copy.
        handed = os.dup(public.fileno())
        result = CliRunner().invoke(cli, ["serve", "--host", "127.0.0.1", "--fd", str(handed)])
    assert result.exit_code == 2
    assert "may listen on 127.0.0.1 only, not 0.0.0.0" in result.output


def test_serve_refuses_an_fd_that_is_not_a_socket(tmp_path: Path) -> None:
    with (tmp_path / "file").open("w") as f:
        result = CliRunner().invoke(cli, ["serve", "--fd", str(os.dup(f.fileno()))])
    assert result.exit_code == 2
    assert "'--fd'" in result.output and "not a listening socket" in result.output


def _leaves(command: Any, words: tuple[str, ...] = ()) -> set[str]:
    subcommands = getattr(command, "commands", None)
    if not subcommands:
        return {" ".join(words)}
    return {leaf for name, sub in subcommands.items() for leaf in _leaves(sub, (*words, name))}


def test_the_root_holds_every_command_of_every_package() -> None:
    assert _leaves(typer.main.get_command(cli)) == COMMANDS


def test_each_extra_is_told_by_the_modules_its_distributions_install() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra, modules in EXTRA_MODULES.items():
        names = {req.split(">")[0].split("=")[0].split("[")[0] for req in extras[extra]}
        assert set(modules) == {MODULE_OF.get(n, n) for n in names}, extra
    assert set(EXTRA_MODULES) <= {e.split(",")[0] for e in extras}
    assert extras["all"] == ["kvprefetch[sim,training,bench,tune,fleet,mlflow]"]


def _base_install(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
    return subprocess.run(
        [sys.executable, "-c", BASE_INSTALL, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "extra"),
    [
        (["train", "--events", "x.jsonl", "--out", "m"], "training"),
        (["registry", "list"], "training"),
        (["replay", "--trace", "t.jsonl"], "sim"),
        (["trace", "import", "--from", "tracelab", "in.jsonl", "--out", "o.jsonl"], "sim"),
        (["bench", "memory"], "bench"),
    ],
)
def test_a_command_without_its_extra_names_it_in_one_line(args: list[str], extra: str) -> None:
    done = _base_install(*args)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    missing = EXTRA_MODULES[extra][0]
    assert line.startswith(f"kvprefetch {args[0]}")
    assert line.endswith(
        f"needs the '{extra}' extra (no module {missing}): pip install 'kvprefetch[{extra}]'"
    )


def test_help_and_the_services_commands_need_no_extra() -> None:
    for args, code in (
        ([], 2),
        (["--help"], 0),
        (["serve", "--help"], 0),
        (["train", "--help"], 0),
    ):
        done = _base_install(*args)
        assert done.returncode == code and "Usage:" in done.stdout + done.stderr, args
        assert "extra (no module" not in done.stderr, args
    token = _base_install("token", "--name", "base", "--scope", "ingest")
    assert token.returncode == 0, token.stderr
    assert len(token.stdout.strip()) >= 40


def test_the_service_serves_its_model_without_the_extras(tmp_path: Path) -> None:
    script = BASE_INSTALL.split("sys.argv")[0] + (
        "from fastapi.testclient import TestClient\n"
        "from app.api.main import create_app\n"
        "from app.core.config import Settings\n"
        f"settings = Settings(data_dir={str(tmp_path)!r}, store='memory')\n"
        "with TestClient(create_app(settings)) as client:\n"
        "    print(client.get('/v1/model').json()['predictor'])\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'sim', 'training', 'bench'}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'client'}"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["learned (default)", "[]"]
