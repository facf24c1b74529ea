"""docs/architecture/glossary.md names each word's home: every path there exists, and every class
it names in backticks beside a path is defined in one of that row's files."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "architecture" / "glossary.md"
PATH = re.compile(r"`((?:app|client|sim|training|bench)/[A-Za-z0-9_./-]*)`")
CLASS = re.compile(r"`([A-Z][A-Za-z]+)`")


def rows() -> list[str]:
    return [line for line in PAGE.read_text().splitlines() if line.startswith("| **")]


def test_the_glossary_has_its_words() -> None:
    words = " ".join(row.split("|")[1] for row in rows())
    for word in ("Engine", "planner", "planning replica", "slots", "registry", "replay backend"):
        assert f"**{word}**" in words or word in words, word


def test_every_path_exists_and_every_class_is_defined_there() -> None:
    for row in rows():
        paths = PATH.findall(row)
        assert paths, row
        files: list[Path] = []
        for p in paths:
            path = REPO / p
            assert path.exists(), p
            files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
        source = "\n".join(f.read_text() for f in files)
        for name in CLASS.findall(row):
            if f"class {name}" in source:
                continue
            # A name used in the row's prose (a metric, a setting) is not a class: only names
            # whose row says "(`Name`" claim to be defined there.
            assert f"(`{name}`" not in row, f"{name} is not defined in {paths}"
