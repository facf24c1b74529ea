"""GET /metrics: promtool accepts it, every family counts exactly what happened, and no id leaks
into a label."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from app.api.main import create_app
from app.core.bundle import DEFAULT_MODEL_DIR
from app.core.clock import ManualClock
from app.core.config import Settings
from app.decide.advisor import SessionAdvice
from app.observe.metrics import prepare_multiprocess_dir, rejection_field
from kvprefetch_client.events import SIGNAL_KINDS
from tests.api.conftest import routed, settle

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# Round numbers for the reuse test: a block is 100 kB, 0.1 s over the pool link, 0.01 s to
# recompute.
ROUND = {
    "bytes_per_token": 1000,
    "block_tokens": 100,
    "pool_link_bytes_per_second": 1e6,
    "host_link_bytes_per_second": 4e6,
    "prefill_tokens_per_second": 10_000.0,
    "gpu_hour_price": 3.6,
}
BLOCK_BYTES = 1000 * 100


@pytest.fixture
def make_client(settings: Settings) -> Iterator[Callable[..., TestClient]]:
    """A service whose loops do not run by themselves (tests tick them), on a manual clock."""
    opened: list[TestClient] = []

    def make(**overrides: Any) -> TestClient:
        quiet = settings.model_copy(
            update={
                "score_interval_seconds": 0.0,
                "plan_interval_seconds": 0.0,
                "dashboard_sample_seconds": 0.0,
                **overrides,
            }
        )
        client = TestClient(create_app(quiet, clock=ManualClock(1000.0)))
        client.__enter__()
        opened.append(client)
        return client

    yield make
    for client in opened:
        client.__exit__(None, None, None)


def scrape(client: TestClient) -> Samples:
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def post(client: TestClient, events: list[dict[str, Any]], status: int = 200) -> dict[str, Any]:
    r = client.post("/v1/events", json={"events": events})
    assert r.status_code == status, r.text
    settle(client)
    return r.json()


def stored(
    event_id: str, tier: str, blocks: list[int], instance_id: str = "gpu-0"
) -> dict[str, Any]:
    where = {} if tier == "pool" else {"instance_id": instance_id}
    return {
        "type": "kv_blocks_stored",
        "event_id": event_id,
        "ts": 10.0,
        "tier": tier,
        "block_hashes": blocks,
        **where,
    }


def signal(event_id: str, session_id: str, ts: float, kind: str = "typing") -> dict[str, Any]:
    return {
        "type": "session_signal",
        "event_id": event_id,
        "ts": ts,
        "session_id": session_id,
        "kind": kind,
    }


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is required to check the exposition and is not on PATH: "
            "run .ci/ensure-promtool "
            "(installs Debian's prometheus package; `make test` runs it)",
            pytrace=False,
        )
    return path


def one_of_everything(c: TestClient) -> None:
    """Traffic that puts a sample in every family: events of each kind, a duplicate, rejections, a
    refused body, reuse outcomes, a scoring tick with a shadow, a planning tick with orders."""
    state = c.app.state.engine  # type: ignore[attr-defined]
    assert c.put("/v1/model/shadow", json={"model_dir": str(DEFAULT_MODEL_DIR)}).status_code == 200
    post(
        c,
        [
            stored("h", "hbm", [1, 2]),
            stored("p", "pool", [1, 2, 3, 50, 51]),
            {
                "type": "instance_status",
                "event_id": "st",
                "ts": 10.0,
                "instance_id": "gpu-0",
                "free_kv_bytes": 10**12,
            },
            routed("a1", "a", 20.0, block_hashes=[1, 2, 9]),
            routed("b1", "b", 21.0, block_hashes=[1, 2, 3]),
            routed("c1", "c", 22.0, block_hashes=[3]),
            {
                "type": "request_finished",
                "event_id": "a1-f",
                "ts": 25.0,
                "session_id": "a",
                "request_id": "r-a1",
                "instance_id": "gpu-0",
                "output_tokens": 10,
            },
        ],
    )
    post(c, [routed("a1", "a", 20.0)])
    post(c, [signal("g1", "a", 19.0), routed("a2", "a", 21.0)])
    post(c, [routed("x", "x", 30.0, prompt_tokens=-1)], status=422)
    assert (
        c.post("/v1/events", content=b"{", headers={"content-type": "application/json"}).status_code
        == 400
    )
    state.scorer.tick()
    state.scheduler.advise(
        [SessionAdvice("p", "gpu-0", (50, 51), "lru", 0.0, 0.9, 0.9, 0.9, True)], 1000.0
    )
    asyncio.run(state.dispatcher.tick())


def test_promtool_accepts_the_exposition(make_client: Callable[..., TestClient]) -> None:
    tool = promtool()
    c = make_client()
    one_of_everything(c)
    text = c.get("/metrics").text
    checked = subprocess.run(
        [tool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60
    )
    assert (checked.returncode, checked.stdout + checked.stderr) == (0, b""), text
    ours = {
        f.name
        for f in text_string_to_metric_families(text)
        if not f.name.startswith(("process_", "python_"))
    }
    assert all(name.startswith("kvprefetch_") for name in ours), ours
    for family in text_string_to_metric_families(text):
        if family.name.startswith("kvprefetch_"):
            assert family.samples, f"{family.name} has no sample after one of everything"


def test_events_accepted_duplicate_rejected_and_refused_are_counted_exactly(
    make_client: Callable[..., TestClient],
) -> None:
    c = make_client()
    batch = [
        routed("q1", "s1", 1.0),
        routed("q2", "s2", 1.0),
        routed("q3", "s3", 1.0),
        {"type": "session_closed", "event_id": "cl", "ts": 2.0, "session_id": "s3"},
        stored("k1", "hbm", [7]),
    ]
    post(c, batch)
    assert post(c, batch[:2] + [routed("q4", "s4", 3.0)])["duplicates"] == ["q1", "q2"]
    mixed = [
        routed("ok", "s5", 4.0),
        routed("bad1", "s6", 4.0, prompt_tokens=-1, instance_id=""),  # two fields: counted once
        {"type": "request_routed", "event_id": "bad2", "ts": 4.0, "typo_field": 1},
        {"type": "no_such_type", "event_id": "bad3", "ts": 4.0},
        {
            "type": "vllm_kv_events",
            "event_id": "bad4",
            "ts": 4.0,
            "instance_id": "gpu-0",
            "events": [{"type": "BlockStored", "block_hashes": [], "block_size": 16}],
        },
    ]
    rejected = post(c, mixed, status=422)["rejected"]
    assert len(rejected) > 4  # bad1 and bad2 are rejected for several fields each
    json_body = {"content-type": "application/json"}
    assert c.post("/v1/events", content=b"[", headers=json_body).status_code == 400
    assert (
        c.post("/v1/events", content=b"{}", headers={"content-type": "text/plain"}).status_code
        == 415
    )
    assert c.post("/v1/events", json={"events": []}).status_code == 422
    too_many = [routed(f"m{i}", "s", 1.0) for i in range(51)]  # the fixture's limit is 50
    assert c.post("/v1/events", json={"events": too_many}).status_code == 413

    m = scrape(c)
    ingested = {
        t: value(m, "kvprefetch_events_ingested_total", type=t)
        for t in (
            "request_routed",
            "session_closed",
            "kv_blocks_stored",
            "request_finished",
            "vllm_kv_events",
        )
    }
    assert ingested == {
        "request_routed": 5,
        "session_closed": 1,
        "kv_blocks_stored": 1,
        "request_finished": 0,
        "vllm_kv_events": 0,
    }
    assert value(m, "kvprefetch_events_duplicate_total") == 2
    # Each under its first field only, in the schema's order: bad1's instance_id, not its
    # prompt_tokens;
    # bad2's first missing field, not its typo.
    assert {
        labels[0][1]: v
        for (name, labels), v in m.items()
        if name == "kvprefetch_events_rejected_total"
    } == {"instance_id": 1, "session_id": 1, "event": 1, "events.block_hashes": 1}
    assert {
        labels[0][1]: v
        for (name, labels), v in m.items()
        if name == "kvprefetch_event_batches_refused_total"
    } == {"400": 1, "413": 1, "415": 1, "422": 1}


def test_rejected_fields_are_a_bounded_set() -> None:
    assert rejection_field("events[3].prompt_tokens") == "prompt_tokens"
    assert rejection_field("events[12].block_hashes[40]") == "block_hashes"
    assert rejection_field("events[4].events[0].block_size") == "events.block_size"
    assert rejection_field("events[2]") == "event"
    # A field no event has is named by the client: any string, so never a label value.
    assert rejection_field("events[3].user-123-session") == "other"


def test_what_arriving_requests_found_bytes_stall_and_cost(
    make_client: Callable[..., TestClient],
) -> None:
    c = make_client(**ROUND)
    post(
        c,
        [
            stored("h0", "hbm", [1, 2, 3]),
            stored("h1", "hbm", [1], "gpu-1"),
            stored("p", "pool", [1, 2, 3]),
        ],
    )
    arrivals = [
        routed("hit", "a", 20.0, block_hashes=[1, 2, 3, 4]),  # 3 reused, all in HBM
        routed("partial", "b", 20.0, block_hashes=[1, 2, 3], instance_id="gpu-1"),  # 1 of 3
        routed("miss", "c", 20.0, block_hashes=[1, 2], instance_id="gpu-2"),  # 0 of 2
        routed("first", "d", 20.0, block_hashes=[90, 91]),  # nothing reused
        routed("blind", "e", 20.0),
    ]  # no blocks named
    post(c, arrivals)
    post(c, arrivals[:1])  # a duplicate is not a second arrival
    m = scrape(c)
    assert {
        o: value(m, "kvprefetch_reuse_requests_total", outcome=o)
        for o in ("hit", "partial", "miss")
    } == {"hit": 1, "partial": 1, "miss": 1}
    assert value(m, "kvprefetch_reused_bytes_total", resident="true") == 4 * BLOCK_BYTES
    assert value(m, "kvprefetch_reused_bytes_total", resident="false") == 4 * BLOCK_BYTES
    # Missing: 2 blocks (partial) + 2 (miss), each recomputed in 0.01 s rather than loaded in 0.1 s.
    assert value(m, "kvprefetch_stall_seconds_total") == pytest.approx(0.04)
    assert value(m, "kvprefetch_stall_avoided_seconds_total") == pytest.approx(0.04)
    # 3.6 dollars per GPU-hour is a thousandth of a dollar per second.
    assert value(m, "kvprefetch_gpu_saved_dollars_total") == pytest.approx(0.04 * 0.001)


def test_orders_follow_the_schedulers_totals(make_client: Callable[..., TestClient]) -> None:
    c = make_client(bytes_per_token=1000, block_tokens=100)
    state = c.app.state.engine  # type: ignore[attr-defined]
    blocks = {
        s: list(range(100 * i, 100 * i + 20))
        for i, s in enumerate(("s9", "s8", "s7", "s6", "s5", "s4"), 1)
    }
    post(
        c,
        [
            stored("pool", "pool", [b for s in ("s9", "s8", "s7", "s6") for b in blocks[s]]),
            stored("hbm", "hbm", blocks["s5"] + blocks["s4"]),
            {
                "type": "instance_status",
                "event_id": "st",
                "ts": 10.0,
                "instance_id": "gpu-0",
                "free_kv_bytes": 10**12,
            },
        ],
    )

    def advise(session: str, p_soon: float, retention: str = "lru") -> None:
        state.scheduler.advise(
            [
                SessionAdvice(
                    session,
                    "gpu-0",
                    tuple(blocks[session]),
                    retention,  # type: ignore[arg-type]
                    300.0,
                    p_soon,
                    p_soon,
                    p_soon,
                    p_soon >= 0.5,
                )
            ],
            1000.0,
        )

    for session in ("s9", "s8", "s7", "s6"):
        advise(session, 0.9)
    advise("s5", 0.9, "keep")
    advise("s4", 0.01, "demote")
    asyncio.run(state.dispatcher.tick())
    orders = {o.session_ids[0]: o for o in state.scheduler.open_orders()}
    assert sorted(orders) == ["s6", "s7", "s8", "s9"]

    def progress(session: str, status: str, **kw: Any) -> dict[str, Any]:
        return {
            "type": "order_progress",
            "event_id": f"{session}-{status}",
            "ts": 1001.0,
            "order_id": orders[session].order_id,
            "status": status,
            **kw,
        }

    post(
        c,
        [
            progress("s9", "completed", bytes=20 * BLOCK_BYTES, seconds=0.1),
            progress("s8", "failed", reason="the pool lost them"),
            progress("s6", "accepted"),
            # s9's landing evicted before any request used it: wasted.
            {
                "type": "kv_blocks_removed",
                "event_id": "s9-evicted",
                "ts": 1001.5,
                "tier": "hbm",
                "instance_id": "gpu-0",
                "block_hashes": blocks["s9"],
            },
        ],
    )
    for session in ("s9", "s8"):  # done with: no second order for them
        advise(session, 0.1)
    advise("s7", 0.1)  # fell before it started: cancelled
    advise("s6", 0.1)  # fell while moving: runs on
    asyncio.run(state.dispatcher.tick())

    t = state.scheduler.totals
    assert (t.orders, t.completed, t.failed, t.cancelled) == (
        {"prefetch": 4, "pin": 1, "demote": 1},
        1,
        1,
        1,
    )
    for _ in range(2):  # a second scrape adds nothing
        m = scrape(c)
        assert {k: value(m, "kvprefetch_orders_issued_total", kind=k) for k in t.orders} == t.orders
        for outcome in ("completed", "failed", "cancelled"):
            assert value(m, f"kvprefetch_orders_{outcome}_total", kind="prefetch") == 1
        assert (
            value(m, "kvprefetch_prefetch_ordered_bytes_total")
            == 4 * 20 * BLOCK_BYTES
            == t.bytes_ordered
        )
        assert (
            value(m, "kvprefetch_prefetch_landed_bytes_total") == 20 * BLOCK_BYTES == t.bytes_landed
        )
        assert (
            value(m, "kvprefetch_prefetch_wasted_bytes_total") == 20 * BLOCK_BYTES == t.bytes_wasted
        )
        assert value(m, "kvprefetch_prefetch_used_bytes_total") == t.bytes_used == 0
        assert value(m, "kvprefetch_prefetch_unused_bytes_total") == t.bytes_unused
        assert value(m, "kvprefetch_prefetch_waiting_bytes") == t.bytes_waiting == 0
        assert value(m, "kvprefetch_plan_duration_seconds_count") == 2


def test_predictions_would_be_hits_and_model_versions(
    tmp_path: Path, make_client: Callable[..., TestClient]
) -> None:
    # The heuristic serves (no model there), the bundled model shadows.
    c = make_client(
        model_dir=tmp_path / "none",
        shadow_model_dir=DEFAULT_MODEL_DIR,
        models_root=DEFAULT_MODEL_DIR.parent,
    )
    state = c.app.state.engine  # type: ignore[attr-defined]
    turns = []
    for session, ts in (("a", 900.0), ("b", 400.0)):
        turns += [
            routed(f"{session}0", session, ts, block_hashes=[1]),
            {
                "type": "request_finished",
                "event_id": f"{session}0-f",
                "ts": ts + 5.0,
                "session_id": session,
                "request_id": f"r-{session}0",
                "instance_id": "gpu-0",
                "output_tokens": 50,
            },
        ]
    post(c, turns)
    assert state.scorer.tick() == 2  # at 1000, both idle
    post(c, [routed("a1", "a", 1050.0), routed("b1", "b", 1060.0), routed("c0", "c", 1055.0)])

    m = scrape(c)
    for slot in ("live", "shadow"):
        stats = state.ledger.stats(slot)
        assert value(m, "kvprefetch_predictions_total", slot=slot) == stats.predictions == 2
        assert {
            o: value(m, "kvprefetch_advice_outcomes_total", slot=slot, outcome=o)
            for o in ("hit", "miss", "unscored")
        } == {"hit": stats.hits, "miss": stats.misses, "unscored": stats.unscored}
        assert (
            stats.hits + stats.misses == 2 and stats.unscored == 3
        )  # c, and a's and b's first turns
        assert value(m, "kvprefetch_inference_duration_seconds_count", slot=slot) == 1
    assert value(m, "kvprefetch_model_info", slot="live", version="heuristic") == 1
    assert value(m, "kvprefetch_model_info", slot="shadow", version="default") == 1
    live_hits = value(m, "kvprefetch_advice_outcomes_total", slot="live", outcome="hit")

    # A reload counts the live slot afresh in the ledger; the exported counters never go back.
    assert c.post("/v1/model/reload", json={"model_dir": str(DEFAULT_MODEL_DIR)}).status_code == 200
    assert c.delete("/v1/model/shadow").status_code == 204
    post(c, [routed("d0", "d", 1090.0)])
    m = scrape(c)
    infos = {labels: v for (name, labels), v in m.items() if name == "kvprefetch_model_info"}
    assert infos == {(("slot", "live"), ("version", "default")): 1}
    assert state.ledger.stats("live").unscored == 1
    assert value(m, "kvprefetch_advice_outcomes_total", slot="live", outcome="unscored") == 3 + 1
    assert value(m, "kvprefetch_advice_outcomes_total", slot="live", outcome="hit") == live_hits
    assert value(m, "kvprefetch_predictions_total", slot="shadow") == 2


def test_no_session_request_order_or_instance_id_reaches_the_exposition(
    make_client: Callable[..., TestClient],
) -> None:
    c = make_client()
    state = c.app.state.engine  # type: ignore[attr-defined]
    secret = "zq7secret"
    common = {
        "session_id": f"{secret}-session",
        "request_id": f"{secret}-request",
        "instance_id": f"{secret}-gpu",
    }
    post(
        c,
        [
            stored(f"{secret}-1", "pool", [11, 12]),
            {
                "type": "instance_status",
                "event_id": f"{secret}-2",
                "ts": 1.0,
                "instance_id": common["instance_id"],
                "free_kv_bytes": 10**12,
            },
            {
                "type": "request_routed",
                "event_id": f"{secret}-3",
                "ts": 2.0,
                **common,
                "prompt_tokens": 10,
                "block_hashes": [11, 12],
            },
            {
                "type": "request_finished",
                "event_id": f"{secret}-4",
                "ts": 3.0,
                **common,
                "output_tokens": 5,
            },
        ],
    )
    post(
        c,
        [{"type": "request_routed", "event_id": f"{secret}-5", "ts": 2.0, f"{secret}_field": 1}],
        status=422,
    )
    state.scorer.tick()
    state.scheduler.advise(
        [
            SessionAdvice(
                common["session_id"],
                common["instance_id"],
                (11, 12),
                "lru",
                0.0,
                0.9,
                0.9,
                0.9,
                True,
            )
        ],
        1000.0,
    )
    asyncio.run(state.dispatcher.tick())
    (order,) = state.scheduler.open_orders()
    post(
        c,
        [
            {
                "type": "order_progress",
                "event_id": f"{secret}-6",
                "ts": 4.0,
                "order_id": order.order_id,
                "status": "accepted",
            }
        ],
    )
    text = c.get("/metrics").text
    assert value(scrape(c), "kvprefetch_orders_issued_total", kind="prefetch") == 1
    assert secret not in text and order.order_id not in text


def test_a_new_run_starts_from_an_empty_multiprocess_dir(tmp_path: Path) -> None:
    d = tmp_path / "prom"
    prepare_multiprocess_dir(d)
    (d / "counter_123.db").write_bytes(b"old run")
    (d / "keep.txt").write_text("not ours")
    prepare_multiprocess_dir(d)
    assert sorted(p.name for p in d.iterdir()) == ["keep.txt"]


def test_the_stores_last_probe_is_exported_with_its_age(
    make_client: Callable[..., TestClient],
) -> None:
    c = make_client()
    events = [routed("e1"), routed("e2", "s2")]
    assert c.post("/v1/events", json={"events": events}).status_code == 200
    c.portal.call(c.app.state.engine.store_health.refresh, None)  # type: ignore[union-attr,attr-defined]
    m = scrape(c)
    assert value(m, "kvprefetch_store_up") == 1
    assert value(m, "kvprefetch_store_objects", kind="sessions") == 2
    age = value(m, "kvprefetch_store_stats_age_seconds")
    assert age is not None and age >= 0


def test_signals_are_counted_by_a_bounded_set_of_kinds_and_followed(
    make_client: Callable[..., TestClient],
) -> None:
    c = make_client()
    post(c, [signal(f"c{i}", f"s{i}", 10.0, kind=f"custom-{i}") for i in range(50)])
    post(c, [signal("o", "a", 10.0, kind="opened"), signal("t", "a", 11.0)])
    post(c, [signal("q", "b", 12.0, kind="queued"), signal("dup", "b", 12.0, kind="queued")])
    post(c, [signal("dup", "b", 12.0, kind="queued")])  # a duplicate counts nothing
    post(c, [routed("r1", "a", 30.0), routed("r2", "s0", 40.0), routed("r3", "b", 80.0)])
    samples = scrape(c)
    sent = {dict(k[1])["kind"]: v for k, v in samples.items() if k[0] == "kvprefetch_signals_total"}
    followed = {
        dict(k[1])["kind"]: v
        for k, v in samples.items()
        if k[0] == "kvprefetch_signals_followed_total"
    }
    deployment = [f"custom-{i}" for i in range(8)]
    assert set(sent) == set(followed) == {*SIGNAL_KINDS, *deployment, "other"}
    assert (sent["opened"], sent["typing"], sent["queued"], sent["tool_started"]) == (1, 1, 2, 0)
    assert (sent["custom-0"], sent["other"]) == (1, 42)
    assert (followed["opened"], followed["typing"], followed["custom-0"]) == (1, 1, 1)
    assert followed["queued"] == 0  # its request came 68 s later
    assert sum(followed.values()) == 3


def tool_signal(
    event_id: str, session_id: str, ts: float, kind: str, tool: str | None = None
) -> dict[str, Any]:
    return {**signal(event_id, session_id, ts, kind), "tool": tool}


def test_tool_run_times_by_a_bounded_set_of_tools_and_the_calls_in_flight(
    make_client: Callable[..., TestClient],
) -> None:
    c = make_client(tools_tracked=2, tool_max_run_seconds=100.0)
    first: list[dict[str, Any]] = []
    for i in range(3):  # a: three 2 s runs
        first += [
            tool_signal(f"a{i}", f"a{i}", 10.0 + i, "tool_started", "a"),
            tool_signal(f"a{i}-f", f"a{i}", 12.0 + i, "tool_finished", "a"),
        ]
    first += [
        tool_signal("b0", "b0", 20.0, "tool_started", "b"),
        routed("b0-next", "b0", 60.0),  # no finish: the next request ends it, 40 s
        tool_signal("c0", "c0", 70.0, "tool_started", "c"),  # one call so far: pooled
    ]
    post(c, first)
    m = scrape(c)

    def by_tool(name: str) -> dict[str, float]:
        return {dict(k[1])["tool"]: v for k, v in m.items() if k[0] == name}

    assert by_tool("kvprefetch_tool_seconds_count") == {"a": 3, "b": 1, "other": 0}
    assert value(m, "kvprefetch_tool_seconds_sum", tool="a") == 6.0
    assert value(m, "kvprefetch_tool_seconds_bucket", tool="a", le="2.5") == 3
    assert value(m, "kvprefetch_tool_seconds_bucket", tool="b", le="30.0") == 0
    assert value(m, "kvprefetch_tool_seconds_bucket", tool="b", le="60.0") == 1
    assert by_tool("kvprefetch_tools_in_flight") == {"a": 0, "b": 0, "other": 1}
    assert value(m, "kvprefetch_tool_runs_expired_total") == 0

    # c's second call makes it 1.5 times as frequent as b: c takes b's place, b's series go.
    post(
        c,
        [
            tool_signal("c1", "c1", 80.0, "tool_started", "c"),
            tool_signal("c0-f", "c0", 85.0, "tool_finished", "c"),
        ],
    )
    m = scrape(c)
    assert by_tool("kvprefetch_tool_seconds_count") == {"a": 3, "c": 1, "other": 0}
    assert by_tool("kvprefetch_tools_in_flight") == {"a": 0, "c": 1, "other": 0}

    # c1 is never seen back: 100 s of event time later it expires.
    post(c, [routed("late", "x", 200.0)])
    m = scrape(c)
    assert value(m, "kvprefetch_tool_runs_expired_total") == 1
    assert by_tool("kvprefetch_tools_in_flight") == {"a": 0, "c": 0, "other": 0}
