// The kvprefetch dashboard: polls /v1/dashboard/now, /v1/dashboard/series and /v1/tools, draws with uPlot
// (vendored under /static/vendor/uplot). Each chart container carries data-points (samples
// drawn) and data-values (non-null values drawn) and each table data-rows, for tests and scripts.
"use strict";

(function () {
  const POLL_MS = 2000;
  const LIVE = "#1f6feb";
  const SHADOW = "#d9730d";
  const GB = 1e9;

  const $ = (id) => document.getElementById(id);

  // -- formatting -------------------------------------------------------------------------
  function pct(x) { return x == null ? "–" : (100 * x).toFixed(1) + "%"; }
  function bytes(n) {
    if (n == null) return "–";
    const units = ["B", "KB", "MB", "GB", "TB", "PB"];
    let i = 0;
    let v = n;
    while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
    return (i === 0 ? v.toFixed(0) : v.toFixed(v >= 100 ? 0 : v >= 10 ? 1 : 2)) + " " + units[i];
  }
  function seconds(s) {
    if (s == null) return "–";
    if (s < 120) return s.toFixed(s < 10 ? 2 : 1) + " s";
    if (s < 7200) return (s / 60).toFixed(1) + " min";
    return (s / 3600).toFixed(1) + " h";
  }
  function money(x) { return x == null ? "–" : "$" + (x < 10 ? x.toFixed(4) : x.toFixed(2)); }
  function count(n) { return n == null ? "–" : Number(n).toLocaleString("en-US"); }

  function setTile(id, value, sub) {
    const tile = $(id);
    tile.querySelector(".value").textContent = value;
    tile.querySelector(".sub").textContent = sub || "";
  }

  // -- charts -----------------------------------------------------------------------------
  const charts = {};

  function makeChart(id, series, axes, scales) {
    const el = $(id);
    const opts = {
      width: Math.max(el.clientWidth, 300),
      height: 220,
      scales: Object.assign({ x: { time: true } }, scales || {}),
      // The service's clock (its ts), shown in UTC as the header's clock is: one clock.
      tzDate: (ts) => uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC"),
      series: [{}].concat(series),
      axes: [{}].concat(axes),
      legend: { live: true },
      cursor: { drag: { x: false, y: false } },
    };
    const data = [[]].concat(series.map(() => []));
    const plot = new uPlot(opts, data, el);
    charts[id] = plot;
    if (typeof ResizeObserver !== "undefined") {
      new ResizeObserver(() => plot.setSize({ width: Math.max(el.clientWidth, 300), height: 220 })).observe(el);
    }
    return plot;
  }

  function setChart(id, ts, columns) {
    const plot = charts[id];
    plot.setData([ts].concat(columns));
    const el = $(id);
    el.dataset.points = String(ts.length);
    let values = 0;
    for (const col of columns) for (const v of col) if (v != null) values += 1;
    el.dataset.values = String(values);
    el.classList.toggle("empty", ts.length === 0);
  }

  function initCharts() {
    const rate = { scale: "rate", values: (u, ticks) => ticks.map((t) => (100 * t).toFixed(0) + "%") };
    makeChart("chart-hit-rate", [
      { label: "live (60 s)", stroke: LIVE, width: 3, scale: "rate", value: (u, v) => pct(v) },
      { label: "shadow (60 s)", stroke: SHADOW, width: 1.5, scale: "rate", value: (u, v) => pct(v) },
      { label: "live (all)", stroke: LIVE, dash: [6, 4], scale: "rate", value: (u, v) => pct(v) },
      { label: "shadow (all)", stroke: SHADOW, dash: [6, 4], scale: "rate", value: (u, v) => pct(v) },
    ], [rate], { rate: { range: [0, 1] } });
    makeChart("chart-stall", [
      { label: "saved", stroke: "#2da44e", width: 2, fill: "rgba(45,164,78,0.08)", scale: "s",
        value: (u, v) => seconds(v) },
      { label: "incurred", stroke: "#cf222e", width: 2, scale: "s", value: (u, v) => seconds(v) },
      { label: "expected from prefetches", stroke: "#2da44e", dash: [6, 4], scale: "s", value: (u, v) => seconds(v) },
      { label: "GPU cost saved", stroke: "#8250df", width: 2, scale: "usd", value: (u, v) => money(v) },
    ], [
      { scale: "s", label: "seconds" },
      { scale: "usd", side: 1, label: "$", grid: { show: false } },
    ], { s: { range: (u, lo, hi) => [0, Math.max(hi || 0, 1)] }, usd: { range: (u, lo, hi) => [0, Math.max(hi || 0, 0.01)] } });
    makeChart("chart-bytes", [
      { label: "ordered", stroke: LIVE, width: 2, scale: "gb", value: (u, v) => (v == null ? "–" : v.toFixed(2) + " GB") },
      { label: "landed", stroke: "#2da44e", width: 2, scale: "gb", value: (u, v) => (v == null ? "–" : v.toFixed(2) + " GB") },
      { label: "wasted", stroke: "#cf222e", width: 2, scale: "gb", value: (u, v) => (v == null ? "–" : v.toFixed(2) + " GB") },
      { label: "used", stroke: "#8250df", width: 2, scale: "gb", value: (u, v) => (v == null ? "–" : v.toFixed(2) + " GB") },
    ], [{ scale: "gb", label: "GB" }], { gb: { range: (u, lo, hi) => [0, Math.max(hi || 0, 1)] } });
    makeChart("chart-queue", [
      { label: "open orders", stroke: "#57606a", width: 2, scale: "n", value: (u, v) => count(v) },
      { label: "on their way (GB)", stroke: LIVE, width: 2, scale: "gb", value: (u, v) => (v == null ? "–" : v.toFixed(2)) },
      { label: "landing (GB/s)", stroke: "#2da44e", width: 2, scale: "gb", value: (u, v) => (v == null ? "–" : v.toFixed(2)) },
    ], [
      { scale: "n", label: "orders" },
      { scale: "gb", side: 1, label: "GB, GB/s", grid: { show: false } },
    ], { n: { range: (u, lo, hi) => [0, Math.max(hi || 0, 1)] }, gb: { range: (u, lo, hi) => [0, Math.max(hi || 0, 0.1)] } });
  }

  function perSecond(ts, col) {
    // The rate between consecutive samples of a running total (null for the first point or a reset).
    return col.map((v, i) => {
      if (i === 0 || v == null || col[i - 1] == null || v < col[i - 1] || ts[i] <= ts[i - 1]) return null;
      return (v - col[i - 1]) / (ts[i] - ts[i - 1]);
    });
  }

  function drawSeries(body) {
    const ts = body.ts;
    const s = body.series;
    const gb = (col) => col.map((v) => (v == null ? null : v / GB));
    setChart("chart-hit-rate", ts, [s.live_recent_hit_rate, s.shadow_recent_hit_rate, s.live_hit_rate, s.shadow_hit_rate]);
    setChart("chart-stall", ts, [s.stall_seconds_saved, s.stall_seconds_incurred, s.expected_stall_seconds, s.stall_cost_saved]);
    setChart("chart-bytes", ts, [gb(s.bytes_ordered), gb(s.landed_bytes), gb(s.bytes_wasted), gb(s.bytes_used)]);
    setChart("chart-queue", ts, [s.open_orders, gb(s.inflight_bytes), gb(perSecond(ts, s.landed_bytes))]);
    $("stall-basis").textContent = body.stall_basis === "measured"
      ? "(GPU seconds, running totals; saved and incurred as judged on arriving requests, dashed: what the landed prefetches were expected to save)"
      : "(GPU seconds, running totals; expected: the scheduler's P(back in time) × stall avoided, over the prefetches that landed; not measured on arrivals)";
  }

  // -- tiles and tables -------------------------------------------------------------------
  // "learned (v3)" as it is; the heuristic's reason ("heuristic (no model at ...)") only on hover.
  function modelName(m) { return m == null ? "none" : (m.version != null ? m.predictor : m.predictor.split(" (")[0]); }
  function showModel(id, m) {
    const el = $(id);
    el.textContent = modelName(m);
    el.title = m == null ? "" : m.predictor;
  }

  function drawNow(now) {
    const live = now.models.live;
    const shadow = now.models.shadow;
    showModel("live-model", live);
    showModel("shadow-model", shadow);
    setTile("tile-live-hit-rate", pct(live.hit_rate),
      `${count(live.hits)} hits, ${count(live.misses)} misses, ${count(live.unscored)} unscored (${modelName(live)})`);
    setTile("tile-shadow-hit-rate", shadow == null ? "–" : pct(shadow.hit_rate),
      shadow == null ? "no shadow model" : `${count(shadow.hits)} hits, ${count(shadow.misses)} misses (${modelName(shadow)})`);
    setTile("tile-stall-saved", seconds(now.stall.seconds_saved), now.stall.basis === "measured"
      ? `measured on arrivals; ${seconds(now.stall.seconds_incurred)} incurred`
      : "expected from the prefetches landed (not measured)");
    setTile("tile-cost-saved", money(now.stall.cost_saved),
      now.stall.gpu_hour_price == null ? "no GPU-hour price configured" : `at $${now.stall.gpu_hour_price}/GPU-hour`);
    setTile("tile-prefetched", bytes(now.prefetch.landed_bytes),
      `${count(now.prefetch.landed)} orders landed; ${bytes(now.scheduler.bytes_ordered)} ordered`);
    // Landed bytes end used or wasted (evicted, demoted or past their hold before a request
    // used them), or still wait: the shares are of the bytes landed.
    const sched = now.scheduler;
    setTile("tile-wasted", bytes(sched.bytes_wasted), sched.bytes_landed > 0
      ? `${pct(sched.wasted_share)} of the ${bytes(sched.bytes_landed)} landed, ${pct(sched.used_share)} used`
      : "nothing landed yet");
    setTile("tile-queue", count(now.scheduler.open_orders),
      `${bytes(now.scheduler.inflight_bytes)} on their way; ${count(now.scheduler.completed)} completed, ${count(now.scheduler.cancelled)} cancelled`);
    setTile("tile-sessions", count(now.scheduler.tracked_sessions),
      `${count(now.scheduler.candidates)} prefetch candidates`);
    const sig = now.signals;
    setTile("tile-signals", pct(sig.followed_share), sig.total > 0
      ? `${count(sig.followed)} of ${count(sig.total)} signals had a request within ${sig.window_seconds} s`
      : "no signal yet");
    drawRetrain(now.retrain);
    drawShadow(now);
    drawInstances(now);
    drawSessions(now);
    drawSignals(sig);
  }

  // The retraining schedule: its state, the candidate's paired Brier scores while it shadows,
  // else the last run's outcome and why.
  function brier(v) { return v == null ? "–" : v.toFixed(4); }
  function drawRetrain(r) {
    if (r == null) return;
    const tile = $("tile-retrain");
    tile.dataset.state = r.state;
    tile.dataset.outcome = r.last == null ? "" : r.last.outcome;
    let sub;
    if (r.candidate != null) {
      const j = r.candidate.judge;
      sub = j == null || j.judged === 0
        ? `${r.candidate.version}: no outcome judged yet`
        : `${r.candidate.version}: Brier ${brier(j.shadow_brier)} vs serving ${brier(j.live_brier)}, ${count(j.judged)} of ${count(r.candidate.min_judged)} judged`;
    } else if (r.last != null) {
      sub = `last run ${r.last.outcome}: ${r.last.reason}`;
    } else {
      sub = r.enabled ? `every ${seconds(r.every_seconds)}; no run yet` : "off (KVP_RETRAIN_EVERY_SECONDS)";
    }
    const runs = r.runs;
    setTile("tile-retrain", r.state, sub);
    tile.title = `runs: ${runs.promoted} promoted, ${runs.discarded} discarded, ${runs.failed} failed, ${runs.skipped} skipped`;
  }

  // The shadow judged as a retrained candidate is, whoever set it: calibration (Brier, lower is
  // better), hit rate and the cost of its advice beside the serving model's; and the latest
  // sessions the two advised differently (the service's bounded list).
  function advice(a) { return a.retention + (a.prefetch ? " + prefetch" : "") + ` (${pct(a.p_keep)})`; }
  function drawShadow(now) {
    const live = now.models.live;
    const shadow = now.models.shadow;
    const c = now.models.comparison;
    $("shadow-panel").dataset.shadow = shadow == null ? "none" : (shadow.version || "heuristic");
    if (shadow == null || c == null) {
      $("shadow-hint").textContent = "(no shadow model)";
      $("disagreements-hint").textContent = "";
      fillTable("comparison", [], "no shadow model", 3, () => null);
      fillTable("disagreements", [], "no shadow model", 5, () => null);
      return;
    }
    $("shadow-hint").textContent = `(${modelName(shadow)} against ${modelName(live)}; ${count(c.judged)} outcomes judged)`;
    const rows = [
      ["Brier score (lower is better)", brier(c.live_brier), brier(c.shadow_brier)],
      ["hit rate", pct(live.hit_rate), pct(shadow.hit_rate)],
      ["keep or prefetch advice", count(live.keep_predictions), count(shadow.keep_predictions)],
      ["bytes kept (advice)", bytes(live.keep_advice_bytes), bytes(shadow.keep_advice_bytes)],
      ["bytes prefetched (advice)", bytes(live.prefetch_advice_bytes), bytes(shadow.prefetch_advice_bytes)],
    ];
    fillTable("comparison", rows, "", 3, (r) => {
      const tr = document.createElement("tr");
      cell(tr, r[0]);
      cell(tr, r[1], "num");
      cell(tr, r[2], "num");
      return tr;
    });
    $("disagreements-hint").textContent = `(${count(c.disagreed)} of ${count(c.paired)} paired advice records differ; the latest first)`;
    fillTable("disagreements", c.disagreements, "no disagreement yet", 5, (d) => {
      const tr = document.createElement("tr");
      if (d.session_id != null) tr.dataset.session = d.session_id;
      cell(tr, d.session_id == null ? "hidden" : d.session_id, "id");
      cell(tr, advice(d.live));
      cell(tr, advice(d.shadow));
      cell(tr, bytes(d.context_bytes), "num");
      cell(tr, seconds(Math.max(now.now - d.made_ts, 0)) + " ago", "num");
      return tr;
    });
  }

  function drawSignals(sig) {
    $("signals-window").textContent = `(followed: a request of the session within ${sig.window_seconds} s)`;
    fillTable("signals", sig.kinds, "no signal yet", 4, (k) => {
      const tr = document.createElement("tr");
      tr.dataset.kind = k.kind;
      cell(tr, k.kind, "id");
      cell(tr, count(k.signals), "num");
      cell(tr, count(k.followed), "num");
      const td = cell(tr, "", "bar-cell");
      const bar = document.createElement("div");
      bar.className = "bar";
      bar.style.width = (100 * (k.followed_share || 0)).toFixed(1) + "%";
      const label = document.createElement("span");
      label.textContent = pct(k.followed_share);
      td.append(bar, label);
      return tr;
    });
  }

  // Each tool's calls and run times; its oldest call in flight and when it is predicted back
  // (null: it outlasted every call seen); its latest return against the one predicted at its start.
  function drawTools(body) {
    $("tools-hint").textContent = `(the ${body.tracked_max} most frequent, the rest as other; `
      + `${count(body.expired)} calls never seen back)`;
    fillTable("tools", body.tools, "no tool call yet", 6, (t) => {
      const tr = document.createElement("tr");
      tr.dataset.tool = t.tool;
      cell(tr, t.tool, "id");
      cell(tr, count(t.calls), "num");
      cell(tr, seconds(t.p50_seconds), "num");
      cell(tr, seconds(t.p90_seconds), "num");
      const oldest = t.running[0];
      let flight = count(t.in_flight);
      if (oldest != null) {
        flight += oldest.predicted_return_at == null
          ? `; running ${seconds(oldest.running_seconds)}, past every call seen`
          : `; back in ${seconds(Math.max(oldest.predicted_return_at - body.now, 0))}`;
      }
      cell(tr, flight, "num");
      const last = t.returns.length > 0 ? t.returns[t.returns.length - 1] : null;
      let back = "–";
      if (last != null) {
        const took = seconds(last.returned_at - last.started_at);
        back = last.predicted_return_at == null
          ? `took ${took}, nothing to predict from`
          : `took ${took}, predicted ${seconds(last.predicted_return_at - last.started_at)}`;
        if (t.return_error_p50_seconds != null) back += ` (median error ${seconds(t.return_error_p50_seconds)})`;
      }
      cell(tr, back, "num");
      return tr;
    });
  }

  function cell(tr, text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    tr.appendChild(td);
    return td;
  }

  function fillTable(id, rows, emptyText, colspan, build) {
    const table = $(id);
    const tbody = table.querySelector("tbody");
    const out = document.createDocumentFragment();
    if (rows.length === 0) {
      const tr = document.createElement("tr");
      tr.className = "empty";
      const td = cell(tr, emptyText);
      td.colSpan = colspan;
      out.appendChild(tr);
    }
    for (const r of rows) out.appendChild(build(r));
    tbody.replaceChildren(out);
    table.dataset.rows = String(rows.length);
  }

  function drawInstances(now) {
    const rows = now.instances;
    const most = Math.max(1, ...rows.map((r) => r.inflight_bytes));
    $("instances-total").textContent = now.instances_total > rows.length
      ? `(${rows.length} of ${now.instances_total}, most bytes on their way first)` : "";
    fillTable("instances", rows, "no instance has reported yet", 6, (r) => {
      const tr = document.createElement("tr");
      tr.dataset.instance = r.instance_id;
      cell(tr, r.instance_id, "id");
      const o = r.open_orders;
      cell(tr, `${o.prefetch} / ${o.pin} / ${o.demote}`, "num");
      const td = cell(tr, "", "bar-cell");
      const bar = document.createElement("div");
      bar.className = "bar";
      bar.style.width = (100 * r.inflight_bytes / most).toFixed(1) + "%";
      const label = document.createElement("span");
      label.textContent = bytes(r.inflight_bytes);
      td.append(bar, label);
      cell(tr, seconds(r.link_backlog_seconds), "num");
      cell(tr, r.free_kv_bytes == null ? "not reported" : bytes(r.free_kv_bytes), "num");
      cell(tr, r.queue_depth == null ? "–" : count(r.queue_depth), "num");
      return tr;
    });
  }

  function drawSessions(now) {
    fillTable("sessions", now.top_sessions, "no session advised yet", 7, (s) => {
      const tr = document.createElement("tr");
      // null: ids are hidden (KVP_DASHBOARD_SHOW_SESSION_IDS, or a token; SECURITY.md).
      if (s.session_id != null) tr.dataset.session = s.session_id;
      cell(tr, s.session_id == null ? "hidden" : s.session_id, "id");
      cell(tr, s.instance_id == null ? "–" : s.instance_id, "id");
      cell(tr, pct(s.p_soon), "num");
      cell(tr, pct(s.p_keep), "num");
      cell(tr, s.retention + (s.prefetch ? " + prefetch" : ""));
      cell(tr, bytes(s.context_bytes), "num");
      cell(tr, seconds(s.advised_seconds_ago) + " ago", "num");
      return tr;
    });
  }

  // -- polling ----------------------------------------------------------------------------
  async function getJson(url) {
    const r = await fetch(url, { cache: "no-store", headers: { accept: "application/json" } });
    const body = await r.json().catch(() => null);
    if (!r.ok) throw new Error(`${url}: ${r.status} ${(body && body.detail) || r.statusText}`);
    return body;
  }

  let polls = 0;
  let timer = null;
  async function poll() {
    clearTimeout(timer);
    const status = $("status");
    try {
      const since = $("range").value;
      const [now, series, tools] = await Promise.all([
        getJson("/v1/dashboard/now?limit=20&instances=50"),
        getJson(`/v1/dashboard/series?since_seconds=${encodeURIComponent(since)}`),
        getJson("/v1/tools?limit=1"),
      ]);
      drawNow(now);
      drawSeries(series);
      drawTools(tools);
      polls += 1;
      document.body.dataset.polls = String(polls);
      // One clock: the service's (its KVP_CLOCK_SPEED, a replay's time), never the browser's.
      const clock = $("service-clock");
      clock.dateTime = new Date(now.now * 1000).toISOString();
      clock.dataset.ts = String(now.now);
      clock.textContent = new Date(now.now * 1000).toISOString().slice(11, 19) + " UTC";
      status.textContent = series.count === 0
        ? "no samples yet: the charts fill as the service samples its counters"
        : `updated · ${series.count} samples`;
      status.classList.remove("error");
    } catch (err) {
      status.textContent = `cannot update: ${err.message}`;
      status.classList.add("error");
    } finally {
      clearTimeout(timer);  // one chain of polls, however many were started
      timer = setTimeout(poll, POLL_MS);
    }
  }

  initCharts();
  $("range").addEventListener("change", poll);
  poll();
})();
