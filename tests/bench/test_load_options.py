"""`LoadOptions`: the defaults `kvprefetch bench load` shows are its own, its checks, and what
follows from it (the service's environment, the JSON's `config`, the mode), without a run."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from bench.cli import bench
from bench.load import LoadOptions

SETTINGS = {
    "dedupe_max_ids": 5000,
    "session_retention_seconds": 60.0,
    "reorder_window_seconds": 2.0,
}


def test_the_command_defaults_are_the_options_defaults() -> None:
    command = typer.main.get_command(bench)
    assert isinstance(command, typer.core.TyperGroup)
    params = {p.name: p.default for p in command.commands["load"].params}
    defaults = LoadOptions()
    for field in dataclasses.fields(LoadOptions):
        if field.name != "service_env":  # the command's is a list of KVP_X=V, parsed
            assert params[field.name] == getattr(defaults, field.name), field.name


def test_the_command_passes_its_options_to_run(monkeypatch: pytest.MonkeyPatch) -> None:
    got: list[LoadOptions] = []

    def run(options: LoadOptions) -> dict[str, Any]:
        got.append(options)
        return {}

    monkeypatch.setattr("bench.load.driver.run", run)
    args = ["load", "--no-fsync", "--seed", "3", "--service-env", "KVP_A=x=1", "--json"]
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output
    assert got == [LoadOptions(fsync=False, seed=3, service_env={"KVP_A": "x=1"})]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--service-env", "A=1"], "KVP_NAME=VALUE"),
        (["--store", "disk"], "store must be memory or redis"),
        (["--hint-connections", "0", "--hints-per-second", "5"], "needs hint connections"),
    ],
)
def test_the_command_refuses_bad_options_before_a_run(args: list[str], message: str) -> None:
    result = CliRunner().invoke(bench, ["load", *args])
    assert result.exit_code == 2
    assert message in result.output


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"store": "disk"}, "store must be memory or redis"),
        ({"duration_seconds": 0}, "durations must be positive"),
        ({"sample_seconds": -1}, "durations must be positive"),
        ({"warmup_seconds": -1}, "durations must be positive"),
        ({"ceiling_seconds": -1}, "durations must be positive"),
        ({"batch_size": 0}, "event connections must be at least 1"),
        ({"hint_connections": -1}, "event connections must be at least 1"),
        ({"events_per_second": 0}, "offered rates must be positive"),
        ({"hints_per_second": -1.0}, "offered rates must be positive"),
        ({"hint_connections": 0, "hints_per_second": 5.0}, "needs hint connections"),
        ({"instances": 2, "event_connections": 3}, "instances >= event connections"),
    ],
)
def test_validate_refuses_what_cannot_make_a_run(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(LoadOptions(), **changes).validate()


def test_validate_takes_the_defaults_and_zero_warmup_ceiling_and_hints() -> None:
    LoadOptions().validate()
    LoadOptions(warmup_seconds=0, ceiling_seconds=0, hint_connections=0).validate()


def test_the_service_environment_is_the_options_then_service_env() -> None:
    assert LoadOptions().service_environment("redis://r", "p") == {
        "KVP_HOST": "127.0.0.1",
        "KVP_STORE": "memory",
        "KVP_LOG_FSYNC": "true",
        "KVP_REPLICA_ID": "bench-load",
        "KVP_SESSION_RETENTION_SECONDS": "60",
    }
    env = LoadOptions(
        store="redis",
        fsync=False,
        dedupe_max_ids=7,
        session_retention_seconds=2.5,
        service_env={"KVP_HOST": "127.0.0.2"},
    ).service_environment("redis://r", "p")
    assert env["KVP_HOST"] == "127.0.0.2" and env["KVP_LOG_FSYNC"] == "false"
    assert (env["KVP_REDIS_URL"], env["KVP_REDIS_PREFIX"]) == ("redis://r", "p")
    assert (env["KVP_DEDUPE_MAX_IDS"], env["KVP_SESSION_RETENTION_SECONDS"]) == ("7", "2.5")
    # --service-env's KVP_DEDUPE_MAX_IDS wins over the option, and must be an integer.
    both = LoadOptions(dedupe_max_ids=7, service_env={"KVP_DEDUPE_MAX_IDS": "9"})
    assert both.service_environment("", "")["KVP_DEDUPE_MAX_IDS"] == "9"
    with pytest.raises(ValueError, match="invalid literal"):
        LoadOptions(service_env={"KVP_DEDUPE_MAX_IDS": "many"}).service_environment("", "")


def test_the_record_hides_tokens_and_the_data_dir_and_takes_the_settings_in_force() -> None:
    options = LoadOptions(token="secret", service_env={"KVP_INGEST_TOKEN": "secret"})
    env = {**options.service_environment("", ""), "KVP_DATA_DIR": "/tmp/x"}
    record = options.record(env, SETTINGS)
    assert "secret" not in repr(record)
    assert record["token"] == "set" and record["service_env"]["KVP_INGEST_TOKEN"] == "set"
    assert "KVP_DATA_DIR" not in record["service_env"]
    assert list(record["service_env"]) == sorted(record["service_env"])
    assert record["dedupe_max_ids"] == 5000 and record["reorder_window_seconds"] == 2.0
    assert record["mode"] == "closed-loop, full speed"
    assert LoadOptions().record({}, SETTINGS)["token"] is None


def test_the_mode_names_each_offered_rate() -> None:
    assert LoadOptions(events_per_second=2000.0).mode == (
        "open-loop: 2000 events/s offered, hints closed-loop; latency from each call's "
        "scheduled start"
    )
    assert LoadOptions(hints_per_second=20.0).mode.startswith(
        "open-loop: events closed-loop, 20 hints/s offered"
    )
