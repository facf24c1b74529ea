"""The body limit holds for routes whose body FastAPI parses, not only for POST /v1/events."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi.testclient import TestClient

LIMIT = 64 * 1024  # tests/api/conftest.py's max_body_bytes


def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(client: TestClient) -> None:
    r = client.post("/v1/route-hint", content=b"x" * (LIMIT + 1), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json() == {"detail": f"the body is {LIMIT + 1} bytes; the limit is {LIMIT}", "field": "body"}


def test_a_streamed_body_over_the_limit_is_cut_off(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"session_id": "s1", "candidates": ["'
        for _ in range(LIMIT // 1000 + 1):
            yield b"a" * 1000
        yield b'"]}'

    r = client.post("/v1/model/reload", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json() == {"detail": f"the body is over the limit of {LIMIT} bytes", "field": "body"}
    # The service serves on.
    assert client.post("/v1/route-hint", json={"session_id": "s1", "candidates": ["gpu-0"]}).status_code == 200


def test_a_body_within_the_limit_passes(client: TestClient) -> None:
    r = client.post("/v1/route-hint", json={"session_id": "s1",
                                            "candidates": [f"gpu-{i}-{'x' * 16}" for i in range(64)]})
    assert r.status_code == 200
