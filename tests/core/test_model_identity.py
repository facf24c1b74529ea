"""model_identity: what names a model in a result."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from app.core.bundle import DEFAULT_MODEL_DIR, model_identity


def test_a_model_is_named_by_its_directory_and_the_hashes_of_its_card_and_model(
    tmp_path: Path,
) -> None:
    bundled = model_identity(DEFAULT_MODEL_DIR)
    card = (DEFAULT_MODEL_DIR / "card.json").read_bytes()
    assert bundled["card_sha256"] == hashlib.sha256(card).hexdigest()
    copy = tmp_path / "copy"
    shutil.copytree(DEFAULT_MODEL_DIR, copy)
    moved = model_identity(copy)
    assert moved["dir"] == str(copy) != bundled["dir"]
    assert (moved["card_sha256"], moved["model_sha256"]) == (
        bundled["card_sha256"],
        bundled["model_sha256"],
    )
    (copy / "model.txt").write_text("changed")
    assert model_identity(copy)["model_sha256"] != bundled["model_sha256"]
    assert model_identity(tmp_path / "none") == {
        "dir": str(tmp_path / "none"),
        "card_sha256": None,
        "model_sha256": None,
    }
