from __future__ import annotations

from pathlib import Path

import pytest

from app.core.config import Settings
from app.core.errors import ConfigError
from app.core.security import (
    LOCAL,
    Scope,
    TokenTable,
    check_bind,
    is_loopback,
    load_tokens,
    token_digest,
)

INGEST = "ingest-token-0123456789"
ADMIN = "admin-token-0123456789ab"
AGENT = "agent-token-0123456789a"


def test_env_tokens_grant_their_scope_and_read() -> None:
    table = load_tokens(Settings(ingest_token=INGEST, admin_token=ADMIN))
    ingest = table.authenticate(INGEST)
    assert ingest is not None and ingest.scopes == {Scope.INGEST, Scope.READ}
    assert ingest.name == "env:ingest"
    admin = table.authenticate(ADMIN)
    assert admin is not None and admin.scopes == {Scope.ADMIN, Scope.READ}
    assert table.authenticate("not-a-token-at-all") is None
    assert table.authenticate(INGEST + "x") is None


def test_one_token_given_for_several_scopes_holds_them_all() -> None:
    table = load_tokens(Settings(ingest_token=INGEST, agent_token=INGEST, admin_token=INGEST))
    principal = table.authenticate(INGEST)
    assert principal is not None and principal.scopes == set(Scope)
    assert len(table) == 1


def test_no_tokens_means_authentication_is_off() -> None:
    assert not load_tokens(Settings()).enabled


def test_a_short_token_is_refused() -> None:
    with pytest.raises(ConfigError, match="shorter than 16"):
        load_tokens(Settings(agent_token="short"))


def test_tokens_file_takes_tokens_and_digests(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(f'''
[[tokens]]
name = "router-a"
scopes = ["ingest"]
token = "{INGEST}"

[[tokens]]
name = "ops"
scopes = ["admin", "agent"]
sha256 = "{token_digest(ADMIN).upper()}"
''')
    table = load_tokens(Settings(tokens_file=path))
    router = table.authenticate(INGEST)
    assert (
        router is not None
        and router.name == "router-a"
        and router.scopes == {Scope.INGEST, Scope.READ}
    )
    ops = table.authenticate(ADMIN)
    assert ops is not None and ops.scopes == {Scope.ADMIN, Scope.AGENT, Scope.READ}
    assert table.names() == {"router-a": ["ingest", "read"], "ops": ["admin", "agent", "read"]}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("not toml [", "KVP_TOKENS_FILE"),
        ("x = 1", r"one or more \[\[tokens\]\]"),
        (
            '[[tokens]]\nscopes = ["ingest"]\ntoken = "' + INGEST + '"',
            r"tokens\[0\]: name is required",
        ),
        (
            '[[tokens]]\nname = "a"\ntoken = "' + INGEST + '"',
            r"tokens\[0\] \(a\): scopes is required",
        ),
        (
            '[[tokens]]\nname = "a"\nscopes = ["root"]\ntoken = "' + INGEST + '"',
            "scopes must be among",
        ),
        ('[[tokens]]\nname = "a"\nscopes = ["ingest"]', "exactly one of token and sha256"),
        ('[[tokens]]\nname = "a"\nscopes = ["ingest"]\nsha256 = "abc"', "64 hex digits"),
        (
            '[[tokens]]\nname = "a"\nscopes = ["ingest"]\npassword = "x"\ntoken = "' + INGEST + '"',
            "unknown key 'password'",
        ),
    ],
)
def test_a_bad_tokens_file_is_named(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=message):
        load_tokens(Settings(tokens_file=path))


def test_a_missing_tokens_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="KVP_TOKENS_FILE"):
        load_tokens(Settings(tokens_file=tmp_path / "nope.toml"))


def test_tokens_never_show_in_the_settings_repr_or_dump() -> None:
    settings = Settings(ingest_token=INGEST)
    assert INGEST not in repr(settings)
    assert INGEST not in str(settings.model_dump(mode="json"))


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_hosts(host: str) -> None:
    assert is_loopback(host)
    assert "authentication off" in check_bind(host, TokenTable())


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.5", "::", "example.com"])
def test_an_unauthenticated_service_may_not_bind_a_public_address(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(ConfigError, match=r"127\.0\.0\.1 only"):
        check_bind(host, TokenTable())
    table = TokenTable()
    table.add("a", [Scope.INGEST], token=INGEST)
    assert "authentication on" in check_bind(host, table)


def test_the_local_principal_holds_every_scope() -> None:
    assert LOCAL.allows([Scope.ADMIN]) and LOCAL.allows([Scope.AGENT])


def test_a_token_may_be_bound_to_instances_and_agents(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(f'''
[[tokens]]
name = "fleet-a"
scopes = ["agent"]
token = "{AGENT}"
instances = ["gpu-a-*", "gpu-x"]
agents = ["agent-a?"]
''')
    table = load_tokens(Settings(tokens_file=path, ingest_token=INGEST))
    fleet = table.authenticate(AGENT)
    assert fleet is not None and fleet.instances == ("gpu-a-*", "gpu-x")
    assert fleet.acts_for_instance("gpu-a-7") and fleet.acts_for_instance("gpu-x")
    assert not fleet.acts_for_instance("gpu-b-0") and not fleet.acts_for_instance(None)
    assert fleet.acts_as_agent("agent-a1") and not fleet.acts_as_agent("agent-b1")
    assert not fleet.acts_as_agent(None)
    router = table.authenticate(INGEST)  # unbound: acts for all, as before
    assert router is not None and router.acts_for_instance("gpu-b-0") and router.acts_as_agent(None)
    assert table.bindings() == {
        "fleet-a": {"instances": ["gpu-a-*", "gpu-x"], "agents": ["agent-a?"]}
    }


@pytest.mark.parametrize("value", ["[]", '"gpu-a-*"', '[""]', "[1]"])
def test_a_binding_is_a_non_empty_list_of_patterns(tmp_path: Path, value: str) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(
        f'[[tokens]]\nname = "a"\nscopes = ["agent"]\ntoken = "{AGENT}"\ninstances = {value}\n'
    )
    with pytest.raises(ConfigError, match=r"tokens\[0\] \(a\): instances must be a non-empty"):
        load_tokens(Settings(tokens_file=path))
