"""Replay over HTTP (sim/remote.py) against a real service gives what an in-process replay gives.

The slice is small (the synthetic trace's first 250 requests) on a cluster with little HBM, so
lookahead's prefetches change the outcome. The planner's policies run the engine in process
(sim/planned.py); over HTTP the service's own planner is replayed with `--policy service`
(sim/served.py, tests/e2e/test_service_replay_e2e.py).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from app.api.main import create_app
from app.core.config import Settings
from app.state.base import SessionView
from sim.remote import (
    EventsRejected,
    RemoteService,
    RemoteServiceError,
    ServiceUnreachable,
    replay_via,
)
from sim.replay import EngineFeed, ReplayResult, replay, sim_engine
from sim.scenario import Scenario, load_scenario
from sim.traces import TraceRequest, load_trace
from tests.conftest import TRACES, live_server
from tests.ports import dead_port

pytestmark = pytest.mark.slow

HANG_GUARD = 30.0
REQUESTS = 250
# Keys a remote summary adds, and the one that differs run to run.
NOT_COMPARED = {"wall_seconds", "via", "run_id", "events_posted"}


@pytest.fixture(scope="module")
def trace() -> list[TraceRequest]:
    return load_trace(TRACES / "mooncake_synthetic.jsonl")[:REQUESTS]


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    # Two instances with 45 GB of HBM each: evictions and lookahead's prefetches both happen.
    return load_scenario("default").model_copy(
        update={"name": "small-hbm", "instances": 2, "hbm_kv_bytes": 45_000_000_000}
    )


@pytest.fixture(scope="module")
def service_url(tmp_path_factory: pytest.TempPathFactory, scenario: Scenario) -> Iterator[str]:
    """One real service for the module (runs namespace their state), on a port bound before it
    starts."""
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("svc"),
        store="memory",
        log_fsync=False,
        bytes_per_token=scenario.bytes_per_token,
        block_tokens=scenario.block_tokens,
        replica_id="test-remote",
    )
    with live_server(create_app(settings), HANG_GUARD) as url:
        yield url


class CountingFeed(EngineFeed):
    """The in-process engine, counting the policy's session reads."""

    reads = 0

    def session(self, session_id: str) -> SessionView | None:
        self.reads += 1
        return super().session(session_id)


def in_process(
    trace: list[TraceRequest], scenario: Scenario, policy: str
) -> tuple[ReplayResult, CountingFeed]:
    feed = CountingFeed(sim_engine(scenario, load_model=False), keep_events=True)
    return replay(trace, scenario, policy=policy, engine=feed), feed


@pytest.fixture(scope="module")
def local_run(
    trace: list[TraceRequest], scenario: Scenario
) -> Callable[..., tuple[ReplayResult, CountingFeed]]:
    """in_process() on the trace's first `n` requests, run once per (policy, n) for the module:
    the tests only read what it returns (the summary, the feed's events, store and read count)."""

    @functools.cache
    def run(policy: str, n: int = REQUESTS) -> tuple[ReplayResult, CountingFeed]:
        return in_process(trace[:n], scenario, policy)

    return run


def compared(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in NOT_COMPARED}


def sessions_of(trace_result: ReplayResult) -> list[str]:
    return sorted({r.session_id for r in trace_result.requests})


@pytest.mark.parametrize("policy", ["lookahead", "none"])
def test_over_http_matches_in_process(
    policy: str,
    trace: list[TraceRequest],
    scenario: Scenario,
    service_url: str,
    local_run: Callable[..., Any],
) -> None:
    local, feed = local_run(policy)
    # Injecting the in-process engine is the default path.
    assert compared(replay(trace, scenario, policy=policy).summary) == compared(local.summary)

    run_id = f"t-{policy}"
    remote = replay_via(service_url, trace, scenario, policy=policy, run_id=run_id)

    assert compared(remote.summary) == compared(local.summary)
    assert set(remote.summary) == set(local.summary) | {"via", "run_id", "events_posted"}
    assert remote.summary["via"] == service_url
    assert remote.summary["run_id"] == run_id
    assert remote.summary["events_posted"] == len(feed.events) > REQUESTS

    # The service's state is the in-process store's, session by session (ids translated back) ...
    sessions = sessions_of(local)
    with RemoteService(
        service_url, run_id=run_id, bytes_per_token=scenario.bytes_per_token
    ) as reader:
        for sid in sessions[::7] + sessions[-3:]:
            assert reader.session(sid) == feed.store.session(sid), sid
        assert reader.session("never-seen") is None
        assert reader.stats.events_emitted == 0
    # ... and holds it under the run's namespace.
    sid = sessions[0]
    raw = httpx.get(f"{service_url}/v1/sessions/{run_id}:{sid}").json()
    assert raw["session_id"] == f"{run_id}:{sid}"
    assert raw["instance_id"].startswith(f"{run_id}:gpu-")
    assert raw["last_request"]["request_id"].startswith(f"{run_id}:q")
    blocks = feed.store.session(sid).block_hashes  # type: ignore[union-attr]
    assert raw["block_hashes"] != blocks == [h & 0xFFFF_FFFF for h in raw["block_hashes"]]
    assert httpx.get(f"{service_url}/v1/sessions/{sid}").status_code == 404


def test_the_planners_policies_are_refused_over_http(
    trace: list[TraceRequest], scenario: Scenario, service_url: str
) -> None:
    with (
        RemoteService(service_url, bytes_per_token=scenario.bytes_per_token) as engine,
        pytest.raises(ValueError, match="--policy service"),
    ):
        replay(trace, scenario, policy="heuristic", engine=engine)


def test_a_second_run_against_the_same_service_sees_only_its_own_state(
    trace: list[TraceRequest], scenario: Scenario, service_url: str, local_run: Callable[..., Any]
) -> None:
    local, _ = local_run("lookahead")
    first = replay_via(service_url, trace, scenario, policy="lookahead")
    second = replay_via(service_url, trace, scenario, policy="lookahead")
    assert first.summary["run_id"] != second.summary["run_id"]
    assert compared(first.summary) == compared(second.summary) == compared(local.summary)
    assert first.summary["events_posted"] == second.summary["events_posted"]


def test_keep_events_keeps_what_an_in_process_replay_keeps(
    trace: list[TraceRequest], scenario: Scenario, service_url: str, local_run: Callable[..., Any]
) -> None:
    _, feed = local_run("none", 40)
    remote = replay_via(service_url, trace[:40], scenario, policy="none", keep_events=True)
    assert remote.events == feed.events


def test_an_unreachable_service_is_named(trace: list[TraceRequest], scenario: Scenario) -> None:
    with dead_port() as port:
        url = f"http://127.0.0.1:{port}"
        with pytest.raises(ServiceUnreachable, match=f"no kvprefetch service answers at {url} "):
            replay_via(url, trace[:10], scenario)


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (404, b"Not Found", "answered HTTP 404: Not Found: is this a kvprefetch service?"),
        (
            503,
            b'{"status": "unavailable", "store": "redis", "store_ok": false}',
            "the kvprefetch service at http://kvp.test is not ready .*'redis'",
        ),
    ],
)
def test_a_service_not_ready_or_not_kvprefetch_is_refused(
    status: int, body: bytes, message: str
) -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
    with pytest.raises(ServiceUnreachable, match=message):
        RemoteService("http://kvp.test", transport=transport)


def test_rejected_events_raise_with_the_field(service_url: str) -> None:
    engine = RemoteService(service_url)
    engine.emit(
        "request_routed",
        1.0,
        {"session_id": "s", "request_id": "q0", "instance_id": "gpu-0", "prompt_tokens": -5},
    )
    with pytest.raises(EventsRejected, match=r"refused 1 events .*prompt_tokens"):
        engine.close()


def test_a_service_counting_other_bytes_per_token_is_refused(service_url: str) -> None:
    with RemoteService(service_url, bytes_per_token=1) as engine:
        engine.emit(
            "request_routed",
            1.0,
            {"session_id": "s", "request_id": "q0", "instance_id": "gpu-0", "prompt_tokens": 100},
        )
        with pytest.raises(RemoteServiceError, match="KVP_BYTES_PER_TOKEN=1"):
            engine.session("s")


def test_run_ids_that_would_break_the_namespace_are_refused() -> None:
    for bad in ("a:b", "a/b", "x" * 65):
        with pytest.raises(ValueError, match="run_id"):
            RemoteService("http://127.0.0.1:9", run_id=bad)


def test_the_replay_command_takes_via(service_url: str, tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from kvprefetch_cli import cli

    lines = (TRACES / "mooncake_synthetic.jsonl").read_text().splitlines()[:120]
    small = tmp_path / "small.jsonl"
    small.write_text("\n".join(lines) + "\n")
    args = ["replay", "--trace", str(small), "--policy", "none", "--json"]
    local = json.loads(CliRunner().invoke(cli, args).stdout)
    remote = CliRunner().invoke(cli, [*args, "--via", service_url])
    assert remote.exit_code == 0, remote.output
    summary = json.loads(remote.stdout)
    assert summary["via"] == service_url
    assert {k: summary[k] for k in local if k != "wall_seconds"} == {
        k: v for k, v in local.items() if k != "wall_seconds"
    }
    bad = CliRunner().invoke(cli, [*args, "--via", "http://127.0.0.1:1"])
    assert bad.exit_code != 0 and "127.0.0.1:1" in bad.output


# -- --speed: a paced replay plays as live traffic ------------------------------------------------


class FakeService:
    """A MockTransport handler: ready, takes every event, answers one session view."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.view: dict[str, Any] | None = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(200, json={"status": "ok", "store_ok": True})
        if request.url.path == "/v1/events":
            events = orjson.loads(request.content)["events"]
            self.events += events
            return httpx.Response(
                200,
                json={
                    "accepted": [e["event_id"] for e in events],
                    "duplicates": [],
                    "rejected": [],
                },
            )
        if request.url.path.startswith("/v1/sessions/") and self.view is not None:
            return httpx.Response(200, json=self.view)
        return httpx.Response(404, json={"detail": "not found"})


def test_speed_posts_events_when_due_stamped_with_wall_clock_times() -> None:
    service = FakeService()
    engine = RemoteService(
        "http://kvp.test", run_id="paced", speed=20.0, transport=httpx.MockTransport(service)
    )
    before, start = time.time(), time.monotonic()
    for i, ts in enumerate([100.0, 101.0, 104.0]):
        engine.emit("session_closed", ts, {"session_id": f"s{i}"})
    elapsed = time.monotonic() - start
    engine.close()
    after = time.time()

    assert elapsed >= (104.0 - 100.0) / 20.0  # the last event waited until it was due
    stamps = [e["ts"] for e in service.events]
    assert before <= stamps[0] <= after
    assert stamps[1] - stamps[0] == pytest.approx(1.0 / 20.0)
    assert stamps[2] - stamps[0] == pytest.approx(4.0 / 20.0)
    assert [e["session_id"] for e in service.events] == ["paced:s0", "paced:s1", "paced:s2"]


def test_speed_translates_the_session_views_back_to_trace_time() -> None:
    service = FakeService()
    engine = RemoteService(
        "http://kvp.test", run_id="paced", speed=10.0, transport=httpx.MockTransport(service)
    )
    engine.emit("session_closed", 50.0, {"session_id": "s0"})  # trace time 50 -> the first stamp
    engine._sync()
    wall0 = service.events[0]["ts"]
    service.view = {
        "session_id": "paced:s",
        "state": "idle",
        "turns": 2,
        "first_seen_ts": wall0 + 1.0,
        "last_activity_ts": wall0 + 3.0,
        "closed_ts": None,
        "instance_id": "paced:gpu-0",
        "context_tokens": 0,
        "context_bytes": 0,
        "block_hashes": [],
        "block_tokens": 512,
        "recent_arrivals_ts": [wall0 + 1.0, wall0 + 2.5],
        "inter_turn_gaps_seconds": [1.5],
        "last_request": {
            "request_id": "paced:q1",
            "instance_id": "paced:gpu-0",
            "routed_ts": wall0 + 2.5,
            "started_ts": wall0 + 2.6,
            "finished_ts": wall0 + 3.0,
            "prompt_tokens": 10,
            "output_tokens": 5,
            "context_tokens": 15,
        },
        "resident_blocks": {"hbm@paced:gpu-0": 0},
    }
    view = engine.session("s")
    engine.close()
    assert view is not None
    assert view.first_seen_ts == pytest.approx(60.0)
    assert view.last_activity_ts == pytest.approx(80.0)
    assert view.closed_ts is None
    assert view.recent_arrivals_ts == pytest.approx([60.0, 75.0])
    assert view.inter_turn_gaps_seconds == pytest.approx([15.0])
    assert view.last_request is not None
    assert (
        view.last_request.routed_ts,
        view.last_request.started_ts,
        view.last_request.finished_ts,
    ) == (pytest.approx(75.0), pytest.approx(76.0), pytest.approx(80.0))
    assert view.instance_id == "gpu-0" and view.resident_blocks == {"hbm@gpu-0": 0}


@pytest.mark.parametrize("speed", [0.0, -1.0, float("inf"), float("nan")])
def test_speed_must_be_a_positive_number(speed: float) -> None:
    with pytest.raises(ValueError, match="speed"):
        RemoteService("http://127.0.0.1:9", speed=speed)


def test_a_paced_replay_reads_views_in_trace_time(
    trace: list[TraceRequest], scenario: Scenario, service_url: str, local_run: Callable[..., Any]
) -> None:
    """Paced, the service holds wall-clock times; the views read back are the in-process ones."""
    small = trace[:40]
    local, feed = local_run("lookahead", len(small))
    span = max(r.finished_at or 0.0 for r in local.requests) - min(
        r.arrival for r in local.requests
    )
    speed = span / 0.5  # the run takes about half a second
    started = time.time()
    with RemoteService(
        service_url, run_id="t-paced", bytes_per_token=scenario.bytes_per_token, speed=speed
    ) as engine:
        result = replay(small, scenario, policy="lookahead", engine=engine)
        sid = sessions_of(local)[0]
        view, expected = engine.session(sid), feed.store.session(sid)
    assert time.time() - started >= span / speed * 0.9
    assert view is not None and expected is not None
    assert view.model_dump(
        exclude={
            "first_seen_ts",
            "last_activity_ts",
            "recent_arrivals_ts",
            "inter_turn_gaps_seconds",
            "last_request",
            "closed_ts",
        }
    ) == expected.model_dump(
        exclude={
            "first_seen_ts",
            "last_activity_ts",
            "recent_arrivals_ts",
            "inter_turn_gaps_seconds",
            "last_request",
            "closed_ts",
        }
    )
    assert view.last_activity_ts == pytest.approx(expected.last_activity_ts, abs=1e-3)
    assert view.inter_turn_gaps_seconds == pytest.approx(expected.inter_turn_gaps_seconds, abs=1e-3)
    # The service itself holds the session at wall-clock times.
    raw = httpx.get(f"{service_url}/v1/sessions/t-paced:{sid}").json()
    assert started - 1.0 <= raw["last_activity_ts"] <= time.time() + 1.0
    assert result.summary["requests"] == local.summary["requests"]


def test_the_replay_command_takes_speed(service_url: str, tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from kvprefetch_cli import cli

    lines = (TRACES / "mooncake_synthetic.jsonl").read_text().splitlines()[:30]
    small = tmp_path / "small.jsonl"
    small.write_text("\n".join(lines) + "\n")
    args = ["replay", "--trace", str(small), "--policy", "none", "--json"]
    local = json.loads(CliRunner().invoke(cli, args).stdout)
    speed = local["simulated_seconds"] / 0.5
    started = time.monotonic()
    remote = CliRunner().invoke(cli, [*args, "--via", service_url, "--speed", str(speed)])
    assert remote.exit_code == 0, remote.output
    assert time.monotonic() - started >= 0.4
    summary = json.loads(remote.stdout)
    skip = {"wall_seconds"}
    assert {k: summary[k] for k in local if k not in skip} == {
        k: v for k, v in local.items() if k not in skip
    }

    no_via = CliRunner().invoke(cli, [*args, "--speed", "10"])
    assert no_via.exit_code != 0 and "--via" in no_via.output
    zero = CliRunner().invoke(cli, [*args, "--via", service_url, "--speed", "0"])
    assert zero.exit_code != 0 and "positive" in zero.output
