"""tests/implementations.py, the discovery the contract suites are parametrized by: it finds a
newcomer that declares a concept and tells which suite lacks its factory; it leaves out test
doubles and the protocols that extend a concept; no class implements a concept without declaring
it; and only modules of an optional extra are left out of the import."""

from __future__ import annotations

import gc
import sys
import textwrap
import types
from collections.abc import Iterator
from typing import Any

import pytest

from app.deliver import InProcessSink, OrderSink
from app.predict.predictors import LearnedPredictor, Predictor, TablePredictor
from app.state import StateStore
from kvprefetch_client.agent.consumer import OrderSource
from kvprefetch_client.agent.tier import Tier
from tests.implementations import (
    OPTIONAL_IMPORTS,
    ROOT,
    declared_extras,
    implementations,
    import_everything,
    missing_factories,
    undeclared,
)

CONCEPTS = (StateStore, OrderSink, Tier, OrderSource, Predictor, TablePredictor)
PROBE = "app.deliver._discovery_probe"


@pytest.fixture
def probe() -> Iterator[types.ModuleType]:
    """A module under app/ for the length of a test (its classes are gone after it)."""
    module = types.ModuleType(PROBE)
    module.__file__ = str(ROOT / "app" / "deliver" / "_discovery_probe.py")
    sys.modules[PROBE] = module
    yield module
    del sys.modules[PROBE]
    module.__dict__.clear()
    del module
    gc.collect()  # a class is in its bases' __subclasses__() until it is collected
    assert not [c for c in implementations(OrderSink) if c.__module__ == PROBE]


def define(module: types.ModuleType, source: str) -> dict[str, Any]:
    exec(textwrap.dedent(source), module.__dict__)
    return module.__dict__


class DoubleSink(OrderSink):
    """A test double: declares the concept, but lives under tests/."""

    async def submit(self, orders: Any) -> list[str]:
        return []

    async def cancel(self, cancels: Any) -> list[str]:
        return []

    async def close(self) -> None:
        pass


NEW_SINK = """
    from app.deliver import OrderSink

    class NewSink(OrderSink):
        async def submit(self, orders):
            return []

        async def cancel(self, cancels):
            return []

        async def close(self):
            pass
"""


def test_a_new_implementation_is_found_and_told_where_its_factory_goes(
    probe: types.ModuleType,
) -> None:
    new = define(probe, NEW_SINK)["NewSink"]
    assert new in implementations(OrderSink)
    factories = {cls: None for cls in implementations(OrderSink) if cls is not new}
    assert missing_factories(OrderSink, factories, "tests/deliver/test_sink_contract.py") == [
        f"{PROBE}.NewSink (app/deliver/_discovery_probe.py) implements OrderSink and has no "
        "factory: add one to FACTORIES in tests/deliver/test_sink_contract.py"
    ]


def test_a_factory_for_a_class_that_is_no_implementation_is_named() -> None:
    factories: dict[type, Any] = dict.fromkeys(implementations(OrderSink))
    factories[DoubleSink] = None
    assert missing_factories(OrderSink, factories, "x.py") == [
        f"FACTORIES in x.py builds {__name__}.DoubleSink, which is not an implementation of "
        "OrderSink found under app/ or client/"
    ]


def test_test_doubles_and_protocols_that_extend_a_concept_are_not_implementations() -> None:
    sinks = implementations(OrderSink)
    assert InProcessSink in sinks and DoubleSink not in sinks
    predictors = implementations(Predictor)
    assert TablePredictor not in predictors
    assert LearnedPredictor in predictors and LearnedPredictor in implementations(TablePredictor)


def test_a_class_with_a_concepts_methods_but_not_its_name_is_caught(
    probe: types.ModuleType,
) -> None:
    define(
        probe,
        """
        class QuietSink:
            async def submit(self, orders):
                return []

            async def cancel(self, cancels):
                return []

            async def close(self):
                pass

        class Unrelated:  # a p_within of another meaning: other parameters
            def p_within(self, seconds, running_seconds):
                return None
        """,
    )
    assert undeclared(OrderSink, [probe]) == [
        f"{PROBE}.QuietSink (app/deliver/_discovery_probe.py) has every method of OrderSink: "
        "declare it, class QuietSink(OrderSink)"
    ]
    assert undeclared(Predictor, [probe]) == []


@pytest.mark.parametrize("concept", CONCEPTS, ids=[c.__name__ for c in CONCEPTS])
def test_every_implementation_declares_its_concept(concept: type) -> None:
    assert implementations(concept)
    found = undeclared(concept)
    assert not found, "\n".join(found)


def test_only_modules_of_an_optional_extra_are_left_out() -> None:
    extras = declared_extras()
    assert set(OPTIONAL_IMPORTS.values()) <= extras, set(OPTIONAL_IMPORTS.values()) - extras
    imported, skipped = import_everything()
    assert "app.engine" in imported and "kvprefetch_client.agent.mooncake" in imported
    assert set(skipped.values()) <= extras
    assert all(name.startswith("kvprefetch_client.integrations.") for name in skipped), skipped
