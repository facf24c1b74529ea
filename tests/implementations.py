"""Every implementation of a concept, found the way river's checks find every estimator.

An implementation declares what it implements (`class MySink(OrderSink)`, the protocol as its
base), and `implementations(OrderSink)` finds it: every module under app/ and
client/kvprefetch_client is imported, then the concept's subclasses are walked. A contract suite
parametrized by that list runs on a new implementation the day it is written; the suite's
`FACTORIES` (how to build one for a test) must name it, which `missing_factories` checks.

Only classes defined under app/ or kvprefetch_client count: test doubles never do, nor a
protocol that extends the concept (TablePredictor), nor an abstract class. `undeclared` finds the
classes that have every method of a concept without declaring it, which discovery would miss.

A module is left out only when it imports, at module level, a framework that one of the optional
extras installs (OPTIONAL_IMPORTS; the integrations for LangChain, the OpenAI Agents SDK and
LiteLLM subclass their framework's classes and are imported by nothing else). Any other import
error fails discovery.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import tomllib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "kvprefetch_client")
# Top-level import name -> the optional extra (client/pyproject.toml) that installs it.
OPTIONAL_IMPORTS = {
    "langchain_core": "langchain",
    "agents": "openai-agents",
    "litellm": "litellm",
}
PYPROJECTS = (ROOT / "pyproject.toml", ROOT / "client" / "pyproject.toml")


def declared_extras() -> set[str]:
    """The optional extras the two pyproject.toml files declare."""
    extras: set[str] = set()
    for path in PYPROJECTS:
        project = tomllib.loads(path.read_text())["project"]
        extras |= set(project.get("optional-dependencies", {}))
    return extras


def _modules() -> Iterator[str]:
    for name in PACKAGES:
        package = importlib.import_module(name)
        yield name
        for info in pkgutil.walk_packages(package.__path__, name + "."):
            if info.name.rsplit(".", 1)[-1] != "__main__":  # running it is what it does
                yield info.name


@functools.cache
def import_everything() -> tuple[dict[str, ModuleType], dict[str, str]]:
    """(every module imported, by name; the modules left out, each with the extra it needs)."""
    imported: dict[str, ModuleType] = {}
    skipped: dict[str, str] = {}
    for name in _modules():
        try:
            imported[name] = importlib.import_module(name)
        except ImportError as exc:
            missing = (exc.name or "").split(".")[0]
            if missing not in OPTIONAL_IMPORTS:
                raise
            skipped[name] = OPTIONAL_IMPORTS[missing]
    return imported, skipped


def _ours(cls: type) -> bool:
    return cls.__module__.split(".")[0] in PACKAGES


def _is_protocol(cls: type) -> bool:
    return bool(cls.__dict__.get("_is_protocol", False))


def implementations(concept: type) -> list[type]:
    """Every concrete class under app/ or kvprefetch_client that subclasses `concept`, at any
    depth, by module and name."""
    import_everything()
    found: dict[type, None] = {}
    stack = list(concept.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if _ours(cls) and not _is_protocol(cls) and not inspect.isabstract(cls):
            found[cls] = None
    return sorted(found, key=name_of)


def name_of(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def file_of(cls: type) -> str:
    return Path(inspect.getfile(cls)).resolve().relative_to(ROOT).as_posix()


def methods_of(concept: type) -> dict[str, list[str]]:
    """The methods a concept (a protocol, with the protocols it extends; or a base class's
    abstract methods: what a subclass must write) names, each with its parameters' names."""
    out: dict[str, list[str]] = {}
    if not _is_protocol(concept):
        return {
            name: list(inspect.signature(getattr(concept, name)).parameters)
            for name in sorted(getattr(concept, "__abstractmethods__", ()))
        }
    for base in reversed(concept.__mro__):
        if not _is_protocol(base) or base.__module__ == "typing":
            continue
        for name, value in vars(base).items():
            if inspect.isfunction(value) and not (name.startswith("__") and name.endswith("__")):
                out[name] = list(inspect.signature(value).parameters)
    return out


def _has_methods(cls: type, methods: Mapping[str, list[str]]) -> bool:
    for name, parameters in methods.items():
        method = inspect.getattr_static(cls, name, None)
        if not inspect.isfunction(method) or list(inspect.signature(method).parameters) != (
            parameters
        ):
            return False
    return True


def undeclared(concept: type, modules: Iterable[ModuleType] | None = None) -> list[str]:
    """Classes under app/ or kvprefetch_client (or in `modules`) with every method of `concept`
    (by name and parameters) that do not subclass it: `implementations` cannot see them."""
    if modules is None:
        modules = import_everything()[0].values()
    methods = methods_of(concept)
    out = []
    for module in modules:
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__ or _is_protocol(cls) or concept in cls.__mro__:
                continue
            if _has_methods(cls, methods):
                out.append(
                    f"{name_of(cls)} ({file_of(cls)}) has every method of {concept.__name__}: "
                    f"declare it, class {cls.__name__}({concept.__name__})"
                )
    return sorted(out)


F = TypeVar("F")


def missing_factories(concept: type, factories: Mapping[type, Any], where: str) -> list[str]:
    """What keeps a contract suite from covering `concept`: an implementation without a factory
    in `where`'s FACTORIES, or a factory for a class that is not one (any more)."""
    found = implementations(concept)
    out = [
        f"{name_of(cls)} ({file_of(cls)}) implements {concept.__name__} and has no factory: "
        f"add one to FACTORIES in {where}"
        for cls in found
        if cls not in factories
    ]
    out += [
        f"FACTORIES in {where} builds {name_of(cls)}, which is not an implementation of "
        f"{concept.__name__} found under app/ or client/"
        for cls in factories
        if cls not in found
    ]
    return out


def params(
    concept: type,
    marks: Mapping[type, Any] | None = None,
    keep: Callable[[type], bool] = lambda cls: True,
) -> list[Any]:
    """pytest.param of each implementation `keep` keeps, its id the class's name, with its
    marks."""
    marks = marks or {}
    return [
        pytest.param(cls, id=cls.__name__, marks=marks.get(cls, ()))
        for cls in implementations(concept)
        if keep(cls)
    ]


def factory_of(
    concept: type, factories: Mapping[type, F], cls: type, request: pytest.FixtureRequest
) -> F:
    """`cls`'s factory; a class without one fails, as its test_every_..._has_a_factory does."""
    factory = factories.get(cls)
    if factory is None:
        pytest.fail(
            f"{name_of(cls)} implements {concept.__name__} and has no factory: "
            f"add one to FACTORIES in {here(request.path)}",
            pytrace=False,
        )
    return factory


def here(path: str | Path) -> str:
    """A file's path from the checkout's root (a test module's `__file__`), for messages."""
    return Path(path).resolve().relative_to(ROOT).as_posix()
