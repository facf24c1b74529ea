"""GET /v1/tools: each tool's calls, p50 and p90, its calls in flight with their predicted return,
and its latest returns against the return predicted at their start."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.clock import ManualClock
from app.core.config import Settings
from tests.api.conftest import routed, settle

NOW = 1000.0


def make(settings: Settings, **kw: Any) -> TestClient:
    quiet = settings.model_copy(
        update={
            "score_interval_seconds": 0.0,
            "plan_interval_seconds": 0.0,
            "dashboard_sample_seconds": 0.0,
            **kw,
        }
    )
    return TestClient(create_app(quiet, clock=ManualClock(NOW)))


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with make(settings) as c:
        yield c


def tool(event_id: str, session: str, ts: float, kind: str, name: str) -> dict[str, Any]:
    return {
        "type": "session_signal",
        "event_id": event_id,
        "ts": ts,
        "session_id": session,
        "kind": kind,
        "tool": name,
    }


def post(client: TestClient, events: list[dict[str, Any]]) -> None:
    r = client.post("/v1/events", json={"events": events})
    assert r.status_code == 200, r.text
    settle(client)


def agent(client: TestClient) -> None:
    """bash: four 5 s runs, then two calls in flight (started 2 s and 8 s ago); search: one 30 s
    run, ended by the session's next request."""
    events: list[dict[str, Any]] = []
    for i in range(4):
        t = 900.0 + 10 * i
        events += [
            tool(f"b{i}", f"run-{i}", t, "tool_started", "bash"),
            tool(f"b{i}-f", f"run-{i}", t + 5.0, "tool_finished", "bash"),
        ]
    events += [
        tool("s0", "run-9", 950.0, "tool_started", "search"),
        routed("s0-next", "run-9", 980.0),
        tool("b8", "run-8", NOW - 8.0, "tool_started", "bash"),
        tool("b7", "run-7", NOW - 2.0, "tool_started", "bash"),
    ]
    post(client, events)


def test_an_empty_service_lists_no_tool(client: TestClient) -> None:
    body = client.get("/v1/tools").json()
    assert body == {"now": NOW, "tracked_max": 32, "in_flight": 0, "expired": 0, "tools": []}


def test_each_tool_with_its_calls_quantiles_and_calls_in_flight(client: TestClient) -> None:
    agent(client)
    body = client.get("/v1/tools").json()
    assert (body["now"], body["in_flight"], body["expired"]) == (NOW, 2, 0)
    bash, search = body["tools"]
    assert (bash["tool"], bash["calls"], bash["p50_seconds"], bash["p90_seconds"]) == (
        "bash",
        4,
        5.0,
        5.0,
    )
    assert (search["tool"], search["calls"], search["p50_seconds"]) == ("search", 1, 30.0)
    assert (bash["in_flight"], search["in_flight"], search["running"]) == (2, 0, [])
    # The longest-running first: 8 s in, past every 5 s run seen (nothing to predict from);
    # 2 s in, predicted back when the 5 s runs are.
    old, young = bash["running"]
    assert old == {
        "session_id": None,
        "tool": "bash",
        "started_at": NOW - 8.0,
        "running_seconds": 8.0,
        "predicted_return_at": None,
    }
    assert (young["running_seconds"], young["predicted_return_at"]) == (2.0, NOW + 3.0)
    # The first run had nothing to be predicted from; the next three were predicted to the second.
    assert [r["predicted_return_at"] for r in bash["returns"]] == [None, 915.0, 925.0, 935.0]
    assert [r["returned_at"] for r in bash["returns"]] == [905.0, 915.0, 925.0, 935.0]
    assert [r["error_seconds"] for r in bash["returns"]] == [None, 0.0, 0.0, 0.0]
    assert bash["return_error_p50_seconds"] == 0.0
    assert search["returns"] == [
        {
            "started_at": 950.0,
            "predicted_return_at": None,
            "returned_at": 980.0,
            "error_seconds": None,
        }
    ]


def test_a_return_later_than_predicted_shows_its_error(client: TestClient) -> None:
    """Five 5 s builds, then one of 50 s: predicted (the median then) 45 s too early."""
    events: list[dict[str, Any]] = []
    for i, took in enumerate([5.0] * 5 + [50.0]):
        t = 600.0 + 60 * i
        events += [
            tool(f"b{i}", "s", t, "tool_started", "build"),
            tool(f"b{i}-f", "s", t + took, "tool_finished", "build"),
        ]
    post(client, events)
    (build,) = client.get("/v1/tools").json()["tools"]
    assert build["returns"][-1] == {
        "started_at": 900.0,
        "predicted_return_at": 905.0,
        "returned_at": 950.0,
        "error_seconds": 45.0,
    }
    assert [r["error_seconds"] for r in build["returns"]] == [None, 0.0, 0.0, 0.0, 0.0, 45.0]
    assert build["return_error_p50_seconds"] == 0.0  # the median, not the mean


def test_limit_bounds_the_calls_listed_not_the_count(client: TestClient) -> None:
    agent(client)
    (bash, _) = client.get("/v1/tools", params={"limit": 1}).json()["tools"]
    assert (bash["in_flight"], [r["running_seconds"] for r in bash["running"]]) == (2, [8.0])


@pytest.mark.parametrize("limit", ["0", "1001", "many"])
def test_a_bad_limit_is_422_naming_it(client: TestClient, limit: str) -> None:
    r = client.get("/v1/tools", params={"limit": limit})
    assert r.status_code == 422
    assert r.json()["field"] == "limit"
    assert repr(limit) in r.json()["detail"]


def test_session_ids_show_only_when_the_operator_opts_in(settings: Settings) -> None:
    with make(settings, dashboard_show_session_ids=True) as c:
        agent(c)
        bash = c.get("/v1/tools").json()["tools"][0]
        assert [r["session_id"] for r in bash["running"]] == ["run-8", "run-7"]


def test_the_tools_beyond_the_tracked_ones_are_pooled_as_other(settings: Settings) -> None:
    with make(settings, tools_tracked=1) as c:
        agent(c)
        body = c.get("/v1/tools").json()
        assert body["tracked_max"] == 1
        assert [(t["tool"], t["calls"]) for t in body["tools"]] == [("bash", 4), ("other", 1)]
        other = body["tools"][1]
        assert other["p50_seconds"] == 30.0 and other["returns"][0]["returned_at"] == 980.0


def test_the_route_is_described_in_the_openapi_document(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    op = spec["paths"]["/v1/tools"]["get"]
    assert op["summary"] == "Each tool's run times and its calls in flight"
    assert "422" in op["responses"]
    assert "ToolsStatus" in spec["components"]["schemas"]
