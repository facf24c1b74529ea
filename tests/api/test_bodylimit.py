"""The body limit holds for routes whose body FastAPI parses, not only for POST /v1/events."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.api.conftest import routed

LIMIT = 64 * 1024  # tests/api/conftest.py's max_body_bytes


def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(client: TestClient) -> None:
    r = client.post(
        "/v1/route-hint", content=b"x" * (LIMIT + 1), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    assert r.json() == {
        "detail": f"the body is {LIMIT + 1} bytes; the limit is {LIMIT}",
        "field": "body",
    }


def test_a_streamed_body_over_the_limit_is_cut_off(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"session_id": "s1", "candidates": ["'
        for _ in range(LIMIT // 1000 + 1):
            yield b"a" * 1000
        yield b'"]}'

    r = client.post(
        "/v1/model/reload", content=chunks(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    assert r.json() == {"detail": f"the body is over the limit of {LIMIT} bytes", "field": "body"}
    # The service serves on.
    assert (
        client.post(
            "/v1/route-hint", json={"session_id": "s1", "candidates": ["gpu-0"]}
        ).status_code
        == 200
    )


def test_a_body_within_the_limit_passes(client: TestClient) -> None:
    r = client.post(
        "/v1/route-hint",
        json={"session_id": "s1", "candidates": [f"gpu-{i}-{'x' * 16}" for i in range(64)]},
    )
    assert r.status_code == 200


@pytest.mark.parametrize("path", ["/v1/events", "/v1/route-hint", "/v1/model/reload"])
@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br, gzip"])
def test_a_compressed_body_is_415_naming_the_content_encoding(
    client: TestClient, path: str, encoding: str
) -> None:
    body = gzip.compress(json.dumps({"events": [routed("gz")]}).encode())
    r = client.post(
        path,
        content=body,
        headers={"content-type": "application/json", "content-encoding": encoding},
    )
    assert r.status_code == 415
    assert r.json() == {
        "detail": "send the body uncompressed: no Content-Encoding (or identity)",
        "field": "content-encoding",
    }
    assert client.get("/v1/sessions/s1").status_code == 404  # nothing of it went in


def test_an_identity_content_encoding_is_a_plain_body(client: TestClient) -> None:
    r = client.post(
        "/v1/events", json={"events": [routed("plain")]}, headers={"content-encoding": "Identity"}
    )
    assert r.status_code == 200
