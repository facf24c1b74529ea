"""A tiny event log (the first 300 requests of the synthetic trace), built once per session."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from sim.commands import events_from_trace
from tests.conftest import trace_slice
from training import build_dataset


@pytest.fixture(scope="session")
def tiny_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-log")
    log = folder / "synthetic300.events.jsonl"
    events_from_trace(trace_slice(folder, "synthetic", 300), log, "default", "sticky", "none", None)
    return log


@pytest.fixture(scope="session")
def tiny_rows(tiny_log: Path) -> pd.DataFrame:
    return build_dataset([tiny_log])
