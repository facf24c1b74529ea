"""GET /metrics: the Prometheus exposition (app/observe/metrics.py has what is in it and why)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from app.api.deps import MetricsDep, StoreHealthDep
from app.observe.metrics import CONTENT_TYPE

router = APIRouter(tags=["health"])


@router.get(
    "/metrics",
    response_class=Response,
    summary="Prometheus metrics",
    responses={200: {"content": {CONTENT_TYPE: {}}, "description": "The text exposition format."}},
)
async def metrics(metrics: MetricsDep, health: StoreHealthDep) -> Response:
    """Every `kvprefetch_*` metric in Prometheus's text format; open, like /healthz. With several
    workers (PROMETHEUS_MULTIPROC_DIR) it sums them all, whichever worker answers. The store's
    figures are its last background probe's: a scrape never waits on the store."""
    metrics.store_probed(health.last, health.monotonic())
    return Response(metrics.exposition(), media_type=CONTENT_TYPE)
