"""The dashboard in a real browser: Debian's Chromium driven by Playwright, against a real server.

The page loads without console errors on an empty service; after sessions, instance reports and
blocks are posted (the scoring, planning and sampling loops run on real time, at short
intervals), an agent's progress and a returning request, the charts, tiles and tables show
them. A screenshot is kept at var/artifacts/dashboard.png.

The browser is /usr/bin/chromium (Debian's `chromium` package; `make test` and .ci/run install it
when missing). A missing browser fails this test, never skips it. `playwright install` is never
run: Playwright drives the system browser through `executable_path`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.api.main import create_app
from app.core.config import Settings
from tests.conftest import REPO, live_server

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
]
SCREENSHOT = REPO / "var" / "artifacts" / "dashboard.png"
GAP = 10.0  # seconds between a session's turns: the heuristic expects each back within 30 s
BLOCK_BYTES = 512 * 327_680


def _browser(playwright: Any) -> Any:
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: install Debian's chromium package "
            "(apt-get install -y chromium; "
            "`make test` and .ci/run do this when they can)",
            pytrace=False,
        )
    return playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)


def _turns(
    session: str, instance: str, blocks: list[str], last_ts: float, n: int = 4
) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for k in range(n):
        ts = last_ts - (n - 1 - k) * GAP
        common = {"session_id": session, "request_id": f"{session}-r{k}", "instance_id": instance}
        events.append(
            {
                "type": "request_routed",
                "event_id": f"{session}-q{k}",
                "ts": ts,
                **common,
                "prompt_tokens": len(blocks) * 512,
                "block_hashes": blocks,
            }
        )
        events.append(
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
    return events


def _post(http: httpx.Client, events: list[dict[str, Any]]) -> None:
    r = http.post("/v1/events", json={"events": events})
    assert r.status_code == 200, r.text


def _wait_for(what: str, check: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_the_dashboard_shows_what_the_service_is_doing(tmp_path: Path) -> None:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(
            "the browser test needs the playwright package: pip install -e '.[test]'", pytrace=False
        )
    # The heuristic serves (it prefetches for sessions with a steady rhythm), the bundled learned
    # model shadows it: both hit rates are drawn.
    settings = Settings(
        data_dir=tmp_path / "data",
        log_fsync=False,
        model_dir=tmp_path / "no-model",
        shadow_model_dir=REPO / "models" / "default",
        score_interval_seconds=0.2,
        plan_interval_seconds=0.1,
        dashboard_sample_seconds=0.25,
    )
    console: list[str] = []
    with (
        live_server(create_app(settings)) as url,
        httpx.Client(base_url=url, timeout=10.0) as http,
        sync_playwright() as pw,
    ):
        browser = _browser(pw)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1500})
            # The browser's clock a day behind the service's: the page must show the service's.
            page.clock.set_fixed_time(time.time() - 86_400.0)
            page.on(
                "console",
                lambda m: (
                    console.append(f"console.{m.type}: {m.text}") if m.type == "error" else None
                ),
            )
            page.on("pageerror", lambda e: console.append(f"page error: {e}"))
            page.on(
                "requestfailed", lambda r: console.append(f"request failed: {r.url} {r.failure}")
            )

            # An empty service: an empty dashboard, no error.
            page.goto(f"{url}/dashboard")
            page.wait_for_selector("body[data-polls]", timeout=10_000)
            assert page.locator("#instances").get_attribute("data-rows") == "0"
            assert page.locator("#sessions").get_attribute("data-rows") == "0"
            assert page.locator("#signals").get_attribute("data-rows") == "0"
            assert "cannot update" not in page.locator("#status").inner_text()
            assert page.locator("#live-model").inner_text() == "heuristic"
            assert page.locator("#shadow-model").inner_text() == "learned (default)"
            # The shadow panel: the two models side by side, from the first poll.
            assert page.locator("#shadow-panel").get_attribute("data-shadow") == "default"
            assert page.locator("#comparison").get_attribute("data-rows") == "5"
            assert "Brier" in page.locator("#comparison tbody").inner_text()
            assert console == [], console

            # Two instances with room, six sessions with a steady rhythm, their contexts in the
            # pool.
            now = time.time()
            events: list[dict[str, Any]] = []
            for g in range(2):
                events.append(
                    {
                        "type": "instance_status",
                        "event_id": f"st-{g}",
                        "ts": now - 1.0,
                        "instance_id": f"gpu-{g}",
                        "free_kv_bytes": 10**12,
                        "total_kv_bytes": 2 * 10**12,
                        "queue_depth": g,
                    }
                )
            for i in range(6):
                blocks = [f"chat{i}-b{j}" for j in range(8)]
                events += _turns(f"chat-{i}", f"gpu-{i % 2}", blocks, now - 2.0)
                events.append(
                    {
                        "type": "kv_blocks_stored",
                        "event_id": f"pool-{i}",
                        "ts": now - 1.0,
                        "tier": "pool",
                        "block_hashes": blocks,
                    }
                )
            _post(http, events)

            # The loops advise and order prefetches; an agent leases gpu-0's and lands them.
            def leased() -> list[dict[str, Any]]:
                r = http.get("/v1/orders", params={"instance_id": "gpu-0"})
                return [o for o in r.json()["orders"] if o["kind"] == "prefetch"]

            orders = _wait_for("prefetch orders for gpu-0", leased)
            t = time.time()
            progress = []
            for o in orders:
                progress += [
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
                        "ts": t + 0.01,
                        "order_id": o["order_id"],
                        "status": "completed",
                        "bytes": o["size_bytes"],
                        "seconds": 0.2,
                    },
                    {
                        "type": "kv_blocks_stored",
                        "event_id": f"{o['order_id']}-hbm",
                        "ts": t + 0.01,
                        "tier": "hbm",
                        "instance_id": "gpu-0",
                        "block_hashes": o["block_hashes"],
                    },
                ]
            _post(http, progress)
            # chat-0 comes back where its context landed (a hit for the serving model), after
            # its front end said the user was typing; chat-1's user opened it and left.
            _post(
                http,
                [
                    {
                        "type": "session_signal",
                        "event_id": "chat-0-typing",
                        "ts": time.time() - 0.5,
                        "session_id": "chat-0",
                        "kind": "typing",
                    },
                    {
                        "type": "session_signal",
                        "event_id": "chat-1-opened",
                        "ts": time.time() - 0.5,
                        "session_id": "chat-1",
                        "kind": "opened",
                    },
                    {
                        "type": "request_routed",
                        "event_id": "chat-0-back",
                        "ts": time.time(),
                        "session_id": "chat-0",
                        "request_id": "chat-0-r9",
                        "instance_id": "gpu-0",
                        "prompt_tokens": 8 * 512,
                        "block_hashes": [f"chat0-b{j}" for j in range(8)],
                    },
                ],
            )
            now_body = _wait_for(
                "the return to be scored",
                lambda: (b := http.get("/v1/dashboard/now").json())["models"]["live"]["hits"] and b,
            )
            assert now_body["prefetch"]["landed"] == len(orders)

            # The page catches up within a poll or two: tiles, tables and charts show it.
            page.wait_for_function(
                "() => document.querySelector('#tile-live-hit-rate .value')"
                """.textContent.endsWith('%')
                    && Number(document.querySelector('#chart-hit-rate').dataset.values) > 0
                    && Number(document.querySelector('#chart-bytes').dataset.values) > 0
                    && Number(document.querySelector('#instances').dataset.rows) >= 2
                    && Number(document.querySelector('#sessions').dataset.rows) >= 1
                    && Number(document.querySelector('#signals').dataset.rows) === 2
                    && !document.querySelector('#tile-prefetched .value')"""
                ".textContent.startsWith('0 B')",
                timeout=10_000,
            )
            assert int(page.locator("#chart-queue").get_attribute("data-points") or 0) > 0
            assert int(page.locator("#chart-stall").get_attribute("data-values") or 0) > 0
            assert page.locator('#instances tr[data-instance="gpu-0"]').count() == 1
            typing = page.locator('#signals tr[data-kind="typing"]').inner_text()
            assert typing.split() == ["typing", "1", "1", "100.0%"]
            assert page.locator("#tile-signals .value").inner_text() == "50.0%"
            assert page.locator("#tile-live-hit-rate .value").inner_text() == "100.0%"
            # Retraining is off by default, and the tile says how to turn it on.
            assert page.locator("#tile-retrain .value").inner_text() == "off"
            assert "KVP_RETRAIN_EVERY_SECONDS" in page.locator("#tile-retrain .sub").inner_text()
            landed = sum(o["size_bytes"] for o in orders)
            assert (
                page.locator("#tile-prefetched .sub")
                .inner_text()
                .startswith(f"{len(orders)} orders landed")
            )
            assert landed % BLOCK_BYTES == 0
            # Session ids are hidden unless the operator opts in (KVP_DASHBOARD_SHOW_SESSION_IDS):
            # the rows are drawn, their ids not.
            sessions = page.locator("#sessions tbody").inner_text()
            assert "hidden" in sessions and "chat-" not in sessions
            # The shadow panel compares the models the service scored; its list of sessions the
            # two advised differently is the service's, drawn row for row (ids hidden too).
            before = http.get("/v1/dashboard/now").json()
            page.wait_for_function(
                f"() => Number(document.querySelector('#service-clock').dataset.ts) >= "
                f"{before['now']}",
                timeout=10_000,
            )
            after = http.get("/v1/dashboard/now").json()
            compared = after["models"]["comparison"]
            assert compared is not None and compared["paired"] > 0
            drawn = page.locator("#comparison tbody").inner_text()
            assert "bytes kept (advice)" in drawn and "hit rate" in drawn
            hint = page.locator("#disagreements-hint").inner_text()
            assert "paired advice records differ" in hint
            rows = int(page.locator("#disagreements").get_attribute("data-rows") or 0)
            assert rows <= 20  # the page asks for limit=20: a bounded list
            assert page.locator("#disagreements tbody tr:not(.empty)").count() == rows
            assert "chat-" not in page.locator("#disagreements tbody").inner_text()
            # One clock: the service's now (from /v1/dashboard/now), not the browser's.
            shown = float(page.locator("#service-clock").get_attribute("data-ts") or "nan")
            assert before["now"] <= shown <= after["now"]
            assert "cannot update" not in page.locator("#status").inner_text()

            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
            print(f"dashboard screenshot: {SCREENSHOT}")
        finally:
            browser.close()
    assert console == [], console


def test_the_retraining_tile_shows_the_candidate_and_the_last_verdict(tmp_path: Path) -> None:
    """The tile's other states, drawn from the service's own answer with `retrain` replaced as
    GET /v1/model/retrain gives it while a candidate shadows, and after a verdict."""
    from playwright.sync_api import Route, sync_playwright

    settings = Settings(
        data_dir=tmp_path / "data",
        log_fsync=False,
        model_dir=tmp_path / "no-model",
        retrain_every_seconds=3600.0,
        dashboard_sample_seconds=0.25,
    )
    runs = {"promoted": 1, "discarded": 2, "failed": 0, "skipped": 3}
    judge = {
        "judged": 214,
        "live_brier": 0.0612,
        "shadow_brier": 0.0571,
        "mean_gain": 0.0041,
        "gain_se": 0.0013,
        "dropped": 0,
        "pending": 388,
    }
    shadowing = {
        "state": "shadowing",
        "runs": runs,
        "candidate": {
            "version": "retrain-x-1",
            "shadow_since_ts": 1.0,
            "judge": judge,
            "min_judged": 500,
        },
    }
    waiting = {
        "state": "waiting",
        "runs": runs,
        "candidate": None,
        "last": {
            "outcome": "discarded",
            "reason": "Brier 0.06410 (candidate) against 0.06120 (serving)",
            "ts": 2.0,
            "version": "retrain-x-1",
            "judged": 731,
            "live_brier": 0.0612,
            "shadow_brier": 0.0641,
        },
    }
    answer: dict[str, Any] = {"retrain": shadowing}
    console: list[str] = []
    with live_server(create_app(settings)) as url, sync_playwright() as pw:

        def patched(route: Route) -> None:
            response = route.fetch()
            body = response.json()
            assert body["retrain"]["enabled"] and body["retrain"]["state"] == "waiting"
            body["retrain"] = {**body["retrain"], **answer["retrain"]}
            route.fulfill(response=response, json=body)

        browser = _browser(pw)
        try:
            page = browser.new_page()
            page.on("pageerror", lambda e: console.append(f"page error: {e}"))
            page.route("**/v1/dashboard/now*", patched)
            page.goto(f"{url}/dashboard")
            page.wait_for_function(
                "() => document.querySelector('#tile-retrain').dataset.state === 'shadowing'",
                timeout=10_000,
            )
            assert page.locator("#tile-retrain .value").inner_text() == "shadowing"
            sub = page.locator("#tile-retrain .sub").inner_text()
            assert sub == "retrain-x-1: Brier 0.0571 vs serving 0.0612, 214 of 500 judged"
            assert "1 promoted, 2 discarded" in (
                page.locator("#tile-retrain").get_attribute("title") or ""
            )
            answer["retrain"] = waiting
            page.wait_for_function(
                "() => document.querySelector('#tile-retrain').dataset.outcome === 'discarded'",
                timeout=10_000,
            )
            assert page.locator("#tile-retrain .value").inner_text() == "waiting"
            sub = page.locator("#tile-retrain .sub").inner_text()
            assert sub.startswith("last run discarded: Brier 0.06410 (candidate)")
        finally:
            browser.close()
    assert console == [], console


def _tool(event_id: str, session: str, ts: float, kind: str, tool: str) -> dict[str, Any]:
    return {
        "type": "session_signal",
        "event_id": event_id,
        "ts": ts,
        "session_id": session,
        "kind": kind,
        "tool": tool,
    }


def test_the_tools_table_shows_the_agents_tool_calls(tmp_path: Path) -> None:
    """An agent's tool signals posted to a real service: the Tools table shows each tool's calls,
    p50 and p90, its calls in flight, and its latest return against the one predicted."""
    from playwright.sync_api import sync_playwright

    settings = Settings(
        data_dir=tmp_path / "data",
        log_fsync=False,
        model_dir=tmp_path / "no-model",
        dashboard_sample_seconds=0.25,
    )
    console: list[str] = []
    with (
        live_server(create_app(settings)) as url,
        httpx.Client(base_url=url, timeout=10.0) as http,
        sync_playwright() as pw,
    ):
        browser = _browser(pw)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1500})
            page.on(
                "console",
                lambda m: (
                    console.append(f"console.{m.type}: {m.text}") if m.type == "error" else None
                ),
            )
            page.on("pageerror", lambda e: console.append(f"page error: {e}"))
            page.goto(f"{url}/dashboard")
            page.wait_for_selector("body[data-polls]", timeout=10_000)
            assert page.locator("#tools").get_attribute("data-rows") == "0"
            assert page.locator("#tools tbody").inner_text() == "no tool call yet"

            # bash: four 5 s runs and one call in flight; web.search: one 30 s run.
            now = time.time()
            events: list[dict[str, Any]] = []
            for i in range(4):
                t = now - 100.0 + 10 * i
                events += [
                    _tool(f"b{i}", f"run-{i}", t, "tool_started", "bash"),
                    _tool(f"b{i}-f", f"run-{i}", t + 5.0, "tool_finished", "bash"),
                ]
            events += [
                _tool("s0", "run-9", now - 60.0, "tool_started", "web.search"),
                _tool("s0-f", "run-9", now - 30.0, "tool_finished", "web.search"),
                _tool("b9", "run-9", now - 1.0, "tool_started", "bash"),
            ]
            _post(http, events)
            page.wait_for_function(
                "() => Number(document.querySelector('#tools').dataset.rows) === 2",
                timeout=10_000,
            )
            bash = page.locator('#tools tr[data-tool="bash"] td').all_inner_texts()
            assert bash[:4] == ["bash", "4", "5.00 s", "5.00 s"], bash
            assert bash[4].startswith("1; "), bash  # and when it is predicted back
            # The first run had nothing to be predicted from; the latest was predicted exactly.
            assert bash[5] == "took 5.00 s, predicted 5.00 s (median error 0.00 s)", bash
            search = page.locator('#tools tr[data-tool="web.search"] td').all_inner_texts()
            assert search == [
                "web.search",
                "1",
                "30.0 s",
                "30.0 s",
                "0",
                "took 30.0 s, nothing to predict from",
            ], search
            hint = page.locator("#tools-hint").inner_text()
            assert hint == "(the 32 most frequent, the rest as other; 0 calls never seen back)"
            assert "cannot update" not in page.locator("#status").inner_text()
        finally:
            browser.close()
    assert console == [], console
