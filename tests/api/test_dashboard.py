"""The dashboard's page and JSON: GET /dashboard, /static, /v1/dashboard/series and
/v1/dashboard/now.

The loops are off (interval 0) and the clock is manual: each test drives scoring, planning and
sampling one tick at a time.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from app.api.main import create_app
from app.core.clock import ManualClock
from app.core.config import Settings
from app.observe.timeline import HISTORY_SECONDS
from tests.api.conftest import settle

REPO = Path(__file__).resolve().parents[2]
BLOCK_BYTES = 512 * 327_680
GAP = 10.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(10_000.0)


def _quiet(settings: Settings, **kw: Any) -> Settings:
    update: dict[str, Any] = {
        "score_interval_seconds": 0.0,
        "plan_interval_seconds": 0.0,
        "dashboard_sample_seconds": 0.0,
    }
    update.update(kw)
    return settings.model_copy(update=update)


@pytest.fixture
def client(settings: Settings, clock: ManualClock, tmp_path: Path) -> Iterator[TestClient]:
    # The heuristic serves: it prefetches for sessions with a steady rhythm.
    with TestClient(
        create_app(_quiet(settings, model_dir=tmp_path / "no-model"), clock=clock)
    ) as c:
        yield c


@pytest.fixture
def client_showing_ids(
    settings: Settings, clock: ManualClock, tmp_path: Path
) -> Iterator[TestClient]:
    """As `client`, with the operator's opt-in to session ids on the dashboard."""
    quiet = _quiet(settings, model_dir=tmp_path / "no-model", dashboard_show_session_ids=True)
    with TestClient(create_app(quiet, clock=clock)) as c:
        yield c


def post(client: TestClient, events: list[dict[str, Any]]) -> None:
    r = client.post("/v1/events", json={"events": events})
    assert r.status_code == 200, r.text
    settle(client)


def turns(
    session: str, instance: str, blocks: list[str], last_ts: float, n: int = 4
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for k in range(n):
        ts = last_ts - (n - 1 - k) * GAP
        common = {"session_id": session, "request_id": f"{session}-r{k}", "instance_id": instance}
        out.append(
            {
                "type": "request_routed",
                "event_id": f"{session}-q{k}",
                "ts": ts,
                **common,
                "prompt_tokens": len(blocks) * 512,
                "block_hashes": blocks,
            }
        )
        out.append(
            {
                "type": "request_finished",
                "event_id": f"{session}-f{k}",
                "ts": ts + 1.0,
                **common,
                "output_tokens": 100,
                "context_tokens": len(blocks) * 512,
                "block_hashes": blocks,
            }
        )
    return out


def cluster(now: float, sessions: int = 4, blocks: int = 4) -> list[dict[str, Any]]:
    """Two instances with room, `sessions` sessions with a steady rhythm, their contexts in the
    pool."""
    events: list[dict[str, Any]] = [
        {
            "type": "instance_status",
            "event_id": f"st-{g}",
            "ts": now - 1.0,
            "instance_id": f"gpu-{g}",
            "free_kv_bytes": 10**12,
            "total_kv_bytes": 2 * 10**12,
            "queue_depth": g,
        }
        for g in range(2)
    ]
    for i in range(sessions):
        hashes = [
            f"c{i}-b{j}" for j in range(blocks + i)
        ]  # sizes differ: the order by chance is by id
        events += turns(f"chat-{i}", f"gpu-{i % 2}", hashes, now - 2.0)
        events.append(
            {
                "type": "kv_blocks_stored",
                "event_id": f"pool-{i}",
                "ts": now - 1.0,
                "tier": "pool",
                "block_hashes": hashes,
            }
        )
    return events


def tick(client: TestClient) -> None:
    state = client.app.state.engine  # type: ignore[attr-defined]
    state.scorer.tick()
    asyncio.run(state.dispatcher.tick())


def sample(client: TestClient) -> None:
    client.app.state.engine.timeline.sample()  # type: ignore[attr-defined]


# -- an empty service --------------------------------------------------------------------------


def test_an_empty_service_answers_empty_series_and_zeros(client: TestClient) -> None:
    r = client.get("/v1/dashboard/series")
    assert r.status_code == 200
    body = r.json()
    assert (body["count"], body["ts"], body["since_seconds"], body["interval_seconds"]) == (
        0,
        [],
        600.0,
        0.0,
    )
    assert body["series"] and all(col == [] for col in body["series"].values())
    now = client.get("/v1/dashboard/now").json()
    assert now["samples"] == 0
    assert now["models"]["live"]["hits"] == 0 and now["models"]["live"]["hit_rate"] is None
    assert now["models"]["shadow"] is None
    assert now["scheduler"]["open_orders"] == 0 and now["scheduler"]["bytes_wasted"] == 0
    assert now["prefetch"] == {"landed": 0, "landed_bytes": 0, "transfer_seconds": 0.0}
    assert now["stall"]["seconds_saved"] == 0.0 and now["stall"]["cost_saved"] == 0.0
    assert (now["instances"], now["instances_total"], now["top_sessions"]) == ([], 0, [])
    assert now["signals"] == {
        "window_seconds": 60.0,
        "total": 0,
        "followed": 0,
        "followed_share": None,
        "kinds": [],
    }
    assert now["retrain"]["state"] == "off" and now["retrain"]["last"] is None
    # Samples of nothing are zeros, not errors.
    sample(client)
    body = client.get("/v1/dashboard/series").json()
    assert body["count"] == 1
    assert body["series"]["bytes_wasted"] == [0] and body["series"]["live_hit_rate"] == [None]
    assert body["series"]["shadow_hits"] == [None]


# -- bad query parameters ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/dashboard/series", "since_seconds", "0"),
        ("/v1/dashboard/series", "since_seconds", "-5"),
        ("/v1/dashboard/series", "since_seconds", str(int(HISTORY_SECONDS) + 1)),
        ("/v1/dashboard/series", "since_seconds", "ten"),
        ("/v1/dashboard/series", "since_seconds", "nan"),
        ("/v1/dashboard/series", "since_seconds", "inf"),
        ("/v1/dashboard/series", "since_seconds", ""),
        ("/v1/dashboard/now", "limit", "0"),
        ("/v1/dashboard/now", "limit", "1001"),
        ("/v1/dashboard/now", "limit", "2.5"),
        ("/v1/dashboard/now", "instances", "0"),
        ("/v1/dashboard/now", "instances", "many"),
    ],
)
def test_a_bad_query_parameter_is_named(
    client: TestClient, path: str, field: str, value: str
) -> None:
    r = client.get(path, params={field: value})
    assert r.status_code == 422
    body = r.json()
    assert set(body) == {"detail", "field"}
    assert body["field"] == field
    assert body["detail"].startswith(f"the query parameter {field} must be ")
    assert repr(value) in body["detail"]


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/v1/dashboard/series", {"since_seconds": "0.5"}),
        ("/v1/dashboard/series", {"since_seconds": str(int(HISTORY_SECONDS))}),
        ("/v1/dashboard/now", {"limit": "1", "instances": "1"}),
        ("/v1/dashboard/now", {"limit": "1000", "instances": "1000"}),
    ],
)
def test_the_bounds_themselves_are_accepted(
    client: TestClient, path: str, params: dict[str, str]
) -> None:
    assert client.get(path, params=params).status_code == 200


def test_the_endpoints_are_described_with_their_errors(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/v1/dashboard/series", "/v1/dashboard/now"):
        assert "422" in paths[path]["get"]["responses"]
    assert "/dashboard" not in paths


# -- what the service did, in the series and now -----------------------------------------------


def _land(client: TestClient, clock: ManualClock, instance: str) -> list[dict[str, Any]]:
    """An agent leases the instance's prefetches and lands them."""
    orders = [
        o
        for o in client.get("/v1/orders", params={"instance_id": instance}).json()["orders"]
        if o["kind"] == "prefetch"
    ]
    t = clock.now()
    events: list[dict[str, Any]] = []
    for o in orders:
        events += [
            {
                "type": "order_progress",
                "event_id": f"{o['order_id']}-a",
                "ts": t,
                "order_id": o["order_id"],
                "status": "accepted",
            },
            {
                "type": "order_progress",
                "event_id": f"{o['order_id']}-c",
                "ts": t + 0.5,
                "order_id": o["order_id"],
                "status": "completed",
                "bytes": o["size_bytes"],
                "seconds": 0.5,
            },
            {
                "type": "kv_blocks_stored",
                "event_id": f"{o['order_id']}-hbm",
                "ts": t + 0.5,
                "tier": "hbm",
                "instance_id": instance,
                "block_hashes": o["block_hashes"],
            },
        ]
    post(client, events)
    return orders


def test_the_series_follows_what_the_service_did(client: TestClient, clock: ManualClock) -> None:
    sample(client)
    post(client, cluster(clock.now()))
    tick(client)
    clock.advance(1.0)
    sample(client)
    first = client.get("/v1/dashboard/now").json()
    assert first["scheduler"]["open_orders"] == 4  # one prefetch per session, to its own instance
    inflight = first["scheduler"]["inflight_bytes"]
    assert inflight == sum(4 + i for i in range(4)) * BLOCK_BYTES

    orders = _land(client, clock, "gpu-0")
    assert sorted(s for o in orders for s in o["session_ids"]) == ["chat-0", "chat-2"]
    clock.advance(1.0)
    # chat-0 comes back to gpu-0, where its context landed: a hit, measured on arrival too.
    post(
        client,
        [
            {
                "type": "request_routed",
                "event_id": "back",
                "ts": clock.now(),
                "session_id": "chat-0",
                "request_id": "chat-0-r9",
                "instance_id": "gpu-0",
                "prompt_tokens": 2048,
                "block_hashes": [f"c0-b{j}" for j in range(4)],
            }
        ],
    )
    clock.advance(1.0)
    sample(client)

    body = client.get("/v1/dashboard/series").json()
    s = body["series"]
    assert body["count"] == 3 and body["ts"] == [10_000.0, 10_001.0, 10_003.0]
    assert all(len(col) == 3 for col in s.values())
    assert s["orders_prefetch"] == [0, 4, 4]
    assert s["inflight_bytes"] == [0, inflight, inflight - sum(o["size_bytes"] for o in orders)]
    assert s["landed_prefetches"] == [0, 0, 2]
    assert s["landed_bytes"][-1] == sum(o["size_bytes"] for o in orders)
    assert s["transfer_seconds"][-1] == pytest.approx(1.0)
    assert s["live_hits"] == [0, 0, 1] and s["live_misses"] == [0, 0, 0]
    assert s["live_hit_rate"] == [None, None, 1.0] and s["live_recent_hit_rate"] == [
        None,
        None,
        1.0,
    ]
    assert s["live_version"] == [None, None, None]  # the heuristic has no version
    assert s["shadow_hit_rate"] == [None, None, None]
    # The stall: measured on chat-0's arrival (its 4 blocks resident: their pool load,
    # 4 x 13.4 ms)...
    assert body["stall_basis"] == "measured"
    assert s["stall_seconds_saved"][-1] == pytest.approx(4 * BLOCK_BYTES / 12.5e9)
    assert s["stall_cost_saved"][-1] == pytest.approx(s["stall_seconds_saved"][-1] * 2.5 / 3600)
    # ... and what the scheduler expected of the landed prefetches: P(back in time) x the stall.
    expected = sum(o["priority"] for o in orders)
    assert expected > 0 and s["expected_stall_seconds"][-1] == pytest.approx(expected)

    now = client.get("/v1/dashboard/now").json()
    assert now["samples"] == 3
    assert now["stall"]["expected_seconds_saved"] == pytest.approx(expected)
    assert now["stall"]["seconds_saved"] == pytest.approx(s["stall_seconds_saved"][-1])
    assert now["models"]["live"]["hits"] == 1 and now["models"]["live"]["hit_rate"] == 1.0
    assert now["prefetch"]["landed"] == 2


def test_now_lists_the_sessions_likely_back_next_and_each_instance_queue(
    client_showing_ids: TestClient, clock: ManualClock
) -> None:
    client = client_showing_ids
    post(client, cluster(clock.now()))
    tick(client)
    now = client.get("/v1/dashboard/now", params={"limit": 2}).json()
    top = now["top_sessions"]
    assert [t["session_id"] for t in top] == ["chat-0", "chat-1"]  # equal chances: by id
    assert top[0]["p_soon"] >= top[1]["p_soon"]
    assert top[0]["instance_id"] == "gpu-0" and top[0]["prefetch"] is True
    assert top[0]["context_bytes"] == 4 * BLOCK_BYTES and top[1]["context_bytes"] == 5 * BLOCK_BYTES
    assert top[0]["advised_seconds_ago"] == 0.0
    assert len(client.get("/v1/dashboard/now").json()["top_sessions"]) == 4

    by_id = {r["instance_id"]: r for r in now["instances"]}
    assert now["instances_total"] == 2
    # gpu-1: chat-1 (5 blocks) and chat-3 (7); gpu-0: chat-0 (4) and chat-2 (6). Most bytes first.
    assert [r["instance_id"] for r in now["instances"]] == ["gpu-1", "gpu-0"]
    assert by_id["gpu-1"]["open_orders"] == {"prefetch": 2, "pin": 0, "demote": 0}
    assert by_id["gpu-1"]["inflight_bytes"] == 12 * BLOCK_BYTES
    # From the pool at the prefetch share of its link: 12.5 GB/s x 0.5.
    assert by_id["gpu-1"]["link_backlog_seconds"] == pytest.approx(12 * BLOCK_BYTES / 6.25e9)
    assert (by_id["gpu-0"]["free_kv_bytes"], by_id["gpu-0"]["queue_depth"]) == (10**12, 0)
    one = client.get("/v1/dashboard/now", params={"instances": 1}).json()
    assert [r["instance_id"] for r in one["instances"]] == ["gpu-1"] and one["instances_total"] == 2


def test_since_seconds_keeps_the_recent_samples(client: TestClient, clock: ManualClock) -> None:
    for _ in range(10):
        sample(client)
        clock.advance(10.0)
    # Samples at 10,000 ... 10,090; now is 10,100.
    body = client.get("/v1/dashboard/series", params={"since_seconds": 30}).json()
    assert body["ts"] == [10_070.0, 10_080.0, 10_090.0]
    assert body["now"] == 10_100.0 and body["since_seconds"] == 30.0
    assert client.get("/v1/dashboard/series").json()["count"] == 10


def test_a_shadow_model_is_drawn_beside_the_serving_one(
    settings: Settings, clock: ManualClock, tmp_path: Path
) -> None:
    quiet = _quiet(
        settings, model_dir=tmp_path / "no-model", shadow_model_dir=REPO / "models" / "default"
    )
    with TestClient(create_app(quiet, clock=clock)) as client:
        post(client, cluster(clock.now(), sessions=2))
        tick(client)
        clock.advance(1.0)
        post(
            client,
            [
                {
                    "type": "request_routed",
                    "event_id": "back",
                    "ts": clock.now(),
                    "session_id": "chat-1",
                    "request_id": "chat-1-r9",
                    "instance_id": "gpu-1",
                    "prompt_tokens": 2048,
                }
            ],
        )
        sample(client)
        s = client.get("/v1/dashboard/series").json()["series"]
        now = client.get("/v1/dashboard/now").json()
    assert s["shadow_version"] == ["default"]
    assert s["shadow_predictions"] == [2] and s["shadow_hits"][0] + s["shadow_misses"][0] == 1
    assert now["models"]["shadow"]["predictor"] == "learned (default)"
    assert now["models"]["shadow"]["predictions"] == 2


# -- the page ----------------------------------------------------------------------------------


def test_the_page_and_its_files_are_served_by_the_service_itself(client: TestClient) -> None:
    r = client.get("/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    refs = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert "/static/dashboard.js" in refs and "/static/vendor/uplot/uPlot.iife.min.js" in refs
    # No CDN: every script, style sheet and icon comes from this service.
    assert all(ref.startswith(("/", "data:")) for ref in refs), refs
    for ref in (x for x in refs if x.startswith("/static/")):
        assert client.get(ref).status_code == 200, ref
    js = client.get("/static/dashboard.js").text
    assert "/v1/dashboard/now" in js and "/v1/dashboard/series" in js
    assert not re.search(r"https?://", js)
    assert client.get("/static/vendor/uplot/LICENSE").text.startswith("The MIT License")
    assert client.get("/static/no-such-file.js").status_code == 404


def test_the_sampler_runs_in_the_lifespan_when_configured(settings: Settings) -> None:
    fast = settings.model_copy(
        update={
            "score_interval_seconds": 0.0,
            "plan_interval_seconds": 0.0,
            "dashboard_sample_seconds": 0.02,
        }
    )
    with TestClient(create_app(fast)) as client:
        deadline = time.monotonic() + 5.0
        while client.get("/v1/dashboard/now").json()["samples"] < 3:
            assert time.monotonic() < deadline, "the sampler did not sample"
            time.sleep(0.02)
        assert client.get("/v1/dashboard/series").json()["interval_seconds"] == 0.02
        task = client.app.state.engine.sampling_task  # type: ignore[attr-defined]
    assert task.cancelled() or task.done()


def test_sampling_off_starts_no_task(client: TestClient) -> None:
    assert client.app.state.engine.sampling_task is None  # type: ignore[attr-defined]


def test_session_ids_are_hidden_unless_the_operator_opts_in(
    client: TestClient, clock: ManualClock
) -> None:
    post(client, cluster(clock.now()))
    tick(client)
    top = client.get("/v1/dashboard/now").json()["top_sessions"]
    assert len(top) == 4 and [t["session_id"] for t in top] == [None] * 4
    assert {t["instance_id"] for t in top} == {"gpu-0", "gpu-1"}  # the rest of each row stays
    assert "chat-" not in client.get("/v1/dashboard/now").text


def test_session_ids_are_shown_to_a_caller_with_a_valid_token(
    settings: Settings, clock: ManualClock, tmp_path: Path
) -> None:
    # Tokens on, observability open (the default): the data answers anyone, ids only with a token.
    quiet = _quiet(
        settings,
        model_dir=tmp_path / "no-model",
        ingest_token=SecretStr("i" * 32),
        admin_token=SecretStr("a" * 32),
    )
    with TestClient(create_app(quiet, clock=clock)) as c:
        r = c.post(
            "/v1/events",
            json={"events": cluster(clock.now())},
            headers={"authorization": "Bearer " + "i" * 32},
        )
        assert r.status_code == 200, r.text
        settle(c)
        tick(c)
        anonymous = c.get("/v1/dashboard/now").json()["top_sessions"]
        forged = c.get("/v1/dashboard/now", headers={"authorization": "Bearer " + "x" * 32}).json()
        shown = c.get("/v1/dashboard/now", headers={"authorization": "Bearer " + "a" * 32}).json()
    assert [t["session_id"] for t in anonymous] == [None] * 4
    assert [t["session_id"] for t in forged["top_sessions"]] == [None] * 4
    assert sorted(t["session_id"] for t in shown["top_sessions"]) == [f"chat-{i}" for i in range(4)]


def test_now_says_how_old_the_stores_counts_are(client: TestClient) -> None:
    store = client.get("/v1/dashboard/now").json()["store"]
    assert store["ok"] is True and set(store["stats"]) >= {"sessions", "instances"}
    assert store["stats_age_seconds"] >= 0


def test_now_counts_signals_by_kind_and_their_followed_share(client: TestClient) -> None:
    def signal(event_id: str, session_id: str, ts: float, kind: str) -> dict[str, Any]:
        return {
            "type": "session_signal",
            "event_id": event_id,
            "ts": ts,
            "session_id": session_id,
            "kind": kind,
        }

    def routed(event_id: str, session_id: str, ts: float) -> dict[str, Any]:
        return {
            "type": "request_routed",
            "event_id": event_id,
            "ts": ts,
            "session_id": session_id,
            "request_id": event_id,
            "instance_id": "gpu-0",
            "prompt_tokens": 100,
        }

    post(
        client,
        [
            signal("g1", "a", 100.0, "typing"),
            signal("g2", "b", 100.0, "typing"),
            signal("g3", "c", 100.0, "opened"),
            signal("g4", "d", 100.0, "voice.start"),
        ],
    )
    post(client, [routed("r1", "a", 104.0), routed("r2", "d", 150.0), routed("r3", "c", 170.0)])
    signals = client.get("/v1/dashboard/now").json()["signals"]
    assert (signals["total"], signals["followed"], signals["followed_share"]) == (4, 2, 0.5)
    assert signals["kinds"] == [
        {"kind": "opened", "signals": 1, "followed": 0, "followed_share": 0.0},
        {"kind": "typing", "signals": 2, "followed": 1, "followed_share": 0.5},
        {"kind": "voice.start", "signals": 1, "followed": 1, "followed_share": 1.0},
    ]
