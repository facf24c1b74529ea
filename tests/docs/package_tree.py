"""The checkout's Python package tree, as the docs tests read it: roots, packages, modules."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Every top-level Python package of the checkout, by its path from the repository root. A new one
# (kvprefetch_cli/, when the command line moves there) is added here, and then the layout page
# and the error tree must cover it too.
PACKAGE_ROOTS = (
    "app",
    "sim",
    "training",
    "bench",
    "kvprefetch_cli",
    "client/kvprefetch_client",
)


def packages() -> list[Path]:
    """Every package (a folder with __init__.py) under the roots, relative to the checkout."""
    return sorted(
        init.parent.relative_to(REPO)
        for root in PACKAGE_ROOTS
        for init in (REPO / root).rglob("__init__.py")
    )


def modules() -> list[Path]:
    """Every module (a .py file, __init__.py included) under the roots, relative to the checkout."""
    return sorted(
        path.relative_to(REPO)
        for root in PACKAGE_ROOTS
        for path in (REPO / root).rglob("*.py")
        if "__pycache__" not in path.parts
    )


def dotted_name(module: Path) -> str:
    """`app/decide/guard.py` -> `app.decide.guard`; a root's parent folder is on sys.path
    (client/ for kvprefetch_client), and a package's __init__.py is the package."""
    root = next(r for r in PACKAGE_ROOTS if module.is_relative_to(r))
    parts = module.relative_to(Path(root).parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
