from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.config import Settings


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(
        data_dir=tmp_path, max_batch_events=50, max_body_bytes=64 * 1024, log_fsync=False
    )


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


def settle(client: TestClient) -> None:
    """Let the planning side take every acknowledged event (app/ingest/backlog.py), on the
    service's loop, before a test drives or reads its parts directly."""
    client.portal.call(_drain, client.app)  # type: ignore[union-attr]


async def _drain(app: Any) -> None:
    app.state.engine.backlog.drain()


def routed(
    event_id: str, session_id: str = "s1", ts: float = 1.0, **kw: object
) -> dict[str, object]:
    body: dict[str, object] = {
        "type": "request_routed",
        "event_id": event_id,
        "ts": ts,
        "session_id": session_id,
        "request_id": f"r-{event_id}",
        "instance_id": "gpu-0",
        "prompt_tokens": 1000,
    }
    body.update(kw)
    return body
