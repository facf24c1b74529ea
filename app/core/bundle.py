"""Where the bundled model (models/) and the shipped scenarios (data/) are.

In a checkout, or an editable install, they are the repository's top-level folders. A wheel
carries copies inside the package, at app/_bundled/ (setup.py's build step puts them there), so
an installed service finds them with no checkout anywhere.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

# The folder a wheel's build step copies models/ and data/ into (setup.py).
BUNDLED_PACKAGE_DIR = "_bundled"


def bundled_path(relative: str) -> Path:
    """`relative` (e.g. "models/default") in the wheel's copy when installed from one, otherwise
    in the checkout holding this package."""
    # A Path for a package installed on disk; a wheel is always unpacked, never imported zipped.
    package = Path(str(files("app")))
    packaged = package / BUNDLED_PACKAGE_DIR / relative
    return packaged if packaged.exists() else package.parent / relative


# The bundled model (`make model` rebuilds it): what the service serves and `replay --policy
# learned` uses unless told otherwise.
DEFAULT_MODEL_DIR = bundled_path("models/default")
# The shipped cluster scenarios, each a TOML file named for the scenario.
SCENARIO_DIR = bundled_path("data/scenarios")


def model_identity(model_dir: Path | str) -> dict[str, str | None]:
    """What names a model in a result (replay, evaluate, targets JSON; lineage): its directory
    and the SHA-256 of its card.json (None where it has no card) and of its model.txt (None
    where it has none): two results of the same model name the same hashes wherever it lies."""
    import hashlib

    root = Path(model_dir)

    def digest(name: str) -> str | None:
        path = root / name
        return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None

    return {
        "dir": str(root),
        "card_sha256": digest("card.json"),
        "model_sha256": digest("model.txt"),
    }
