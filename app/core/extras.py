"""The optional extras and whether one is installed.

The base install is the service: `kvprefetch serve` and its model. The simulator's, training's
and the benches' commands, and scheduled retraining (a training child process), need an extra
(pyproject.toml's optional dependencies). An extra is told by the modules it brings, looked up
without importing them, so that neither `kvprefetch --help` nor the service loads them.
"""

from __future__ import annotations

import importlib.util

from app.core.errors import MissingExtraError

# Each extra -> the modules that tell it is installed (as imported: scikit-learn is sklearn).
# tests/test_cli.py checks them against pyproject.toml's lists.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "sim": ("matplotlib",),
    "training": ("pandas", "sklearn", "matplotlib"),
    "bench": ("pandas", "sklearn", "matplotlib"),
    "fast": ("lleaves", "llvmlite"),
}


def missing_module(extra: str) -> str | None:
    """The first of the extra's modules that is not installed, or None when all are."""
    for name in EXTRA_MODULES[extra]:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except ValueError:  # imported already, without a spec: it is there
            continue
    return None


def require_extra(extra: str, what: str) -> None:
    """MissingExtraError naming the extra and how to install it, unless it is installed; `what`
    says who needs it."""
    missing = missing_module(extra)
    if missing is not None:
        raise MissingExtraError(
            f"{what} needs the '{extra}' extra (no module {missing}): "
            f"pip install 'kvprefetch[{extra}]'"
        )
