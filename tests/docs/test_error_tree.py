"""The exception tree drawn in app/core/errors.py's docstring is the tree of the classes.

The actual tree: every module under package_tree.PACKAGE_ROOTS is imported and every subclass of
the root, `KvpError` (kvprefetch_client.errors: the client's root is the service's, there is no
other), defined in one of them is found, private ones included. A module that is run rather than
imported (`__main__`, `sitecustomize`) or whose optional dependency is not installed here (the
client's framework integrations) is read with ast instead: its classes whose base names a class
of the tree.

The drawn tree is the docstring's one indented block, a class a line (or siblings on one line,
comma-separated), each line the module that defines them after two spaces or more:

    KvpError                 kvprefetch_client.errors: ...
    +-- EventLogError        app.core.errors: ...
    |   +-- CorruptLogError  app.core.errors: ...

A level is four columns (`+-- ` below the root, `|   ` or four spaces for each level above);
a class's parent is the nearest line above it one level up. Each class of the one tree is a
line of the other, with the same parent and module: a new error class without its line fails
naming it, and so does a line whose class moved or is gone.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

from kvprefetch_client.errors import KvpError
from tests.docs.package_tree import PACKAGE_ROOTS, REPO, dotted_name, modules

RUN_NOT_IMPORTED = {"__main__", "sitecustomize"}
OUR_PACKAGES = {dotted_name(Path(root) / "__init__.py") for root in PACKAGE_ROOTS}
TREE_LINE = re.compile(
    r"^    (?P<levels>(?:[| ]   )*)(?P<branch>\+-- )?"
    r"(?P<names>[A-Za-z_]\w*(?:, [A-Za-z_]\w*)*)  +(?P<module>[\w.]+)(?::.*)?$"
)

# A class: (its parent's name, its module).
Tree = dict[str, tuple[str | None, str]]


def _import_or_read(module: Path) -> tuple[str, ast.Module | None]:
    """The module imported (None), or its source parsed when it cannot be imported here."""
    name = dotted_name(module)
    if name.rsplit(".", 1)[-1] in RUN_NOT_IMPORTED:
        return name, ast.parse((REPO / module).read_text())
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] in OUR_PACKAGES:
            raise  # one of ours is missing: a real failure
        return name, ast.parse((REPO / module).read_text())
    return name, None


def _actual_tree() -> Tree:
    imported: set[str] = set()
    unread: dict[str, ast.Module] = {}
    for module in modules():
        name, source = _import_or_read(module)
        if source is None:
            imported.add(name)
        else:
            unread[name] = source
    tree: Tree = {KvpError.__name__: (None, KvpError.__module__)}
    pending = [KvpError]
    while pending:
        parent = pending.pop()
        for cls in parent.__subclasses__():
            if cls.__module__ in imported or cls.__module__ == KvpError.__module__:
                assert cls.__name__ not in tree, f"two error classes named {cls.__name__}"
                tree[cls.__name__] = (parent.__name__, cls.__module__)
                pending.append(cls)
    # The modules read, not imported: a class whose base is a class of the tree, to a fixpoint.
    grew = True
    while grew:
        grew = False
        for name, source in unread.items():
            for node in ast.walk(source):
                if not isinstance(node, ast.ClassDef) or node.name in tree:
                    continue
                for base in node.bases:
                    base_name = base.attr if isinstance(base, ast.Attribute) else None
                    base_name = base.id if isinstance(base, ast.Name) else base_name
                    if base_name in tree:
                        tree[node.name] = (base_name, name)
                        grew = True
                        break
    return tree


def _drawn_tree() -> Tree:
    import app.core.errors

    doc = app.core.errors.__doc__ or ""
    lines = doc.splitlines()
    block = [i for i, line in enumerate(lines) if line.startswith("    ")]
    assert block, "app/core/errors.py's docstring draws no tree (an indented block)"
    assert block == list(range(block[0], block[-1] + 1)), "the tree is one indented block"
    tree: Tree = {}
    parents: list[list[str]] = []  # the classes of the last line at each level, root first
    for line in lines[block[0] : block[-1] + 1]:
        drawn = TREE_LINE.match(line)
        assert drawn, f"a line of the tree that does not read: {line!r}"
        level = len(drawn["levels"]) // 4 + (1 if drawn["branch"] else 0)
        assert (level == 0) == (not drawn["branch"]), f"only the root has no '+-- ': {line!r}"
        assert level <= len(parents), f"a line below no parent: {line!r}"
        del parents[level:]
        if parents:
            assert len(parents[-1]) == 1, f"a line below a line of siblings: {line!r}"
        names = drawn["names"].split(", ")
        for name in names:
            assert name not in tree, f"{name} drawn twice"
            tree[name] = (parents[-1][0] if parents else None, drawn["module"])
        parents.append(names)
    return tree


def test_the_error_tree_in_the_docstring_is_the_classes() -> None:
    actual, drawn = _actual_tree(), _drawn_tree()
    assert {"KvpError", "StoreUnavailable", "MooncakeError", "HttpError"} <= set(actual)
    undrawn = sorted(set(actual) - set(drawn))
    assert not undrawn, f"error classes without a line in app/core/errors.py's tree: {undrawn}"
    gone = sorted(set(drawn) - set(actual))
    assert not gone, f"lines of app/core/errors.py's tree without a class: {gone}"
    wrong = {
        name: {"drawn (parent, module)": drawn[name], "actual": actual[name]}
        for name in actual
        if drawn[name] != actual[name]
    }
    assert not wrong, f"drawn under another parent or module: {wrong}"
