"""The run's JSON: throughput, latency, errors, the series, and the service's RSS against a bound.

The bound prices the state the service keeps by design, each kind bounded by a setting or a
limit, as its growth from the start to its highest count over the samples times what one unit
costs (bench/load/calibrate.py). The highest, not the last: RSS seldom falls when a structure
shrinks (the allocator keeps freed memory for reuse), so the dedupe ring's sawtooth, say, costs
its peak. The state:

- sessions tracked, remembered event ids, resident blocks: the store's own counts (/readyz),
  the first two never above what the settings allow (the sessions active within
  KVP_SESSION_RETENTION_SECONDS, worked out by the client; KVP_DEDUPE_MAX_IDS). Once the dedupe
  ring has turned over twice (the service has accepted KVP_DEDUPE_MAX_IDS events), it is priced
  at no less than the peak RSS a ring of that size was measured to reach, less its start;
- removal tombstones: worked out by the client from the events it sent, by the store's rule
  (bench/load/traffic.py's Tombstones), at most two windows' worth per location;
- sessions advised: the scheduler's tracked sessions (/v1/scheduler), each with its latest
  advice, its pin, and the advice ledger's entry;
- the pull sink's orders and the order ids its dedupe remembers: from the scheduler's order
  counters (/metrics) and the sink's expiry rule, an upper bound (nothing reports them).

A count's lower bound is used at the start and its upper bound after, so the growth priced is
never less than the growth there was.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from bench._util import machine
from bench.load.client import KINDS, Load

# Growth the unit costs do not price: the bounded structures (the timeline's samples, the
# scheduler's advice, metrics, queues) and allocator slack. Whichever is larger.
ALLOWANCE_MIN_BYTES = 32 * 2**20
ALLOWANCE_SHARE = 0.10
STORE_COUNTS = ("sessions", "remembered_event_ids", "resident_blocks")
# What the bound prices, and the unit cost of each (calibrate()'s keys).
UNIT_COSTS = {
    "sessions": "bytes_per_session",
    "remembered_event_ids": "bytes_per_event_id",
    "resident_blocks": "bytes_per_resident_block",
    "tombstones": "bytes_per_tombstone",
    "advised_sessions": "bytes_per_advised_session",
    "orders_held_by_pull_sink": "bytes_per_held_order",
    "order_ids_remembered_by_pull_sink": "bytes_per_remembered_order_id",
}


def service_settings(env: dict[str, str]) -> dict[str, Any]:
    """The service's settings the accounting depends on: what `env` sets, else the defaults."""
    from app.core.config import Settings
    from app.decide.scheduler import SchedulerConfig
    from app.deliver._dedupe import MAX_REMEMBERED_IDS

    def get(name: str) -> Any:
        default = Settings.model_fields[name].default
        raw = env.get(f"KVP_{name.upper()}")
        return default if raw is None else type(default)(raw)

    plan_interval = float(get("plan_interval_seconds"))
    lease = float(get("order_lease_seconds"))
    # Pins and demotes are needed by their making; a prefetch by a share of the lead later.
    scheduler = SchedulerConfig(bytes_per_block=1)  # the service leaves the lead at its default
    lead = scheduler.lead_seconds * scheduler.needed_within_fraction
    return {
        "reorder_window_seconds": float(get("reorder_window_seconds")),
        "session_retention_seconds": float(get("session_retention_seconds")),
        "dedupe_max_ids": int(get("dedupe_max_ids")),
        "order_sink": str(get("order_sink")),
        "order_lease_seconds": lease,
        # The pull sink drops an order a lease after its needed_by, at a later submit, by the
        # newest created_ts submitted (the planning loop's clock, one tick behind at most).
        "order_hold_seconds": lease + lead + plan_interval,
        "order_dedupe_seconds": float(get("order_dedupe_seconds")),
        "order_ids_max": MAX_REMEMBERED_IDS,
    }


# -- what the pull sink holds, from the scheduler's counters --------------------------------


def _issued_at_or_before(points: Sequence[dict[str, Any]], perf: float) -> int | None:
    found = None
    for p in points:
        if p["perf"] > perf:
            break
        found = p["orders"]["issued"]
    return found


def _issued_at_or_after(points: Sequence[dict[str, Any]], perf: float) -> int | None:
    for p in points:
        if p["perf"] >= perf:
            return int(p["orders"]["issued"])
    return None


def _issued_within(points: Sequence[dict[str, Any]], i: int, seconds: float, *, upper: bool) -> int:
    """Orders issued in the `seconds` before points[i] (points[0]: the service's start, nothing
    issued before it): at most (`upper`) or at least, as far as the samples tell."""
    p = points[i]
    since = p["perf"] - seconds
    if since <= points[0]["perf"]:
        return int(p["orders"]["issued"])
    if upper:
        base = _issued_at_or_before(points[: i + 1], since)
    else:
        base = _issued_at_or_after(points[: i + 1], since)
    return int(p["orders"]["issued"]) - int(base if base is not None else 0)


def pull_sink_counts(
    points: Sequence[dict[str, Any]], i: int, settings: dict[str, Any]
) -> dict[str, dict[str, int]]:
    """Orders the pull sink holds at points[i], and order ids it remembers: {name: {low, high}}.

    Held: at most those issued within `order_hold_seconds` (older ones have expired); at least
    those issued within one lease (none can have expired) less every order the scheduler saw end.
    Remembered ids: those issued within the sink's dedupe window, at most `order_ids_max`."""
    if settings["order_sink"] != "pull":
        zero = {"low": 0, "high": 0}
        return {"orders_held_by_pull_sink": zero, "order_ids_remembered_by_pull_sink": zero}
    o = points[i]["orders"]
    ended = o["cancelled"] + o["completed"] + o["failed"]
    cap, window = settings["order_ids_max"], settings["order_dedupe_seconds"]
    return {
        "orders_held_by_pull_sink": {
            "low": max(
                0, _issued_within(points, i, settings["order_lease_seconds"], upper=False) - ended
            ),
            "high": _issued_within(points, i, settings["order_hold_seconds"], upper=True),
        },
        "order_ids_remembered_by_pull_sink": {
            "low": min(cap, _issued_within(points, i, window, upper=False)),
            "high": min(cap, _issued_within(points, i, window, upper=True)),
        },
    }


def counts(
    points: Sequence[dict[str, Any]], i: int, settings: dict[str, Any]
) -> dict[str, dict[str, int]]:
    """Every count the bound prices at points[i], as {name: {low, high}}."""
    p = points[i]
    stats = p["stats"] or {}
    out = {k: {"low": int(stats.get(k, 0)), "high": int(stats.get(k, 0))} for k in STORE_COUNTS}
    # The store's counts, but never more than its settings allow: a store that kept more (forgot
    # no session, say) would have its excess left unexplained.
    for name, cap in (
        ("sessions", p["sessions_within_retention"]),
        ("remembered_event_ids", settings["dedupe_max_ids"]),
    ):
        out[name] = {k: min(v, cap) for k, v in out[name].items()}
    out["tombstones"] = {"low": p["tombstones_alive"], "high": p["tombstones_held_at_most"]}
    out["advised_sessions"] = {"low": p["advised_sessions"], "high": p["advised_sessions"]}
    out.update(pull_sink_counts(points, i, settings))
    return out


# -- the bound ----------------------------------------------------------------------------------


def _explained(
    start: dict[str, dict[str, int]],
    high_water: dict[str, int],
    calibration: dict[str, Any],
    ring_turned: bool,
) -> dict[str, int]:
    out = {
        name: round(max(0, high_water[name] - start[name]["low"]) * calibration[cost])
        for name, cost in UNIT_COSTS.items()
    }
    peak = calibration.get("dedupe_ring_peak_bytes")
    if ring_turned and peak is not None:
        # The freed generation's table is not priced by its ids at their cost in a young ring
        # (the start's), so the ring is priced at what a whole ring was measured to reach.
        ids = "remembered_event_ids"
        out[ids] = max(out[ids], round(peak - start[ids]["low"] * calibration[UNIT_COSTS[ids]]))
    return out


def bound(
    points: Sequence[dict[str, Any]],
    first: int,
    calibration: dict[str, Any],
    settings: dict[str, Any],
) -> tuple[dict[str, Any], list[dict[str, int]]]:
    """The bound over points[first:] (the measured window), and each sample's explained and
    unexplained growth so far, for the series."""
    start = counts(points, first, settings)
    high_water = {name: c["high"] for name, c in start.items()}
    rss0 = points[first]["rss_bytes"]
    per_sample = []
    # The memory store's ring turns over for the second time once it has taken two halves of
    # its ids (every event accepted is one): from then on it holds a freed generation's table.
    turned_at = 2 * ((settings["dedupe_max_ids"] + 1) // 2)
    ring_turned = False
    for i in range(first, len(points)):
        for name, count in counts(points, i, settings).items():
            high_water[name] = max(high_water[name], count["high"])
        ring_turned = points[i]["events_ingested"] >= turned_at
        explained_bytes = sum(_explained(start, high_water, calibration, ring_turned).values())
        per_sample.append(
            {
                "explained_bytes": explained_bytes,
                "unexplained_bytes": points[i]["rss_bytes"] - rss0 - explained_bytes,
            }
        )
    end = counts(points, len(points) - 1, settings)
    explained = _explained(start, high_water, calibration, ring_turned)
    explained_total = sum(explained.values())
    allowance = max(ALLOWANCE_MIN_BYTES, round(ALLOWANCE_SHARE * explained_total))
    growth = points[-1]["rss_bytes"] - rss0
    out = {
        "rule": (
            "end RSS <= start RSS + sum over the counted state of (its highest count - its count "
            "at the start) x its measured cost (the dedupe ring, once turned over: at least its "
            "measured peak less its start) + allowance "
            f"(max({ALLOWANCE_MIN_BYTES // 2**20} MiB, {ALLOWANCE_SHARE:.0%} of that))"
        ),
        "unit_costs": calibration,
        "counts": {
            name: {
                "start": start[name]["low"],
                "high_water": high_water[name],
                "end": end[name]["high"],
            }
            for name in UNIT_COSTS
        },
        "growth": {name: high_water[name] - start[name]["low"] for name in UNIT_COSTS},
        "explained_bytes": explained,
        "allowance_bytes": allowance,
        "bound_bytes": explained_total + allowance,
        "end_rss_limit_bytes": rss0 + explained_total + allowance,
        "within_bound": growth <= explained_total + allowance,
        "unexplained_growth_bytes": growth - explained_total,
        # The end is one point of the ring's cycle: the most left unexplained at any sample.
        "unexplained_max_bytes": max(x["unexplained_bytes"] for x in per_sample),
        "settings": settings,
        "dedupe_ring_turned_over": ring_turned,
    }
    if settings["order_sink"] != "pull":
        out["not_priced"] = (
            f"the orders and order ids the {settings['order_sink']} sink keeps in the service"
        )
    return out, per_sample


# -- the JSON -------------------------------------------------------------------------------


def series(
    points: Sequence[dict[str, Any]],
    first: int,
    load: Load,
    settings: dict[str, Any],
    per_sample: list[dict[str, int]] | None,
) -> list[dict[str, Any]]:
    """One entry per sample of the measured window; rates over the interval that ends there."""
    out = []
    for k, i in enumerate(range(first, len(points))):
        s = points[i]
        stats = s["stats"] or {}
        held = pull_sink_counts(points, i, settings)
        entry: dict[str, Any] = {
            "t": s["t"],
            "rss_bytes": s["rss_bytes"],
            "sessions": stats.get("sessions"),
            "sessions_within_retention": s["sessions_within_retention"],
            "remembered_event_ids": stats.get("remembered_event_ids"),
            "resident_blocks": stats.get("resident_blocks"),
            "tombstones_alive": s["tombstones_alive"],
            "tombstones_held_at_most": s["tombstones_held_at_most"],
            "advised_sessions": s["advised_sessions"],
            "orders_issued": s["orders"]["issued"],
            "orders_held_at_most": held["orders_held_by_pull_sink"]["high"],
            "load_average_1m": s["load_average_1m"],
        }
        if per_sample is not None:
            entry.update(per_sample[k])
        if i > first:
            prev = points[i - 1]
            w = load.window(prev["perf"], s["perf"])
            dt = s["perf"] - prev["perf"]
            entry.update(
                {
                    "events_per_second": w["event_batches"]["events_per_second"],
                    "route_hints_per_second": w["route_hints"]["requests_per_second"],
                    "event_batch_p99_ms": w["event_batches"]["latency_ms"]["p99"],
                    "route_hint_p99_ms": w["route_hints"]["latency_ms"]["p99"],
                    "service_cpu_percent": round(
                        100 * (s["service_cpu_seconds"] - prev["service_cpu_seconds"]) / dt, 1
                    ),
                    "client_cpu_percent": round(
                        100 * (s["client_cpu_seconds"] - prev["client_cpu_seconds"]) / dt, 1
                    ),
                }
            )
        out.append(entry)
    return out


def result(
    *,
    points: list[dict[str, Any]],
    first: int,
    load: Load,
    settings: dict[str, Any],
    calibration: dict[str, Any] | None,
    startup_rss: int,
    ceiling: list[dict[str, Any]],
    service_end: dict[str, Any],
    redis: dict[str, Any] | None,
    config: dict[str, Any],
    bench_seconds: float,
) -> dict[str, Any]:
    """The JSON. points[0]: the service just started; points[first]: the measured window's start
    (after the warm-up); points[-1]: its end."""
    start, end = points[first], points[-1]
    secs = end["perf"] - start["perf"]
    measured = load.window(start["perf"], end["perf"])
    c_start, c_end = counts(points, first, settings), counts(points, len(points) - 1, settings)
    memory: dict[str, Any] = {
        "rss_after_startup_bytes": startup_rss,
        "rss_start_bytes": start["rss_bytes"],
        "rss_end_bytes": end["rss_bytes"],
        "rss_peak_bytes": max(p["rss_bytes"] for p in points[first:]),
        "rss_growth_bytes": end["rss_bytes"] - start["rss_bytes"],
        "store_stats_start": start["stats"] or {},
        "store_stats_end": end["stats"] or {},
        "sessions_within_retention": {
            "start": start["sessions_within_retention"],
            "end": end["sessions_within_retention"],
        },
        "tombstones_alive": {"start": start["tombstones_alive"], "end": end["tombstones_alive"]},
        "tombstones_held_at_most": {
            "start": start["tombstones_held_at_most"],
            "end": end["tombstones_held_at_most"],
        },
        "pull_sink": {
            name: {"start": c_start[name], "end": c_end[name]}
            for name in ("orders_held_by_pull_sink", "order_ids_remembered_by_pull_sink")
        },
    }
    if redis is not None and redis.get("used_memory_start") is not None:
        memory["redis_used_memory_bytes"] = {
            "start": redis["used_memory_start"],
            "end": redis["used_memory_end"],
            "note": "the whole Redis server, not only this run's keys",
        }
    per_sample = None
    if calibration is not None:
        memory["bound"], per_sample = bound(points, first, calibration, settings)
    ceilings = {
        kind: [c[kind][key] for c in ceiling]
        for kind, key in (
            ("event_batches", "events_per_second"),
            ("route_hints", "requests_per_second"),
        )
    }

    def ratio(kind: str, key: str) -> float | None:
        xs = ceilings[kind]
        if not xs or not measured[kind][key] or not sum(xs):
            return None
        return round(measured[kind][key] / (sum(xs) / len(xs)), 3)

    def cpu(key: str) -> float:
        return round(100 * (end[key] - start[key]) / secs, 1)

    traffic = Counter[str]()
    for sh in load.shards:
        traffic.update(sh.events)
    return {
        "throughput": {
            "seconds": round(secs, 2),
            "event_batches": {
                k: measured["event_batches"][k]
                for k in ("requests", "requests_per_second", "events", "events_per_second")
            },
            "route_hints": {
                k: measured["route_hints"][k] for k in ("requests", "requests_per_second")
            },
        },
        "latency_ms": {kind: measured[kind]["latency_ms"] for kind in KINDS},
        "errors": load.errors(),
        "memory": memory,
        "cpu_percent": {
            "service": cpu("service_cpu_seconds"),
            "client": cpu("client_cpu_seconds"),
            "note": "100 = one core; the client is this process (generation + HTTP)",
        },
        "ceiling": {
            "phases": ceiling,
            "ratio_to_ceiling": {
                "events_per_second": ratio("event_batches", "events_per_second"),
                "route_hints_per_second": ratio("route_hints", "requests_per_second"),
            },
        },
        "series": series(points, first, load, settings, per_sample),
        "traffic": {
            "events_by_type": dict(sorted(traffic.items())),
            "sessions_started": sum(sh.sessions_started for sh in load.shards),
            "sessions_closed": sum(sh.sessions_closed for sh in load.shards),
            "sessions_abandoned": sum(sh.sessions_abandoned for sh in load.shards),
            "note": "the whole run, warm-up included",
        },
        "service_end": service_end,
        "redis": None
        if redis is None
        else {"prefix": redis["prefix"], "keys_removed": redis["keys_removed"]},
        "config": config,
        "environment": {
            **machine(),
            "load_average_1m": {"start": start["load_average_1m"], "end": end["load_average_1m"]},
            "cpu_pressure_avg60_percent": {
                "start": start["cpu_pressure_avg60"],
                "end": end["cpu_pressure_avg60"],
            },
        },
        "bench_seconds": bench_seconds,
    }
