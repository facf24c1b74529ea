"""`kvprefetch token` and the bind check of `kvprefetch serve`."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import cli
from app.core.config import Settings
from app.core.security import Scope, load_tokens


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
