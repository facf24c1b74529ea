"""`kvprefetch agent` on the command line (the e2e test runs it for real)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from app.cli import cli


def test_agent_refuses_an_unknown_source(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["agent", "--instance-id", "gpu-0", "--pool-dir", str(tmp_path),
                                      "--capacity-bytes", "1000", "--source", "carrier-pigeon"])
    assert result.exit_code == 2
    assert "stream or pull" in result.output


def test_agent_needs_its_instance_pool_and_capacity() -> None:
    result = CliRunner().invoke(cli, ["agent", "--instance-id", "gpu-0"])
    assert result.exit_code == 2 and "--pool-dir" in result.output
