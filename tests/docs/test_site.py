"""The docs site: it builds with --strict (a broken link or anchor fails), the README stays a
landing page, the reference pages cover every HTTP route and every `kvprefetch` command, and
every path a page names in backticks exists (no page excepted; a moved path is written
`was: old/path.py` and must be gone)."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README_MAX_BYTES = 10_000
BUILD_TIMEOUT_SECONDS = 120
# Inline code that names a file or folder of the checkout, e.g. `app/decide/scheduler.py`: every
# one, on every page, must exist.
REPO_PATH = re.compile(
    r"`((?:app|client|sim|bench|training|kvprefetch_cli|tests|deploy|data|models|docs|\.ci)/"
    r"[A-Za-z0-9_./-]*)`"
)
# A path that no longer exists, named on purpose (decisions.md's record of its day, the layout
# page's table of moves), is written `was: app/engine/ingest.py`, beside the path it is now:
# REPO_PATH skips it (the path does not follow the backtick), and it must be gone.
HISTORIC_PATH = re.compile(r"`was: ([A-Za-z0-9_./-]+)`")


def _mkdocs_build(config: Path, site_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner, not a build warning
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--config-file",
            str(config),
            "--site-dir",
            str(site_dir),
            *extra,
        ],
        cwd=config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_SECONDS,
        check=False,
    )  # the caller judges the exit status


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built from the checkout with `mkdocs build --strict`."""
    site_dir = tmp_path_factory.mktemp("site")
    built = _mkdocs_build(REPO / "mkdocs.yml", site_dir, "--strict")
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stderr}"
    return site_dir


def _markdown_pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_site_builds_strict(site: Path) -> None:
    for page in (
        "index.html",
        "decisions/index.html",
        "reference/http-api/index.html",
        "operators/security-promises/index.html",
    ):
        assert (site / page).is_file(), page
    # SECURITY.md is included, not copied: its text reaches the site.
    first_heading = (REPO / "SECURITY.md").read_text().splitlines()[0].lstrip("# ")
    assert first_heading in (site / "operators/security-promises/index.html").read_text()
    # The client's page is its docstrings rendered (mkdocstrings), not the `:::` directives.
    client_api = (site / "routers/client-api/index.html").read_text()
    assert ":::" not in client_api
    for name in ("kvprefetch_client.client.KvpClient", "kvprefetch_client.client.AsyncKvpClient"):
        assert f'id="{name}"' in client_api, name
    assert "request_routed" in client_api


def test_a_broken_link_or_anchor_fails_the_build(tmp_path: Path) -> None:
    """The site's own settings (no --strict here) refuse a missing page and a missing anchor. A
    two-page site inherits them, without the hook and the pages, to keep this quick."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text(
        "# Home\n\n[gone](no-such-page.md), [nowhere](other.md#no-such-anchor), "
        "[ok](other.md#there)\n"
    )
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## There\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(
        f"INHERIT: {REPO / 'mkdocs.yml'}\ndocs_dir: docs\nhooks: []\nnav: [index.md, other.md]\n"
    )
    built = _mkdocs_build(config, tmp_path / "site")
    warnings = [line for line in built.stderr.splitlines() if line.startswith("WARNING")]
    assert built.returncode != 0, built.stderr
    for target in ("'no-such-page.md'", "'other.md#no-such-anchor'"):
        assert any(target in line for line in warnings), (target, built.stderr)
    assert len(warnings) == 2, built.stderr  # not the link to an anchor that exists


def test_readme_is_a_landing_page() -> None:
    readme = REPO / "README.md"
    assert len(readme.read_bytes()) <= README_MAX_BYTES
    # Its relative links (into docs/ and SECURITY.md) lead to files that exist.
    targets = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme.read_text())
    assert any(t.startswith("docs/") for t in targets)
    missing = [t for t in targets if not (REPO / t).exists()]
    assert not missing, missing


def test_api_reference_has_every_route(site: Path) -> None:
    from app.api.main import create_app

    page = (site / "reference/http-api/index.html").read_text()
    spec = create_app().openapi()
    routes = [(method.upper(), path) for path, item in spec["paths"].items() for method in item]
    assert len(routes) >= 18
    missing = [
        f"{method} {path}"
        for method, path in routes
        if f"<code>{html.escape(f'{method} {path}')}</code>" not in page
    ]
    assert not missing, missing
    for name in spec["components"]["schemas"]:
        assert f'id="schema-{name.lower()}"' in page, name


def _cli_commands() -> list[str]:
    """Every leaf command of `kvprefetch`, as typed: `kvprefetch serve`, `kvprefetch bench load`."""
    import typer

    from kvprefetch_cli import cli

    found: list[str] = []

    def walk(command: Any, words: list[str]) -> None:
        subcommands = getattr(command, "commands", None)  # a group (typer vendors its own click)
        if subcommands:
            for name, sub in subcommands.items():
                walk(sub, [*words, name])
        else:
            found.append(" ".join(words))

    walk(typer.main.get_command(cli), ["kvprefetch"])
    return found


def test_every_cli_command_is_documented() -> None:
    commands = _cli_commands()
    assert "kvprefetch bench load" in commands and "kvprefetch serve" in commands
    text = "\n".join(p.read_text() for p in _markdown_pages())
    missing = [c for c in commands if not re.search("`" + re.escape(c) + r"[ `]", text)]
    assert not missing, f"not in docs/ as `command ...`: {missing}"


def test_paths_named_in_the_docs_exist() -> None:
    sources = [*_markdown_pages(), REPO / "README.md", REPO / "SECURITY.md"]
    named = {(src, path) for src in sources for path in REPO_PATH.findall(src.read_text())}
    assert len(named) > 20
    missing = sorted({path for _, path in named if not (REPO / path).exists()})
    if missing:  # git-ignored files (deploy/tokens.toml) are made by the user, not shipped
        ignored = subprocess.run(
            ["git", "check-ignore", "--stdin"],
            cwd=REPO,
            check=False,
            input="\n".join(missing),
            capture_output=True,
            text=True,
        ).stdout.split()
        missing = [path for path in missing if path not in ignored]
    where = {
        path: sorted(str(src.relative_to(REPO)) for src, named_path in named if named_path == path)
        for path in missing
    }
    assert not missing, f"named in the docs but not in the checkout: {where}"


def test_historic_paths_are_gone() -> None:
    """A path written `was: ...` is one that moved: still in the checkout, it is a current path
    written as an old one."""
    sources = [*_markdown_pages(), REPO / "README.md", REPO / "SECURITY.md"]
    named = {(src, path) for src in sources for path in HISTORIC_PATH.findall(src.read_text())}
    assert len(named) > 10  # the moves table and decisions.md use the convention
    present = sorted(
        f"{src.relative_to(REPO)}: {path}" for src, path in named if (REPO / path).exists()
    )
    assert not present, f"written `was: ...` but still in the checkout: {present}"


def test_every_setting_has_a_row_in_the_configuration_page() -> None:
    from app.core.config import Settings

    page = (DOCS / "operators" / "configuration.md").read_text()
    # A table row names the variable in backticks, alone or beside its siblings.
    rows = "\n".join(line for line in page.splitlines() if line.startswith("| `"))
    names = [f"KVP_{field.upper()}" for field in Settings.model_fields]
    assert len(names) > 40
    missing = [name for name in names if not re.search(r"`" + re.escape(name) + r"`", rows)]
    assert not missing, f"settings without a row in docs/operators/configuration.md: {missing}"
