"""`kvprefetch agent` and `kvprefetch-agent` on the command line (the e2e test runs it for real)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.core.config import Settings
from kvprefetch_cli import cli
from kvprefetch_client.agent.cli import StreamDefaults, mooncake_settings, parser
from kvprefetch_client.agent.cli import main as agent_main
from kvprefetch_client.agent.mooncake import MooncakeSettings


def test_agent_refuses_an_unknown_source(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli,
        [
            "agent",
            "--instance-id",
            "gpu-0",
            "--pool-dir",
            str(tmp_path),
            "--capacity-bytes",
            "1000",
            "--source",
            "carrier-pigeon",
        ],
    )
    assert result.exit_code == 2
    assert "stream or pull" in result.output


def test_agent_needs_its_instance_pool_and_capacity() -> None:
    result = CliRunner().invoke(cli, ["agent", "--instance-id", "gpu-0"])
    assert result.exit_code == 2 and "--pool-dir" in result.output


def test_kvprefetch_agent_is_the_light_command_with_its_options() -> None:
    result = CliRunner().invoke(cli, ["agent", "--help"])
    assert result.exit_code == 0
    assert "usage: kvprefetch agent" in result.output and "--capacity-bytes" in result.output


def test_the_light_command_refuses_a_capacity_below_one_byte(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        agent_main(["--instance-id", "gpu-0", "--pool-dir", str(tmp_path), "--capacity-bytes", "0"])
    assert exit_info.value.code == 2 and "--capacity-bytes" in capsys.readouterr().err


def test_the_stream_defaults_are_the_services_variables() -> None:
    assert StreamDefaults.from_environ({}) == StreamDefaults(
        redis_url="redis://127.0.0.1:6379/0", stream_prefix="kvp:sink", claim_idle_seconds=30.0
    )
    env = {
        "KVP_REDIS_URL": "redis://r:1/2",
        "KVP_REDIS_PREFIX": "p",
        "KVP_ORDER_CLAIM_IDLE_SECONDS": "2.5",
    }
    assert StreamDefaults.from_environ(env) == StreamDefaults(
        redis_url="redis://r:1/2", stream_prefix="p:sink", claim_idle_seconds=2.5
    )
    with_prefix = StreamDefaults.from_environ({**env, "KVP_ORDER_STREAM_PREFIX": "orders"})
    assert with_prefix.stream_prefix == "orders"
    # What the service's settings make of the same environment, so an agent beside it needs no
    # options.
    settings = Settings(_env_file=None)
    assert StreamDefaults.from_environ() == StreamDefaults(
        redis_url=settings.redis_url.get_secret_value(),
        stream_prefix=settings.stream_prefix,
        claim_idle_seconds=settings.order_claim_idle_seconds,
    )


def test_the_tier_is_buffer_or_mooncake_and_the_buffer_needs_its_pool(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        agent_main(["--instance-id", "gpu-0", "--tier", "tape"])
    assert exit_info.value.code == 2 and "buffer or mooncake" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        agent_main(["--instance-id", "gpu-0", "--capacity-bytes", "10"])
    assert exit_info.value.code == 2 and "--pool-dir" in capsys.readouterr().err


def test_the_mooncake_options_override_their_variables() -> None:
    args = parser().parse_args(
        ["--instance-id", "gpu-0", "--tier", "mooncake", "--mooncake-master", "m:1"]
    )
    env = {"KVP_MOONCAKE_MASTER": "env:1", "KVP_MOONCAKE_NAMESPACE": "llama"}
    s = mooncake_settings(args, env)
    assert (s.master_address, s.namespace) == ("m:1", "llama")
    assert s.metadata_url == MooncakeSettings().metadata_url
