"""docs/architecture/layout.md against the checkout, so the contributors' map cannot drift.

The rule: every package (a folder with __init__.py) and every module (a .py file) under
package_tree.PACKAGE_ROOTS is named on the page by its own path from the repository root, in
backticks: a package with a trailing slash (`app/decide/`), a module by its file
(`app/decide/guard.py`). A package's __init__.py is named by its package's entry; no other module
is covered by its folder's entry, so each has a line of its own. Every path the page names
exists: test_site.py's path check reads this page like any other (its table of moves writes the
old paths as `was: app/engine/x.py`, which that check skips and checks are gone).

The Engine: every public attribute (no leading underscore) that Engine.__init__ (or a `_build_*`
method it calls) assigns
(`self.<name> = ...`, annotated or not) has a row `| `<name>` | ... |` in the table under the
page's "The Engine's attributes" heading, and every row there names such an attribute.
"""

from __future__ import annotations

import ast
import re

from tests.docs.package_tree import PACKAGE_ROOTS, REPO, modules, packages

PAGE = REPO / "docs" / "architecture" / "layout.md"
ATTRIBUTES_HEADING = "### The Engine's attributes"


def _named_on_page() -> set[str]:
    return set(re.findall(r"`([^`\s]+)`", PAGE.read_text()))


def test_the_roots_are_packages() -> None:
    for root in PACKAGE_ROOTS:
        assert (REPO / root / "__init__.py").is_file(), root


def test_every_package_and_module_is_on_the_layout_page() -> None:
    named = _named_on_page()
    wanted = [f"{p.as_posix()}/" for p in packages()]
    wanted += [m.as_posix() for m in modules() if m.name != "__init__.py"]
    assert len(wanted) > 150  # the walk found the tree
    missing = [path for path in wanted if path not in named]
    assert not missing, f"not named on {PAGE.relative_to(REPO)} (as `path`): {missing}"


def _engine_attributes() -> set[str]:
    tree = ast.parse((REPO / "app" / "engine.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    # __init__ and the builders it calls (`_build_io`, ...), which set the parts.
    builders = [
        n
        for n in engine.body
        if isinstance(n, ast.FunctionDef) and (n.name == "__init__" or n.name.startswith("_build_"))
    ]
    init = ast.Module(body=list(builders), type_ignores=[])
    found: set[str] = set()
    for node in ast.walk(init):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for leaf in ast.walk(target):  # `a, self.b = ...` too
                if (
                    isinstance(leaf, ast.Attribute)
                    and isinstance(leaf.value, ast.Name)
                    and leaf.value.id == "self"
                ):
                    found.add(leaf.attr)
    return {name for name in found if not name.startswith("_")}


def _attribute_rows() -> list[str]:
    lines = PAGE.read_text().splitlines()
    assert ATTRIBUTES_HEADING in lines, f"no '{ATTRIBUTES_HEADING}' heading on the page"
    rows: list[str] = []
    for line in lines[lines.index(ATTRIBUTES_HEADING) + 1 :]:
        if line.startswith("#"):
            break
        row = re.match(r"\| `(\w+)` \|", line)
        if row:
            rows.append(row.group(1))
    return rows


def test_every_engine_attribute_has_a_row() -> None:
    attributes = _engine_attributes()
    assert {"store", "scheduler", "guard", "lease", "feed"} <= attributes  # the walk found them
    rows = _attribute_rows()
    assert len(rows) == len(set(rows)), "an attribute with two rows"
    missing = sorted(attributes - set(rows))
    assert not missing, f"Engine attributes without a row on the layout page: {missing}"
    stale = sorted(set(rows) - attributes)
    assert not stale, f"rows for attributes Engine.__init__ does not set: {stale}"
