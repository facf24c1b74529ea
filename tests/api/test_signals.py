"""session_signal over POST /v1/events: accepted for any session, read back, bad fields named, and
documented in the OpenAPI schema with an example."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.core.config import Settings
from app.ingest.eventlog import iter_log
from kvprefetch_client.events import event_adapter
from tests.api.conftest import routed


def signal(event_id: str, **kw: Any) -> dict[str, Any]:
    return {
        "type": "session_signal",
        "event_id": event_id,
        "ts": 2.0,
        "session_id": "s1",
        "kind": "typing",
        **kw,
    }


def post(client: TestClient, events: list[dict[str, Any]]):  # type: ignore[no-untyped-def]
    return client.post("/v1/events", json={"events": events})


def test_a_signal_for_an_unknown_session_is_accepted_and_read_back(
    client: TestClient, settings: Settings
) -> None:
    r = post(client, [signal("g1", kind="tool_started", tool="bash", expected_in_seconds=3)])
    assert r.status_code == 200, r.json()
    v = client.get("/v1/sessions/s1").json()
    assert (v["state"], v["turns"], v["signals_total"]) == ("idle", 0, 1)
    assert v["signals"] == [
        {
            "ts": 2.0,
            "kind": "tool_started",
            "tool": "bash",
            "instance_id": None,
            "expected_in_seconds": 3.0,
            "expected_prompt_tokens": None,
        }
    ]
    assert [e.event_id for _, e in iter_log(settings.event_log_dir)] == ["g1"]
    # A deployment's own kind is fine; the session's request then gives it its times.
    assert (
        post(client, [signal("g2", kind="voice.started"), routed("a", ts=5.0)]).status_code == 200
    )
    v = client.get("/v1/sessions/s1").json()
    assert (v["turns"], v["signals_total"], v["first_seen_ts"]) == (1, 2, 5.0)


@pytest.mark.parametrize(
    ("event", "field"),
    [
        (signal("x", expected_in_seconds=-1.0), "expected_in_seconds"),
        (signal("x", expected_in_seconds="3"), "expected_in_seconds"),
        (signal("x", expected_in_seconds=1e12), "expected_in_seconds"),
        (signal("x", expected_prompt_tokens=-5), "expected_prompt_tokens"),
        (signal("x", kind="Typing!"), "kind"),
        (signal("x", kind=""), "kind"),
        (signal("x", kind="k" * 65), "kind"),
        (signal("x", tool=""), "tool"),
        ({k: v for k, v in signal("x").items() if k != "kind"}, "kind"),
    ],
)
def test_a_bad_signal_is_422_naming_the_field(
    client: TestClient, settings: Settings, event: dict[str, Any], field: str
) -> None:
    r = post(client, [event, signal("ok")])
    assert r.status_code == 422, r.json()
    assert [x["field"] for x in r.json()["rejected"]] == [f"events[0].{field}"]
    assert r.json()["accepted"] == ["ok"]
    assert [e.event_id for _, e in iter_log(settings.event_log_dir)] == ["ok"]


# A number that is not finite never reaches the field: NaN and Infinity are not JSON, and 1e400
# (infinity as a double) is refused by the body's parser, as for every field. The field refuses
# it too (tests/client: the model, where a Python caller could pass math.inf).
@pytest.mark.parametrize("number", ["1e400", "-1e400", "NaN", "Infinity"])
def test_a_signal_not_finite_is_refused(client: TestClient, number: str) -> None:
    body = (
        '{"events": [{"type": "session_signal", "event_id": "x", "ts": 1.0, "session_id": "s",'
        f' "kind": "opened", "expected_in_seconds": {number}}}]}}'
    )
    r = client.post("/v1/events", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["field"] == "body"
    assert client.get("/v1/sessions/s").status_code == 404


def test_the_openapi_schema_describes_the_signal_with_an_example(client: TestClient) -> None:
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    sig = schemas["SessionSignal"]
    assert "before a session's next request" in sig["description"]
    assert set(sig["properties"]) >= {"kind", "tool", "expected_in_seconds", "session_id"}
    (example,) = sig["examples"]
    assert event_adapter.validate_python(example).type == "session_signal"
    refs = {x["$ref"] for x in schemas["EventBatch"]["properties"]["events"]["items"]["oneOf"]}
    assert "#/components/schemas/SessionSignal" in refs
