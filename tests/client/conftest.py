"""Fixtures the client tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import live_server

HANG_GUARD = 30.0  # seconds; only reached when something hangs


@pytest.fixture
def service_url(tmp_path: Path) -> Iterator[str]:
    """The real app under uvicorn, in a thread, on a port bound before it starts (no race)."""
    # Imported here: the agent's tests under tests/client/agent never load the service.
    from app.api.main import create_app
    from app.core.config import Settings

    app = create_app(Settings(data_dir=tmp_path, store="memory"))
    with live_server(app, HANG_GUARD) as url:
        yield url
