"""The package layout holds: no import cycle, and no layer imports what sits above it.

The import graph is read statically with `ast`, every import counted, those inside functions too
(a lazy import hides a cycle from Python, not from the design); only `if TYPE_CHECKING:` blocks
are left out, since they never run. An edge goes to the module named: `from a.b import c` is an
edge to the module a.b.c when there is one, else to a.b.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Import package -> the folder that holds it.
PACKAGES = {
    "app": ROOT,
    "sim": ROOT,
    "bench": ROOT,
    "training": ROOT,
    "kvprefetch_cli": ROOT,
    "kvprefetch_client": ROOT / "client",
}

ENGINE_LAYERS = (
    "app.state",
    "app.predict",
    "app.ingest",
    "app.decide",
    "app.deliver",
    "app.observe",
    "app.core",
)
# (importers, what they may not import, why). A name covers the module and everything under it.
RULES: tuple[tuple[tuple[str, ...], tuple[str, ...], str], ...] = (
    (
        ("kvprefetch_client",),
        ("app", "sim", "bench", "training", "kvprefetch_cli"),
        "the light client installs without the server",
    ),
    (
        ("app", "sim", "bench", "training"),
        ("kvprefetch_cli",),
        "the command line's root composes the packages' commands: nothing imports it",
    ),
    (
        ENGINE_LAYERS,
        ("app.api", "app.commands"),
        "the engine's layers know nothing of their HTTP and command-line drivers",
    ),
    (("app.core",), ENGINE_LAYERS[:-1], "app.core is beneath every layer"),
    (
        ("app",),
        ("sim", "bench", "training"),
        "the service needs neither the simulator, nor the benches, nor the training code",
    ),
)


def _under(module: str, names: tuple[str, ...]) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_modules(
    tree: ast.AST, module: str, is_package: bool, known: set[str]
) -> Iterator[str]:
    """The project modules the import statements in `tree` name, TYPE_CHECKING blocks left out.

    `import a.b.c` names a.b.c; `from a.b import c, d` names a.b.c if it is a module, and a.b for
    d if d is not.
    """
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                anchor = parts if is_package else parts[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                name = f"{base}.{alias.name}"
                if name in known:
                    yield name
                elif base in known:
                    yield base
        stack.extend(ast.iter_child_nodes(node))


def module_files() -> dict[str, Path]:
    files = {}
    for package, folder in PACKAGES.items():
        for path in sorted((folder / package).rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    graph: dict[str, set[str]] = {}
    known = set(files)
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[module] = set(_imported_modules(tree, module, path.name == "__init__.py", known))
        graph[module].discard(module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """Each strongly connected component of more than one module, with one cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's; recursion as deep as the longest import chain
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [(c, _cycle_in(graph, set(c), c[0])) for c in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """A path start -> ... -> start inside one strongly connected component (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        step = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if w not in previous:
                    previous[w] = v
                    step.append(w)
        frontier = step
    raise AssertionError(f"{start} is in no cycle")


def broken_rules(graph: dict[str, set[str]]) -> list[str]:
    broken = []
    for importer, targets in sorted(graph.items()):
        for who, forbidden, why in RULES:
            if not _under(importer, who):
                continue
            for target in sorted(targets):
                if _under(target, forbidden) and not _under(target, who):
                    broken.append(f"{importer} imports {target}: {why}")
    return broken


def test_no_import_cycle() -> None:
    found = cycles(import_graph(module_files()))
    assert not found, "import cycles:\n" + "\n".join(
        f"{' -> '.join(cycle)} (all of {', '.join(component)})" for component, cycle in found
    )


def test_layers_import_only_what_sits_below_them() -> None:
    broken = broken_rules(import_graph(module_files()))
    assert not broken, "\n".join(broken)


def test_the_graph_sees_lazy_imports_and_skips_type_checking(tmp_path: Path) -> None:
    # A cycle closed by an import inside a function is found; one through TYPE_CHECKING is not.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg.a import f\n"
        "from . import b\n"
    )
    files = {"pkg": pkg / "__init__.py", **{f"pkg.{m}": pkg / f"{m}.py" for m in "abc"}}
    graph = import_graph(files)
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.b"}}
    assert cycles(graph) == [(["pkg.a", "pkg.b"], ["pkg.a", "pkg.b", "pkg.a"])]


def test_a_layer_rule_is_enforced() -> None:
    assert broken_rules(
        {
            "kvprefetch_client.client._sync": {"app.core.errors"},
            "app.state.memory": {"app.api.deps"},
            # app's commands run on the base install: no exemption for a driver.
            "app.commands": {"training.compact", "app.api.main"},
            "sim.cli": {"app.commands", "sim.commands"},
            "training.cli": {"kvprefetch_cli"},
            "kvprefetch_cli": {"app.commands", "bench.cli", "sim.cli", "training.cli"},
        }
    ) == [
        (
            "app.commands imports training.compact: "
            "the service needs neither the simulator, nor the benches, nor the training code"
        ),
        (
            "app.state.memory imports app.api.deps: "
            "the engine's layers know nothing of their HTTP and command-line drivers"
        ),
        (
            "kvprefetch_client.client._sync imports app.core.errors: "
            "the light client installs without the server"
        ),
        (
            "training.cli imports kvprefetch_cli: "
            "the command line's root composes the packages' commands: nothing imports it"
        ),
    ]
