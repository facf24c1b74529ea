"""mask_url: what a URL may show of itself."""

from __future__ import annotations

import pytest

from app.core.redact import mask_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:secret@cache:6379/1", "redis://:****@cache:6379/1"),
        ("redis://user:secret@cache/0", "redis://user:****@cache/0"),
        ("rediss://user@cache:6380/0?password=secret", "rediss://user@cache:6380/0?****"),
        ("redis://[::1]:6379/0", "redis://[::1]:6379/0"),
        ("not a url", "****"),
        ("redis://cache:notaport/0", "****"),
    ],
)
def test_passwords_and_queries_are_masked(url: str, shown: str) -> None:
    assert mask_url(url) == shown


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://hooks.example.com/services/T0/B0/secret", "https://hooks.example.com/****"),
        ("https://hooks.example.com/", "https://hooks.example.com/"),
        ("http://u:p@hooks:8080/x?token=1#f", "http://u:****@hooks:8080/****?****#****"),
    ],
)
def test_a_webhooks_path_is_masked_too(url: str, shown: str) -> None:
    assert mask_url(url, keep_path=False) == shown
