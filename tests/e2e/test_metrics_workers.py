"""`kvprefetch serve --workers 2` as a real process: /metrics sums both workers, whichever
answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import redis_workers

pytestmark = [pytest.mark.slow, pytest.mark.redis]

EVENTS_PER_POST = 10
MAX_POSTS = 400  # the kernel spreads new connections over both workers long before this


@pytest.fixture
def two_workers(
    tmp_path: Path, redis_url: str, clean_redis: str
) -> Iterator[tuple[str, Path, Path]]:
    """The service with two workers on the Redis store; yields its URL, data dir and metrics dir."""
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    (metrics_dir / "counter_99999.db").write_bytes(b"a previous run's values")  # must not be summed
    with redis_workers(tmp_path, redis_url, clean_redis, metrics_dir) as url:
        yield url, tmp_path / "data", metrics_dir


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(f"{url}/metrics", timeout=5.0)
    assert r.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def test_metrics_sum_the_events_posted_to_both_workers(two_workers: tuple[str, Path, Path]) -> None:
    url, data, metrics_dir = two_workers
    assert not (metrics_dir / "counter_99999.db").exists()
    logs = [data / "events" / f"worker-{k}" / "events-00000001.jsonl" for k in (0, 1)]
    posts = 0
    while posts < MAX_POSTS:
        events = [
            {
                "type": "request_routed",
                "event_id": f"p{posts}-e{i}",
                "ts": 1000.0 + posts,
                "session_id": f"s{posts}-{i}",
                "request_id": f"r{posts}-{i}",
                "instance_id": "gpu-0",
                "prompt_tokens": 100,
            }
            for i in range(EVENTS_PER_POST)
        ]
        # A new connection each time, so the kernel may hand it to either worker.
        r = httpx.post(
            f"{url}/v1/events",
            content=orjson.dumps({"events": events}),
            headers={"content-type": "application/json"},
            timeout=5.0,
        )
        assert r.status_code == 200, r.text
        posts += 1
        if posts >= 20 and all(p.exists() and p.stat().st_size for p in logs):
            break
    # Each worker logged some of the batches (one line per batch), and together all of them.
    lines = [len(p.read_bytes().splitlines()) for p in logs]
    assert min(lines) > 0 and sum(lines) == posts, lines

    for _ in range(4):  # whichever worker answers, the sum is the same
        m = scrape(url)
        assert (
            m[("kvprefetch_events_ingested_total", (("type", "request_routed"),))]
            == posts * EVENTS_PER_POST
        )
        assert (
            m[("kvprefetch_advice_outcomes_total", (("outcome", "unscored"), ("slot", "live")))]
            == posts * EVENTS_PER_POST
        )
        assert m[("kvprefetch_model_info", (("slot", "live"), ("version", "heuristic")))] == 1
    assert len(list(metrics_dir.glob("counter_*.db"))) == 2  # one file per worker
