"""POST /v1/events does work bounded by its limits, not by what was sent: an oversized batch is
counted before any event is parsed into objects, and a 422 lists a bounded number of rejections."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from fastapi.testclient import TestClient

import app.api.batch as batch_module
from app.api.batch import (
    MAX_REJECTIONS_PER_ANSWER,
    MAX_REJECTIONS_PER_EVENT,
    BatchError,
    BatchParser,
    count_events,
    scan_batch,
)
from app.api.main import create_app
from app.core.config import Settings
from kvprefetch_client.events import MAX_BLOCKS_PER_EVENT
from tests.api.conftest import routed

JSON = {"content-type": "application/json"}


def empty_events(n: int) -> bytes:
    return b'{"events":[' + b",".join([b"{}"] * n) + b"]}"


def test_a_flood_of_empty_events_is_413_before_any_event_is_parsed(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[str] = []
    real_loads, real_validate = (
        batch_module.orjson.loads,
        batch_module.event_adapter.validate_python,
    )
    monkeypatch.setattr(
        batch_module.orjson, "loads", lambda b: parsed.append("orjson.loads") or real_loads(b)
    )
    monkeypatch.setattr(
        batch_module,
        "event_adapter",
        type(
            "Spy",
            (),
            {
                "validate_python": staticmethod(
                    lambda raw: parsed.append("event") or real_validate(raw)
                )
            },
        ),
    )
    body = empty_events(20_000)  # 60 kB: within the body limit, 400 times the batch limit (50)
    r = client.post("/v1/events", content=body, headers=JSON)
    assert parsed == []  # counted, not parsed: no JSON objects built, no event validated
    assert r.status_code == 413
    assert r.json() == {
        "detail": "a batch holds at most 50 events, got more than 50",
        "field": "events",
    }


def test_a_batch_a_little_over_the_limit_is_413_with_its_count(client: TestClient) -> None:
    r = client.post("/v1/events", content=empty_events(51), headers=JSON)
    assert r.status_code == 413
    assert r.json()["field"] == "events"
    assert r.json()["detail"] in (
        "a batch holds at most 50 events, got 51",
        "a batch holds at most 50 events, got more than 50",
    )


@pytest.mark.parametrize(
    ("body", "events"),
    [
        (b'{"events":[{},{},{}]}', 3),
        (b'{"events":[{"a":"x,y","b":"[,{"},{"c":[1,2,{"d":"]],"}]},3]}', 3),
        (b'{"events":["[",1,1,1]}', 4),  # a bracket in a string does not hide the commas after it
        (b'{"events":["\\\\\\"[,,",1]}', 2),  # escaped backslash, then an escaped quote
        (b'{"events":["\\\\",1,2]}', 3),  # a string ending in an escaped backslash ends there
        (b'{"events":[]}', 1),
        (b'{"events":["' + b"," * 100_000 + b'"]}', 1),
        (b'{"events":[' + b",".join([b"[1,2,3]"] * 70_000) + b"]}", 70_000),  # across count chunks
    ],
)
def test_count_events_counts_the_top_level_array_only(body: bytes, events: int) -> None:
    assert count_events(body, 10**9) == events


def test_count_events_stops_past_the_limit() -> None:
    assert 10 < count_events(empty_events(1_000_000), 10) < 1_000_000


def test_count_events_is_not_fooled_by_deep_nesting() -> None:
    # 256 levels deeper than the events, a comma is not one of theirs (a depth kept in one byte
    # wrapped, and counted it).
    deep = b"[" * 256 + b",".join([b"1"] * 100) + b"]" * 256
    assert count_events(b'{"events":[' + deep + b"]}", 10**9) == 1


def oversized(kind: str, n: int) -> bytes:
    """One event of about n bytes, its bulk in one value of `kind`."""
    if kind == "unknown field of numbers":
        return orjson.dumps(routed("big", junk=[7] * (n // 2)))
    if kind == "one string":
        return orjson.dumps(routed("x" * n))
    if kind == "escaped string":  # a string of escaped quotes and backslashes only
        return orjson.dumps(routed('"\\' * (n // 4)))
    if kind == "deep nesting":
        return orjson.dumps(routed("big", junk=[[[[i, i] for i in range(n // 16)]]]))
    if kind == "a long block list":
        return orjson.dumps(routed("big", block_hashes=list(range(n // 8))))
    raise AssertionError(kind)


KINDS = ["unknown field of numbers", "one string", "escaped string", "deep nesting"]


@pytest.mark.parametrize("kind", [*KINDS, "a long block list"])
def test_an_event_over_the_byte_limit_is_413_naming_it_before_it_is_parsed(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = BatchParser(100, max_event_bytes=64 * 1024)
    body = b'{"events":[' + orjson.dumps(routed("a")) + b", " + oversized(kind, 200_000)
    body += b"," + orjson.dumps(routed("b")) + b"]}"

    def no_parsing(*args: object) -> None:
        raise AssertionError("parsed")

    monkeypatch.setattr(parser, "_adapter", type("Spy", (), {"validate_json": no_parsing}))
    monkeypatch.setattr(batch_module.orjson, "loads", no_parsing)
    with pytest.raises(BatchError) as exc:
        parser.parse(body)
    assert (exc.value.status_code, exc.value.field) == (413, "events[1]")
    assert "KVP_MAX_EVENT_BYTES" in exc.value.message


@pytest.mark.parametrize("kind", KINDS)
def test_the_byte_limit_is_measured_in_one_pass_that_stops_at_the_first_long_event(
    kind: str,
) -> None:
    event = oversized(kind, 2 * 1024 * 1024)
    body = b'{"events":[' + b",".join([event] * 3) + b"]}"
    assert scan_batch(body, 100, len(event) - 1) == batch_module.BatchScan(1, 0)
    assert scan_batch(body, 100, len(event)).oversized is None


def test_a_value_around_the_events_over_the_byte_limit_is_413_naming_the_body() -> None:
    parser = BatchParser(100, max_event_bytes=64 * 1024)
    body = orjson.dumps({"events": [routed("a")], "junk": "x" * 100_000})
    with pytest.raises(BatchError) as exc:
        parser.parse(body)
    assert (exc.value.status_code, exc.value.field) == (413, "body")
    with pytest.raises(BatchError) as exc:
        parser.parse(b" " * 100_000 + orjson.dumps({"events": [routed("a")]}))
    assert (exc.value.status_code, exc.value.field) == (413, "body")


def test_the_largest_legitimate_event_fits_the_default_byte_limit() -> None:
    """As many block hashes as an event holds, each 64 hex characters (a SHA-256): accepted by
    the default KVP_MAX_EVENT_BYTES, with room to spare."""
    hashes = [f"{i:064x}" for i in range(MAX_BLOCKS_PER_EVENT)]
    event = routed("big", block_hashes=hashes)
    body = orjson.dumps({"events": [event, routed("small")]})
    assert len(body) > 4 * 1024 * 1024
    assert [e.event_id for e in BatchParser(10).parse(body).events] == ["big", "small"]
    assert Settings().max_event_bytes == batch_module.DEFAULT_MAX_EVENT_BYTES


def test_the_service_refuses_an_event_over_its_byte_limit(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, max_event_bytes=4096, log_fsync=False)
    with TestClient(create_app(settings)) as c:
        body = orjson.dumps({"events": [routed("a"), routed("b", junk="x" * 5000)]})
        r = c.post("/v1/events", content=body, headers=JSON)
        assert r.status_code == 413
        assert r.json() == {
            "detail": "an event holds at most 4096 bytes (KVP_MAX_EVENT_BYTES); "
            "events[1] is longer",
            "field": "events[1]",
        }
        r = c.post("/v1/events", json={"events": [routed("a"), routed("b")]})
        assert r.status_code == 200 and r.json()["accepted"] == ["a", "b"]


def test_a_valid_batch_with_long_block_lists_is_counted_and_accepted(tmp_path: Path) -> None:
    # More commas than COMMAS_PER_EVENT per allowed event: counted first, then accepted.
    parser = BatchParser(2)
    body = orjson.dumps({"events": [routed("a", block_hashes=list(range(200))), routed("b")]})
    assert body.count(b",") > batch_module.COMMAS_PER_EVENT * 2
    assert [e.event_id for e in parser.parse(body).events] == ["a", "b"]
    with pytest.raises(BatchError) as exc:
        parser.parse(orjson.dumps({"events": [routed("a", block_hashes=list(range(200)))] * 3}))
    assert exc.value.status_code == 413 and exc.value.field == "events"


@pytest.fixture
def roomy_client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(data_dir=tmp_path, max_body_bytes=2 * 1024 * 1024, log_fsync=False)
    with TestClient(create_app(settings)) as c:
        yield c


def test_a_422_is_a_small_multiple_of_its_request(roomy_client: TestClient) -> None:
    """About 1 MB of events, each with a long invalid id and a thousand unknown fields: each
    rejection used to echo the id, and each field had its own."""
    events = []
    for i in range(38):
        event = routed("x" * 1000 + str(i))
        event.update({f"u{j:05d}": 0 for j in range(2400)})
        events.append(event)
    body = orjson.dumps({"events": events})
    assert 0.9e6 < len(body) < 1.1e6
    r = roomy_client.post("/v1/events", content=body, headers=JSON)
    assert r.status_code == 422
    print(f"request {len(body)} bytes, answer {len(r.content)} bytes")
    assert len(r.content) <= 2 * len(body)
    answer = r.json()
    assert answer["accepted"] == [] and answer["duplicates"] == []
    assert len(answer["rejected"]) == MAX_REJECTIONS_PER_ANSWER
    assert answer["rejected_events"] == 38
    # Every event: its ids (event_id, and request_id made from it) too long and 2400 unknown
    # fields, of which 3 are listed while the answer has room.
    assert answer["rejections_omitted"] == 38 * 2402 - MAX_REJECTIONS_PER_ANSWER
    first = answer["rejected"][0]
    assert first == {
        "index": 0,
        "event_id": None,
        "field": "events[0].event_id",
        "message": "String should have at most 128 characters",
    }
    assert [r["field"] for r in answer["rejected"][1:3]] == [
        "events[0].request_id",
        "events[0].u00000",
    ]
    assert answer["rejected"][3]["index"] == 1


def test_at_most_a_few_rejections_per_event_and_valid_ids_are_echoed(client: TestClient) -> None:
    bad = routed("bad1", prompt_tokens=-1, **{f"extra{j}": 1 for j in range(10)})
    r = client.post("/v1/events", json={"events": [bad, routed("ok1")]})
    assert r.status_code == 422
    answer = r.json()
    assert answer["accepted"] == ["ok1"]
    assert len(answer["rejected"]) == MAX_REJECTIONS_PER_EVENT
    assert {x["event_id"] for x in answer["rejected"]} == {"bad1"}
    assert (answer["rejected_events"], answer["rejections_omitted"]) == (
        1,
        11 - MAX_REJECTIONS_PER_EVENT,
    )


def test_a_long_unknown_field_name_is_clipped(client: TestClient) -> None:
    r = client.post("/v1/events", json={"events": [routed("e", **{"f" * 50_000: 1})]})
    assert r.status_code == 422
    rejection = r.json()["rejected"][0]
    assert rejection["field"].startswith("events[0].fff") and len(rejection["field"]) <= 160
    assert len(r.content) < 1000


def test_a_200_answer_keeps_its_three_lists(client: TestClient) -> None:
    r = client.post("/v1/events", json={"events": [routed("a")]})
    assert r.json() == {"accepted": ["a"], "duplicates": [], "rejected": []}


def mixed_batch(n: int) -> bytes:
    """n events, every third with a bad field, some with more than three bad ones."""
    events = []
    for i in range(n):
        if i % 3 == 0:
            events.append(routed(f"e{i}", prompt_tokens=-1, **{f"x{j}": 1 for j in range(i % 5)}))
        else:
            events.append(routed(f"e{i}", block_hashes=list(range(i % 50))))
    return orjson.dumps({"events": events})


def test_a_long_body_parsed_in_slices_answers_as_if_parsed_whole() -> None:
    parser = BatchParser(1000, max_event_bytes=4096)
    body = mixed_batch(600)
    assert len(body) > 25 * 4096
    whole, sliced = parser.parse(body), asyncio.run(parser.parse_async(body))
    assert [e.event_id for e in sliced.events] == [e.event_id for e in whole.events]
    assert sliced.indices == whole.indices and sliced.indices is not None
    assert sliced.rejected == whole.rejected and len(sliced.rejected) == MAX_REJECTIONS_PER_ANSWER
    assert sliced.rejected_first == whole.rejected_first
    assert sliced.rejections_omitted == whole.rejections_omitted > 0
    valid = orjson.dumps({"events": [routed(f"v{i}") for i in range(200)]})
    assert asyncio.run(BatchParser(1000, max_event_bytes=4096).parse_async(valid)).indices is None


def test_a_long_body_lets_the_loop_run_between_slices_of_at_most_the_event_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parser = BatchParser(1000, max_event_bytes=4096)
    body = mixed_batch(600)
    parts: list[int] = []
    real = parser._parse
    monkeypatch.setattr(
        parser, "_parse", lambda part, *a: parts.append(len(part)) or real(part, *a)
    )

    async def scenario() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        ticks = 0
        await parser.parse_async(body)
        task.cancel()
        return ticks

    ticks = asyncio.run(scenario())
    assert len(parts) >= len(body) // 4096
    assert max(parts) <= 4096 + len(b'{"events":[]}')
    assert ticks >= len(parts) - 1  # the loop ran between every two slices


@pytest.mark.parametrize(
    "body",
    [
        orjson.dumps({"events": [routed(f"e{i}") for i in range(100)], "x": 1}),
        orjson.dumps({"x": 1, "events": [routed(f"e{i}") for i in range(100)]}),
        orjson.dumps([routed(f"e{i}") for i in range(100)]),
        orjson.dumps({"events": [routed(f"e{i}") for i in range(50)], "more": [1, 2]}),
        orjson.dumps({"events": [routed(f"e{i}") for i in range(100)]})[:-1],
        orjson.dumps({"events": [routed(f"e{i}") for i in range(100)]}) + b"x",
    ],
)
def test_a_long_body_of_another_shape_is_422_before_it_is_parsed(body: bytes) -> None:
    with pytest.raises(BatchError) as exc:
        asyncio.run(BatchParser(1000, max_event_bytes=4096).parse_async(body))
    assert (exc.value.status_code, exc.value.field) == (422, "body")
