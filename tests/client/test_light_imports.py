"""The light package imports only its three dependencies and the standard library (redis only
inside the agent's stream source, for the `redis` extra; mooncake only inside the agent's
Mooncake tier, for the `mooncake` extra), read from its source: the quick check
beside tests/client/test_light_install.py, which installs it for real."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "client" / "kvprefetch_client"
ALLOWED = {"kvprefetch_client", "pydantic", "httpx", "orjson"}
# Imported inside functions only, so that the package imports without the extra installed.
LAZY_ALLOWED = {"redis", "mooncake", "uhashring", "vllm_router"}
# A plug-in module is imported only by the framework that loads it (its extra installed), so it
# may import that framework at its top; nothing else imports it.
PLUGIN_ALLOWED = {"integrations/litellm.py": {"litellm"}}


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
        for name, module_level, line in _imports(ast.parse(path.read_text(), str(path))):
            if name in ALLOWED or name in sys.stdlib_module_names:
                continue
            if name in LAZY_ALLOWED and not module_level:
                continue
            if name in PLUGIN_ALLOWED.get(str(path.relative_to(PACKAGE)), ()):
                continue
            bad.append(f"{path.relative_to(PACKAGE)}:{line}: {name}")
    assert not bad, bad
