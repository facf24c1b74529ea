"""KVP_ORDER_SINK names a sink by the name the sink declares: a new OrderSink subclass with a
`name` is built from settings with nothing else to edit but the setting's choices, which this
test holds to the sinks found."""

from __future__ import annotations

from typing import get_args

import pytest

from app.core.config import Settings
from app.core.errors import ConfigError
from app.deliver import InProcessSink, PullQueue, build_sink, sink_classes


def test_the_settings_choices_are_the_sinks_found() -> None:
    choices = set(get_args(Settings.model_fields["order_sink"].annotation))
    found = set(sink_classes())
    assert found == choices, (
        f"sinks with a name: {sorted(found)}; KVP_ORDER_SINK's choices in app/core/config.py: "
        f"{sorted(choices)}: add the new sink's name there"
    )


def test_build_sink_builds_the_named_class() -> None:
    assert type(build_sink(Settings(order_sink="pull"))) is PullQueue
    assert type(build_sink(Settings(order_sink="memory"))) is InProcessSink


def test_an_unknown_name_is_refused_naming_the_choices() -> None:
    settings = Settings().model_copy(update={"order_sink": "carrier-pigeon"})
    with pytest.raises(ConfigError, match=r"carrier-pigeon.*lmcache, memory, pull, redis, webhook"):
        build_sink(settings)


def test_only_fleet_wide_sinks_take_a_fence() -> None:
    wide = {name for name, cls in sink_classes().items() if cls.fleet_wide}
    assert wide == {"redis", "webhook", "lmcache"}
