"""The framework's ceiling: a bare FastAPI endpoint that reads the body and parses the batch.

It does what POST /v1/events cannot skip (HTTP, FastAPI routing, reading the body, the one
pydantic pass `batch_adapter.validate_json`) and nothing the service adds (dedupe, the event
log, fsync, applying to the store, the list of accepted ids in the answer).
"""

from __future__ import annotations

import orjson
from fastapi import FastAPI, Request, Response

from kvprefetch_client.events import batch_adapter

app = FastAPI(title="kvprefetch ingest ceiling")


@app.get("/healthz")
async def healthz() -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")


@app.post("/v1/events")
async def post_events(request: Request) -> Response:
    body = await request.body()
    batch = batch_adapter.validate_json(body)
    return Response(orjson.dumps({"events": len(batch.events)}), media_type="application/json")
