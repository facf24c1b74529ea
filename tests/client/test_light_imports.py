"""The light package imports only its three dependencies and the standard library (redis only
inside the agent's stream source, for the `redis` extra; mooncake only inside the agent's
Mooncake tier, for the `mooncake` extra; an integration's framework only in that integration's
module, which nothing else imports), read from its source: the quick check
beside tests/client/test_light_install.py, which installs it for real."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "client" / "kvprefetch_client"
ALLOWED = {"kvprefetch_client", "pydantic", "httpx", "orjson"}
# Imported inside functions only, so that the package imports without the extra installed.
LAZY_ALLOWED = {"redis", "mooncake", "uhashring", "vllm_router"}
# An integration's module subclasses its framework's classes, so imports it at module level; the
# framework is that integration's extra, and nothing else in the package imports the module.
INTEGRATION_ALLOWED = {
    "integrations/langchain.py": {"langchain_core"},
    "integrations/openai_agents.py": {"agents"},
    "integrations/litellm.py": {"litellm"},
}


def _imports(tree: ast.Module) -> list[tuple[str, bool, int]]:
    """(top-level module name, imported at module level, line) for each import in `tree`."""
    found = []
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            found.append((name.split(".")[0], id(node) in top, node.lineno))
    return found


def test_the_light_package_imports_nothing_of_the_service() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert files
    bad = []
    for path in files:
        allowed = ALLOWED | INTEGRATION_ALLOWED.get(path.relative_to(PACKAGE).as_posix(), set())
        for name, module_level, line in _imports(ast.parse(path.read_text(), str(path))):
            if name in allowed or name in sys.stdlib_module_names:
                continue
            if name in LAZY_ALLOWED and not module_level:
                continue
            bad.append(f"{path.relative_to(PACKAGE)}:{line}: {name}")
    assert not bad, bad


def test_nothing_in_the_package_imports_an_integration() -> None:
    """Importing the client, or `kvprefetch_client.integrations`, never loads a framework."""
    integrations = {"kvprefetch_client.integrations." + Path(p).stem for p in INTEGRATION_ALLOWED}
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            if any(n in integrations for n in names):
                bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not bad, bad
