"""Read the live state: sessions, instances, block residency.

The handlers are async so they run on the event loop, the thread that applies events: a read
never sees a half-applied batch of the in-memory store. With the Redis store (whose batches are
atomic in Redis) they read on a worker thread instead (app/engine/storethread.py).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Request, Response
from pydantic import BaseModel

from app.api.deps import StoreDep, StoreThreadDep
from app.api.errors import Error, error_response, field_error_route
from app.engine.state.base import InstanceView, LocationView, SessionView


def _path_error(request: Request, error: dict[str, Any]) -> Response:
    """A bad path parameter, named."""
    name = str(error["loc"][-1])
    return error_response(422, name, f"the path parameter {name}: {error['msg']}")


router = APIRouter(tags=["state"], route_class=field_error_route(_path_error))


class InstancesResponse(BaseModel):
    instances: list[InstanceView]


class LocationsResponse(BaseModel):
    locations: list[LocationView]


@router.get("/sessions/{session_id}", response_model=SessionView,
            responses={404: {"model": Error, "description": "No event has named this session."},
                       422: {"model": Error, "description": "The session id is longer than 256 characters."}})
async def get_session(session_id: Annotated[str, Path(min_length=1, max_length=256)],
                      store: StoreDep, store_thread: StoreThreadDep) -> SessionView | Response:
    view = await store_thread.read(store.session, session_id)
    if view is None:
        return error_response(404, "session_id", f"session {session_id!r} is not known")
    return view


@router.get("/instances", response_model=InstancesResponse)
async def get_instances(store: StoreDep, store_thread: StoreThreadDep) -> InstancesResponse:
    return InstancesResponse(instances=await store_thread.read(store.instances))


@router.get("/locations", response_model=LocationsResponse)
async def get_locations(store: StoreDep, store_thread: StoreThreadDep) -> LocationsResponse:
    """Every location that holds KV blocks, each block counted once however many sessions use it."""
    return LocationsResponse(locations=await store_thread.read(store.locations))
