"""What is read from the service while it runs (/readyz, /metrics, its log) and from its Redis."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def readyz(url: str, headers: dict[str, str]) -> dict[str, Any] | None:
    import httpx

    try:
        r = httpx.get(url + "/readyz", headers=headers, timeout=10.0)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def scheduler(url: str, headers: dict[str, str]) -> dict[str, Any] | None:
    """GET /v1/scheduler: what the scheduler holds (tracked sessions, open orders) and its
    totals."""
    import httpx

    try:
        r = httpx.get(url + "/v1/scheduler", headers=headers, timeout=10.0)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def metrics(url: str, headers: dict[str, str]) -> dict[str, float] | None:
    """The service's own counters, those not zero (histograms: sum and count only)."""
    import httpx

    try:
        r = httpx.get(url + "/metrics", headers=headers, timeout=10.0)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        name, _, value = line.rpartition(" ")
        base = name.split("{")[0]
        if not base.startswith("kvprefetch_") or not base.endswith(("_total", "_sum", "_count")):
            continue
        try:
            if float(value):
                out[name] = float(value)
        except ValueError:
            continue
    return out


def log_summary(path: Path) -> dict[str, Any]:
    """Problems the service logged (they need not show as HTTP errors), and its last lines if
    any."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {"errors": None, "warnings": None, "tail": None}
    errors = sum(
        " ERROR " in ln or " CRITICAL " in ln or ln.startswith("Traceback") for ln in lines
    )
    warnings = sum(" WARNING " in ln for ln in lines)
    return {
        "errors": errors,
        "warnings": warnings,
        "tail": "\n".join(lines[-15:])[-1500:] if errors or warnings else None,
    }


def events_ingested(metrics: dict[str, float] | None) -> int:
    """Events the service has accepted since it started, all types."""
    return int(
        sum(
            v
            for k, v in (metrics or {}).items()
            if k.startswith("kvprefetch_events_ingested_total")
        )
    )


def order_totals(metrics: dict[str, float] | None) -> dict[str, int]:
    """The scheduler's order counters, all kinds summed: issued, and the ends it saw (cancelled,
    completed, failed)."""
    out = {}
    for key in ("issued", "cancelled", "completed", "failed"):
        prefix = f"kvprefetch_orders_{key}_total"
        out[key] = int(sum(v for k, v in (metrics or {}).items() if k.startswith(prefix)))
    return out


def redis_memory(url: str) -> int | None:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        return int(client.info("memory")["used_memory"])
    except redis.RedisError:
        return None
    finally:
        client.close()


def redis_clean(url: str, prefix: str) -> int:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=30)
    n = 0
    try:
        batch = []
        for key in client.scan_iter(match=f"{prefix}:*", count=5000):
            batch.append(key)
            if len(batch) >= 1000:
                n += client.unlink(*batch)
                batch = []
        if batch:
            n += client.unlink(*batch)
    finally:
        client.close()
    return n
