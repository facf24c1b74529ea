"""The process's collector tuning: the pacer collects the young generations every so many events."""

from __future__ import annotations

import gc

import pytest

from app.core import runtime
from app.core.runtime import YoungCollector


def test_the_pacer_collects_the_young_generations_every_so_many_events(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    collected: list[int] = []
    monkeypatch.setattr(runtime.gc, "collect", lambda generation=2: collected.append(generation))
    pacer = YoungCollector(every_events=5)
    pacer.observe([1, 2, 3])
    assert collected == []
    pacer.observe([4, 5])  # the fifth event
    assert collected == [1] and pacer.collections == 1
    pacer.observe(list(range(4)))
    assert collected == [1]  # counted afresh from the last collection
    pacer.observe(list(range(12)))  # one collection for a batch, however big
    assert collected == [1, 1]
    with pytest.raises(ValueError):
        YoungCollector(every_events=0)


def test_a_collection_empties_both_young_generations() -> None:
    enabled = gc.isenabled()
    gc.disable()  # no automatic collection moves them meanwhile
    try:
        kept = [[i] for i in range(10_000)]  # tracked containers, alive
        gc.collect(0)  # some in the middle generation, the rest made after
        kept += [[i] for i in range(10_000)]
        pacer = YoungCollector(every_events=1)
        pacer.observe([None])
        young = {id(o) for g in (0, 1) for o in gc.get_objects(g)}
        assert not any(id(o) in young for o in kept)
        assert pacer.collections == 1
    finally:
        if enabled:
            gc.enable()


def test_only_a_tuned_process_paces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "_paced", False)
    assert runtime.young_collector() is None
    monkeypatch.setattr(runtime, "_paced", True)
    pacer = runtime.young_collector()
    assert pacer is not None and pacer.every_events == runtime.YOUNG_COLLECTION_EVENTS
