"""Process-level tuning: the pacer collects the young generations every so many events; the model
libraries load without their bridges."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from app.core import runtime
from app.core.runtime import YoungCollector
from tests.conftest import REPO


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


def test_the_model_libraries_load_without_their_bridges_which_stay_importable() -> None:
    # In a process of its own: this one has imported LightGBM (and its bridges) already.
    code = """
import sys
from app.core.runtime import MODEL_LIBRARY_BRIDGES, import_model_libraries_bare
import_model_libraries_bare()
import lightgbm
import lightgbm.compat
loaded = sorted(n for n in MODEL_LIBRARY_BRIDGES if n in sys.modules)
assert loaded == [], loaded
assert not lightgbm.compat.SKLEARN_INSTALLED and not lightgbm.compat.PANDAS_INSTALLED
booster = lightgbm.Booster(model_file="models/default/model.txt")
assert booster.num_trees() > 0
import pandas, sklearn  # still there for whoever asks afterwards
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
