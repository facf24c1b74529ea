"""Bearer tokens and their scopes: who may call what.

A token grants one or more scopes:
  ingest  routers and engines: post events, ask for route hints
  agent   transfer agents: pull orders, post order progress and block residency
  admin   operators: reload or shadow the model, read the configuration
  read    the state, scheduler and model views; every token has it

A token from KVP_TOKENS_FILE may also be bound (`instances`, `agents`: fnmatch patterns): it then
acts only for those instances and agent names (app/api/bindings.py says where that is checked).
Unbound, it acts for all, as the env tokens do.

Tokens come from KVP_INGEST_TOKEN / KVP_AGENT_TOKEN / KVP_ADMIN_TOKEN and from KVP_TOKENS_FILE
(TOML, see docs/operators/security.md). Only SHA-256 digests are kept once loaded, so a token never
reaches a log, a repr or a dump of the settings. With no token at all, authentication is off and
the service must listen on loopback only (`check_bind`).
"""

from __future__ import annotations

import hashlib
import ipaddress
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING

from app.core.errors import ConfigError

if TYPE_CHECKING:
    from app.core.config import Settings

# Short tokens can be guessed; `kvprefetch token` makes 32 random bytes.
MIN_TOKEN_CHARS = 16


class Scope(StrEnum):
    INGEST = "ingest"
    AGENT = "agent"
    ADMIN = "admin"
    READ = "read"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request authenticated as: the token's name (never the token), its scopes, and the
    instance ids and agent names it acts for (fnmatch patterns; None: any)."""

    name: str
    scopes: frozenset[Scope]
    instances: tuple[str, ...] | None = None
    agents: tuple[str, ...] | None = None

    def allows(self, scopes: Iterable[Scope]) -> bool:
        return any(s in self.scopes for s in scopes)

    def acts_for_instance(self, instance_id: str | None) -> bool:
        """Whether this token may speak for `instance_id` (None: a shared tier, no instance's:
        only an unbound token may)."""
        if self.instances is None:
            return True
        return instance_id is not None and any(fnmatchcase(instance_id, p) for p in self.instances)

    def acts_as_agent(self, agent: str | None) -> bool:
        if self.agents is None:
            return True
        return agent is not None and any(fnmatchcase(agent, p) for p in self.agents)


def _union(a: tuple[str, ...] | None, b: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """Bindings of one token given in several places: what any of them grants (unbound: all)."""
    if a is None or b is None:
        return None
    return tuple(dict.fromkeys(a + b))


# Authentication off (no tokens configured): the caller is on loopback and may do anything.
LOCAL = Principal("local", frozenset(Scope))


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(slots=True)
class TokenTable:
    """Token digest -> principal. Looking up a digest, not the token, keeps the comparison's
    timing independent of how much of a guessed token is right."""

    _by_digest: dict[str, Principal] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    def __len__(self) -> int:
        return len(self._by_digest)

    def add(
        self,
        name: str,
        scopes: Iterable[Scope],
        *,
        token: str | None = None,
        sha256: str | None = None,
        instances: Iterable[str] | None = None,
        agents: Iterable[str] | None = None,
    ) -> None:
        if (token is None) == (sha256 is None):
            raise ConfigError(f"token {name!r}: give exactly one of token and sha256")
        if token is not None and len(token) < MIN_TOKEN_CHARS:
            raise ConfigError(f"token {name!r} is shorter than {MIN_TOKEN_CHARS} characters")
        digest = token_digest(token) if token is not None else (sha256 or "").lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ConfigError(f"token {name!r}: sha256 must be 64 hex digits")
        granted = frozenset(scopes) | {Scope.READ}
        bound_instances = tuple(instances) if instances is not None else None
        bound_agents = tuple(agents) if agents is not None else None
        held = self._by_digest.get(digest)
        if held is not None:  # one token named in several places holds every scope given to it
            granted |= held.scopes
            name = held.name
            bound_instances = _union(held.instances, bound_instances)
            bound_agents = _union(held.agents, bound_agents)
        self._by_digest[digest] = Principal(name, granted, bound_instances, bound_agents)

    def authenticate(self, token: str) -> Principal | None:
        return self._by_digest.get(token_digest(token))

    def names(self) -> dict[str, list[str]]:
        """Each token's name and scopes, for the configuration view (no digests)."""
        return {p.name: sorted(p.scopes) for p in self._by_digest.values()}

    def bindings(self) -> dict[str, dict[str, list[str]]]:
        """Each bound token's instance and agent patterns, for the configuration view."""
        out: dict[str, dict[str, list[str]]] = {}
        for p in self._by_digest.values():
            bound = {
                key: list(patterns)
                for key, patterns in (("instances", p.instances), ("agents", p.agents))
                if patterns is not None
            }
            if bound:
                out[p.name] = bound
        return out


def load_tokens(settings: Settings) -> TokenTable:
    table = TokenTable()
    for scope, secret in (
        (Scope.INGEST, settings.ingest_token),
        (Scope.AGENT, settings.agent_token),
        (Scope.ADMIN, settings.admin_token),
    ):
        if secret is not None:
            table.add(f"env:{scope}", [scope], token=secret.get_secret_value())
    if settings.tokens_file is not None:
        _load_file(table, settings.tokens_file)
    return table


def _load_file(table: TokenTable, path: Path) -> None:
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"KVP_TOKENS_FILE {path}: {exc}") from None
    entries = doc.get("tokens")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"KVP_TOKENS_FILE {path}: expected one or more [[tokens]] tables")
    for i, entry in enumerate(entries):
        where = f"KVP_TOKENS_FILE {path}: tokens[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: expected a table")
        unknown = sorted(set(entry) - {"name", "scopes", "token", "sha256", "instances", "agents"})
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r}")
        name, scopes = entry.get("name"), entry.get("scopes")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: name is required")
        if not isinstance(scopes, list) or not scopes:
            raise ConfigError(
                f"{where} ({name}): scopes is required, a list of ingest, agent, admin"
            )
        try:
            parsed = [Scope(s) for s in scopes]
        except ValueError:
            raise ConfigError(
                f"{where} ({name}): scopes must be among ingest, agent, admin, read"
            ) from None
        bound = {key: _patterns(entry, key, f"{where} ({name})") for key in ("instances", "agents")}
        try:
            table.add(
                name,
                parsed,
                token=entry.get("token"),
                sha256=entry.get("sha256"),
                instances=bound["instances"],
                agents=bound["agents"],
            )
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None


def _patterns(entry: dict[str, object], key: str, where: str) -> list[str] | None:
    """An entry's `instances` or `agents`: None when absent (unbound), else a non-empty list of
    fnmatch patterns."""
    if key not in entry:
        return None
    value = entry[key]
    if not isinstance(value, list) or not value or not all(isinstance(p, str) and p for p in value):
        raise ConfigError(
            f"{where}: {key} must be a non-empty list of names or fnmatch patterns "
            f'(e.g. ["gpu-a-*"]); leave it out to act for all'
        )
    return list(value)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, tokens: TokenTable) -> str:
    """Refuses an unauthenticated service on a non-loopback address; returns what to log."""
    if tokens.enabled:
        return f"authentication on: {len(tokens)} token(s)"
    if not is_loopback(host):
        raise ConfigError(
            "no tokens are configured, so the service may listen on 127.0.0.1 only, "
            f"not {host}: set KVP_INGEST_TOKEN / KVP_AGENT_TOKEN / KVP_ADMIN_TOKEN or "
            "KVP_TOKENS_FILE (docs/operators/security.md)"
        )
    return f"authentication off (no tokens configured): listening on {host} only"
